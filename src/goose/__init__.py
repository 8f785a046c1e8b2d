"""goose: lossless, training-free speculative decoding (GOOSE spine trees) for Hugging Face causal LMs.

The public names are imported on first use (module ``__getattr__``), so ``import goose`` and the command
line's help and argument errors do not pay for torch and transformers.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "DecodeConfig": ".config", "EngineConfig": ".config", "GooseConfig": ".config",
    "Decoder": ".decoding", "GenerationResult": ".decoding", "generate": ".decoding",
    "METHODS": ".engine.methods",
    "Engine": ".engine.scheduler", "Request": ".engine.scheduler",
    "GooseError": ".errors", "QueueFull": ".errors", "EngineClosed": ".errors", "EngineFailed": ".errors",
    "RequestFailed": ".errors", "RequestCancelled": ".errors",
    "HUB_ENTRY": ".integrations.hf", "custom_generate": ".integrations.hf",
    "DEFAULT_MODEL": ".loading.packaged", "load_model": ".loading.model",
}

__all__ = ["Decoder", "Engine", "Request", "GenerationResult", "generate", "GooseConfig", "DecodeConfig",
           "EngineConfig", "GooseError", "QueueFull", "EngineClosed", "EngineFailed", "RequestFailed",
           "RequestCancelled", "METHODS", "DEFAULT_MODEL", "load_model", "custom_generate", "HUB_ENTRY"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'goose' has no attribute '{name}'")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
