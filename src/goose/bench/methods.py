"""The benchmark's method names: goose's own (`goose.engine.methods`) and Hugging Face's `generate` with the
keyword arguments each one adds. Free of torch, so the command line can check names before any load."""

from __future__ import annotations

from ..cliargs import METHODS

HF_METHODS = {"hf-ar": {}, "hf-pld": {"prompt_lookup_num_tokens": 10}}
ALL_METHODS = METHODS + tuple(HF_METHODS)
