"""Forward cost of the packaged SmolLM2 with GGUF blocks (each kernel variant this CPU runs) against its
dequantized float32 weights, side by side in one run: median ms of one `LeanForward` call of N query tokens
on a KV cache of `--prefix` tokens, calls interleaved across the forwards so machine noise hits all alike.

    python benchmarks/gguf_cost.py [--tokens 1,2,4,8,16,32,64] [--repeats 15] [--prefix 300] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from goose.backends import packed, quant
from goose.backends.lean import LeanForward
from goose.loading.model import load_model
from goose.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(t) for t in args.tokens.split(",")]
    f32, _ = load_model("smollm2-135m", weights="float32")
    forwards = {"float32": LeanForward(f32)}
    for variant in quant.runnable_variants():
        net, _ = load_model("smollm2-135m", weights="gguf")
        kern = quant.kernels(variant)
        for mod in net.modules():  # the packed layout is the same for every variant
            if isinstance(mod, (packed.PackedLinear, packed.PackedEmbedding)):
                mod.weight.kernels = kern
        forwards[f"gguf-{variant}"] = LeanForward(net)
    prompt = [(7 * i) % 49152 for i in range(args.prefix)]
    times: dict = {(name, n): [] for name in forwards for n in sizes}
    with torch.inference_mode():
        for fwd in forwards.values():
            fwd.reset()
            fwd(prompt)
        for _ in range(args.repeats):
            for n in sizes:
                for name, fwd in forwards.items():
                    t0 = time.perf_counter()
                    fwd(list(range(100, 100 + n)))
                    times[(name, n)].append((time.perf_counter() - t0) * 1e3)
                    fwd.keep([])  # back to the prefix
    print(f"CPU: {cpu_name()}; threads {args.threads}; KV cache {args.prefix}; median of {args.repeats}")
    names = list(forwards)
    print("| N | " + " | ".join(f"{n} ms" for n in names) + " | " +
          " | ".join(f"{n} / float32" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for n in sizes:
        med = [statistics.median(times[(name, n)]) for name in names]
        print(f"| {n} | " + " | ".join(f"{m:.1f}" for m in med) + " | " +
              " | ".join(f"{m / med[0]:.2f}" for m in med[1:]) + " |")
    for name, fwd in forwards.items():
        print(f"{name}: backend {fwd.backend}")


if __name__ == "__main__":
    main()
