"""transformers loads `generate` from here for ``model.generate(custom_generate=goose.HUB_ENTRY, ...)``."""

from goose.integrations.hf import hub_generate as generate  # noqa: F401
