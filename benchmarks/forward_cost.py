"""Cost of one forward vs query size N: HFForward against LeanForward (with PyTorch's kernels; with goose's
linear kernel and PyTorch's attention; with goose's linear and attention kernels, `goose.backends.cpukernel`),
interleaved in one run. For models LeanForward does not run (e.g. gemma3-270m): HFForward as it is
against HFForward with its linear layers on goose's kernel.

Each timed call verifies a tree of N nodes on top of a KV cache of --cache-len tokens, then rolls the
cache back (``keep([])``) so every call sees the same prefix. N = 1 is a plain single-token step (no mask),
exactly what AR decoding does. Also timed: a plain Hugging Face greedy `model.generate` step (median ms per
new token, prefill excluded), the reference that speculative decoding has to beat.

    python benchmarks/forward_cost.py [--model smollm2-135m] [--weights float32] [--cache-len 300] \
        [--sizes 1,2,4,8] [--repeats 7]

On a CPU that runs goose's AVX-512 kernels, a `lean-avx2` column (goose's kernels capped at their AVX2
variant, ``GOOSE_KERNEL_VARIANT=avx2``) is timed too, with float32 weights (GGUF blocks pick their kernel
variant when the model loads: run the script again under that variable to compare those).

Timings are medians: this machine has 2 cores, often shared; watch the load average printed at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from goose.backends import cpukernel, quant
from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward
from goose.backends.lean import supports as lean_supports
from goose.backends.tree_tensors import parent_tensors
from goose.loading.model import load_model


def random_tree(rng: random.Random, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft-like tree of n nodes: a spine of about n/2 nodes with random branches. (allowed, depths)."""
    spine = max(1, n // 2)
    parents = [-1] + [i - 1 for i in range(1, spine)] + [rng.randrange(i) for i in range(spine, n)]
    return parent_tensors(parents)


def time_call(fwd, tokens, tree) -> float:
    t0 = time.perf_counter()
    if len(tokens) == 1:
        fwd(tokens)
    else:
        fwd(tokens, tree[1], tree[0])
    dt = time.perf_counter() - t0
    fwd.keep([])  # back to the prefix
    return dt * 1e3


class _StepClock(LogitsProcessor):
    """Records a timestamp at every decoding step of `generate`."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def generate_step_ms(model, prompt: list[int], new_tokens: int) -> float:
    """Median ms between consecutive greedy steps of `model.generate` (prefill excluded)."""
    clock = _StepClock()
    ids = torch.tensor([prompt])
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([clock]))
    return statistics.median(b - a for a, b in zip(clock.stamps, clock.stamps[1:])) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache-len", type=int, default=300)
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per (forward, N), interleaved")
    ap.add_argument("--generate-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--weights", choices=["gguf", "float32"], default=None,
                    help="GGUF sources: quantized blocks or dequantized float32 (default: load_model's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]

    model, _ = load_model(args.model, weights=args.weights, pack=False)  # (HF and PyTorch kernels are timed too)
    vocab = model.get_output_embeddings().weight.shape[0]
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(args.cache_len)]
    forwards = {"hf": HFForward(model, kernel=False)}
    if lean_supports(model):
        forwards.update({"lean-torch": LeanForward(model, kernel=False),
                         "lean-linear": LeanForward(model, attention_kernel=False)})
        best_kernel = cpukernel.kernel()
        gguf = quant.weights_kind(model).startswith("gguf")
        if best_kernel is not None and best_kernel.variant != "avx2" and not gguf:
            os.environ[cpukernel.ENV_VARIANT] = "avx2"
            try:
                forwards["lean-avx2"] = LeanForward(model)
            finally:
                del os.environ[cpukernel.ENV_VARIANT]
        forwards["lean"] = LeanForward(model)
    else:  # the generic forward, as it is and with its linear layers on goose's kernel
        forwards["hf+kernel"] = HFForward(model)
    best = list(forwards)[-1]  # the default forward for this model
    trees = {n: random_tree(rng, n) for n in sizes}
    toks = {n: [rng.randrange(3, vocab) for _ in range(n)] for n in sizes}
    times = {(name, n): [] for name in forwards for n in sizes}
    gen = []
    with torch.inference_mode():
        for fwd in forwards.values():
            fwd.reset()
            fwd(prompt)
            for n in sizes:  # warm-up: allocators, oneDNN primitive caches
                time_call(fwd, toks[n], trees[n])
        for r in range(args.repeats):  # interleaved: drift in machine load hits both alike
            for n in sizes:
                for name, fwd in forwards.items():
                    times[(name, n)].append(time_call(fwd, toks[n], trees[n]))
            if r < 3:
                gen.append(generate_step_ms(model, prompt, args.generate_tokens))

    med = {k: statistics.median(v) for k, v in times.items()}
    gen_ms = statistics.median(gen)
    names = list(forwards)
    print(f"model {args.model}, cache {args.cache_len} tokens, {torch.get_num_threads()} threads, "
          f"{args.repeats} repeats; kernels: "
          + ", ".join(f"{k}={f.backend}" for k, f in forwards.items() if hasattr(f, "backend")))
    print(f"{'N':>5} " + " ".join(f"{k + ' ms':>14}" for k in names) + " "
          + " ".join(f"{k + ' c(N)/c(1)':>20}" for k in names) + f" {best + '/hf':>12}")
    for n in sizes:
        print(f"{n:>5} " + " ".join(f"{med[(k, n)]:>14.1f}" for k in names) + " "
              + " ".join(f"{med[(k, n)] / med[(k, sizes[0])]:>20.2f}" for k in names)
              + f" {med[(best, n)] / med[('hf', n)]:>12.2f}")
    print(f"HF generate greedy step: {gen_ms:.1f} ms/token (median over {args.generate_tokens} tokens, "
          f"{len(gen)} runs)")
    if 1 in sizes:
        for k in names[1:]:
            print(f"{k} 1-token step / HF generate step: {med[(k, 1)] / gen_ms:.2f}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
