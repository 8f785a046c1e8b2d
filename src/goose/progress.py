"""One line on stderr for each slow step that runs once per machine or per model (hashing and dequantizing a
GGUF file, compiling goose's kernels, measuring a forward's cost curve), so a first run is never silent."""

from __future__ import annotations

import sys


def note(message: str) -> None:
    print(f"goose: {message}", file=sys.stderr, flush=True)
