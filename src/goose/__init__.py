"""goose: lossless, training-free speculative decoding (GOOSE spine trees) for Hugging Face causal LMs."""

from .config import DecodeConfig, EngineConfig, GooseConfig
from .decoding import Decoder, GenerationResult, generate
from .engine.methods import METHODS
from .engine.scheduler import Engine, Request
from .errors import GooseError
from .integrations.hf import HUB_ENTRY, custom_generate
from .loading.model import DEFAULT_MODEL, load_model

__all__ = ["Decoder", "Engine", "Request", "GenerationResult", "generate", "GooseConfig", "DecodeConfig",
           "EngineConfig", "GooseError", "METHODS", "DEFAULT_MODEL", "load_model", "custom_generate", "HUB_ENTRY"]
__version__ = "0.1.0"
