"""A local `custom_generate` repository for transformers (see goose.hf.HUB_ENTRY)."""
