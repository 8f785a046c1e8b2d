"""Child process of the fault-injection tests (test_faults.py): runs one cache-writing operation and may be
killed with SIGKILL at any moment. Prints ``ready`` once its imports are done (the parent starts its kill
timer then) and ``done <seconds>`` when the operation finished.

    python fault_child.py dequantize GGUF
    python fault_child.py datastore SOURCE_DIR STORE_DIR
    python fault_child.py costcurve CURVE_JSON
    python fault_child.py kernel
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class CharTokenizer:
    """A tokenizer without files: one token per byte of UTF-8 (enough to build a datastore)."""

    name_or_path = "bytes"

    def __len__(self) -> int:
        return 256

    def __call__(self, text, add_special_tokens: bool = False):
        if isinstance(text, str):
            return {"input_ids": list(text.encode("utf-8"))}
        return {"input_ids": [list(t.encode("utf-8")) for t in text]}


def main(argv: list[str]) -> None:
    what = argv[0]
    if what == "dequantize":
        from goose.loading.model import model_dir

        ready()
        print(model_dir(argv[1]), flush=True)
    elif what == "datastore":
        from goose.drafting import datastore

        ready()
        datastore.build(CharTokenizer(), [argv[1]], "faults", path=Path(argv[2]))
    elif what == "costcurve":
        import torch

        from conftest import make_tiny_llama
        from goose.decoding import default_forward
        from goose.engine.measure import load_or_measure

        torch.set_num_threads(1)
        model = make_tiny_llama(dtype=torch.float32)
        fwd = default_forward(model)
        ready()
        load_or_measure(model, fwd, path=Path(argv[1]))
    elif what == "kernel":
        from goose.backends import cpukernel

        ready()
        why = cpukernel.unavailable_reason()
        if why is not None:
            raise SystemExit(f"kernel: {why}")
    else:
        raise SystemExit(f"unknown operation {what}")
    print(f"done {time.perf_counter() - START:.3f}", flush=True)


START = 0.0


def ready() -> None:
    global START
    START = time.perf_counter()
    print("ready", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
