"""A local `custom_generate` repository for transformers (see goose.integrations.hf.HUB_ENTRY)."""
