"""Bigger models without downloads: goose's forward cost on random-weight models of published shapes, and
the speed-up it projects for them.

Each model is built directly in GGUF block form (Q4_0 or Q8_0, ``--format``) on goose's quantized kernels
(`goose.backends.quant`): the HF model is created on the meta device, every projection, the embedding and the output
head get random GGUF rows packed straight into `PackedLinear` / `PackedEmbedding`, and only the RMSNorm weights
(ones) and the rotary tables are real float32 tensors. No float32 weight matrix is ever materialised, so the
8B shape in Q4_0 needs about its packed size (~4.5 GB) of memory. The kernels do the same work whatever the
weights' values, so a random-weight forward costs what a real one of the same shape and format costs.

All shapes are Llama-shaped (`LlamaConfig`: no q/k/v biases, default RoPE without Llama-3's frequency
scaling, neither of which changes what a forward reads) with an untied output head, hence more parameters
than the published models whose embedding is tied:

| size | like | hidden | intermediate | layers | heads | KV heads | vocab | params here | Q4_0 GB |
|---|---|---|---|---|---|---|---|---|---|
| 0.5b | Qwen2.5-0.5B | 896 | 4864 | 24 | 14 | 2 | 151936 | 0.63B | 0.35 |
| 1.5b | Qwen2.5-1.5B | 1536 | 8960 | 28 | 12 | 2 | 151936 | 1.78B | 1.00 |
| 3b | Llama-3.2-3B | 3072 | 8192 | 28 | 24 | 8 | 128256 | 3.61B | 2.03 |
| 8b | Llama-3.1-8B | 4096 | 14336 | 32 | 32 | 8 | 128256 | 8.03B | 4.52 |
| tiny | (test shape) | 256 | 512 | 2 | 4 | 2 | 1000 | 1.7M | 0.001 |

Measured: (a) the cost curve, median ms of one `LeanForward` call of N query tokens (a draft-shaped tree
of N nodes, N in ``--tokens``) on a KV cache of ``--prefix`` tokens, by goose's own cost measurement
(`goose.engine.measure.measure`: one discarded warm-up pass, ``--repeats`` timed passes, medians made
non-decreasing in N as the decoder's cost model keeps them).

Projected: (b) goose's speed-up over plain decoding on that curve, ``max over n of (1 + E[accepted](n)) /
cost(n) * cost(1)`` at its best tree size n* (n query tokens, the root included; `goose.theory.best_size`).
E[accepted](n) comes from ``--acceptance`` (a JSON object ``{"n": E[accepted], ...}``, linear between the
given sizes, flat after the last) or from the built-in default: the expected accepted tokens of the best
n-node tree under goose's two-source model (`goose.theory.optimal_values`), a context-matched chain
accepting each next token with probability 0.6 and 10 ranked adjacency candidates per node accepting with
0.05 each. docs/performance-log.md gives acceptance rates and τ for the packaged SmolLM2-135M but no per-node
path probabilities of its best subtrees, so this is a model, not a measurement: 0.6 is about goose's
measured spine acceptance there (57.7%, §1), 0.05 a weak adjacency source (goose's chosen branch nodes are
accepted 16.2% of the time). It is optimistic: on SmolLM2's measured curve (§2: 40.7 / 43.0 / 43.7 / 51.8
/ 75.4 / 119.4 / 220.2 ms at N = 1..64) it projects n* = 5 and 2.05x, where goose measured 1.47x plain
decoding end to end (it assumes a context match at every step and ignores ~1 ms of drafting per step).
Compare the projections between models; the absolute figures are an upper estimate.

    python benchmarks/model_scale.py [--sizes 0.5b,1.5b,3b,8b] [--format Q4_0] [--tokens 1,2,4,8,16,32,64]
        [--prefix 256] [--repeats 5] [--threads 2] [--arith exact,int8] [--acceptance FILE.json] [--json OUT.json]
    python benchmarks/model_scale.py --sizes tiny --repeats 2      # a few seconds: the test shape
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from goose import theory
from goose.backends import quant
from goose.backends.lean import ARITHS, LeanForward
from goose.backends.packed import PackedEmbedding, PackedLinear
from goose.backends.quant import QuantKernels
from goose.engine import measure as costmodel
from goose.errors import GooseError
from goose.machine import cpu_name
from goose.selection.costmodel import CostCurve


@dataclass(frozen=True)
class Shape:
    like: str  # the published model whose shape this is
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    rms_eps: float

    def config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, rms_norm_eps=self.rms_eps,
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)


SHAPES = {
    "0.5b": Shape("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, 1e6, 1e-6),
    "1.5b": Shape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, 1e6, 1e-6),
    "3b": Shape("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128256, 5e5, 1e-5),
    "8b": Shape("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, 5e5, 1e-5),
    "tiny": Shape("test shape", 256, 512, 2, 4, 2, 1000, 1e4, 1e-6),
}
BUILD_FORMATS = ("Q4_0", "Q8_0")  # one half-float scale d per block, then the quants: weight = d * q
QUANT_LEVELS = {"Q4_0": 16, "Q8_0": 256}  # q uniform over this many integers (Q4_0: nibble - 8)
CHUNK_ROWS = 1024  # rows of random blocks generated at a time
DEFAULT_MODEL = theory.TwoSourceModel(p_s=0.6, p_t=0.05, k=10)


def random_rows(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, bytes per row]`` GGUF rows of `fmt` for an ``[n, k]`` weight: uniform random quants and, in every
    block, the scale ``1 / (std(q) * sqrt(k))`` (a unit-variance input gives unit-variance outputs, so the
    activations stay finite and normal through any number of layers)."""
    _, block, bbytes = quant.FORMATS[fmt]
    levels = QUANT_LEVELS[fmt]
    d = np.float16(1.0 / (math.sqrt((levels * levels - 1) / 12.0) * math.sqrt(k)))
    if not np.isfinite(d) or d < np.finfo(np.float16).tiny:
        raise GooseError(f"{fmt}: rows of {k} weights need a scale below float16's normal range")
    out = np.empty((n, k // block, bbytes), dtype=np.uint8)
    for start in range(0, n, CHUNK_ROWS):
        part = out[start:start + CHUNK_ROWS]
        part[:, :, 2:] = rng.integers(0, 256, size=part[:, :, 2:].shape, dtype=np.uint8)
        part[:, :, :2] = np.frombuffer(d.astype("<f2").tobytes(), dtype=np.uint8)
    return out.reshape(n, -1)


def build(shape: Shape, fmt: str = "Q4_0", seed: int = 0, kernels: QuantKernels | None = None):
    """A `LlamaForCausalLM` of `shape` whose projections, embedding and output head are random `fmt` blocks
    packed for goose's kernels; its float32 weight matrices are never allocated (meta device)."""
    if fmt not in BUILD_FORMATS:
        raise GooseError(f"random blocks are built in {', '.join(BUILD_FORMATS)}, not {fmt}")
    kern = kernels or quant.kernels_or_none()
    if kern is None:
        raise GooseError(f"goose's quantized kernels cannot run here: {quant.unavailable_reason()}")
    cfg = shape.config()
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    rng = np.random.default_rng(seed)

    def packed(n: int, k: int) -> quant.QuantWeight:
        return kern.pack(fmt, list(random_rows(fmt, n, k, rng)), k)

    for layer in net.model.layers:
        for parent, name in ((layer.self_attn, "q_proj"), (layer.self_attn, "k_proj"), (layer.self_attn, "v_proj"),
                             (layer.self_attn, "o_proj"), (layer.mlp, "gate_proj"), (layer.mlp, "up_proj"),
                             (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            setattr(parent, name, PackedLinear(packed(old.out_features, old.in_features), None))
    net.model.embed_tokens = PackedEmbedding(packed(cfg.vocab_size, cfg.hidden_size), cfg.pad_token_id)
    net.lm_head = PackedLinear(packed(cfg.vocab_size, cfg.hidden_size), None)
    for name, p in list(net.named_parameters()):  # what is left: the RMSNorm weights
        if p.is_meta and p.dim() == 1:
            parent, _, attr = name.rpartition(".")
            net.get_submodule(parent)._parameters[attr] = nn.Parameter(torch.ones(p.shape), requires_grad=False)
    rotary = net.model.rotary_emb  # non-persistent buffers (inv_freq): computed from the config
    net.model.rotary_emb = type(rotary)(config=net.config)
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise GooseError(f"still on the meta device: {', '.join(left[:3])}{' ...' if len(left) > 3 else ''}")
    return net.eval()


def weight_stats(net) -> tuple[int, int]:
    """(parameters, bytes) of `net`'s weights: the quantized ones as packed blocks, the rest (norms) float32."""
    params = nbytes = 0
    for mod in net.modules():
        if isinstance(mod, (PackedLinear, PackedEmbedding)):
            params += mod.weight.n * mod.weight.k
            nbytes += mod.weight.nbytes
        for t in mod._parameters.values():
            if t is not None:
                params += t.numel()
                nbytes += t.numel() * t.element_size()
    return params, nbytes


def default_acceptance(upto: int) -> np.ndarray:
    """E[accepted](n) for n = 0..upto of the best n-node tree under `DEFAULT_MODEL` (see the module doc)."""
    return theory.optimal_values(upto, DEFAULT_MODEL, "both")


def load_acceptance(path: Path, upto: int) -> np.ndarray:
    """E[accepted](n) for n = 0..upto from a JSON object ``{"n": E, ...}`` (n: query tokens, root included):
    linear between the given sizes, flat after the last; E(1) = 0 (a plain step accepts no draft)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        points = sorted((int(n), float(e)) for n, e in raw.items())
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{path}: not a JSON object of tree size -> expected accepted tokens ({exc})") from exc
    if not points or points[0][0] < 1 or any(not math.isfinite(e) or e < 0 for _, e in points):
        raise ValueError(f"{path}: tree sizes must be >= 1 and expected accepted tokens finite and >= 0")
    if points[0][0] == 1 and points[0][1] != 0:
        raise ValueError(f"{path}: a tree of 1 node (a plain step) accepts 0 draft tokens")
    if points[0][0] > 1:
        points.insert(0, (1, 0.0))
    if any(b[1] < a[1] for a, b in zip(points, points[1:])):
        raise ValueError(f"{path}: the best tree of more nodes cannot accept fewer tokens")
    values = np.interp(np.arange(upto + 1), [n for n, _ in points], [e for _, e in points])
    values[0] = 0.0
    return values


def project(curve: CostCurve, accepted: np.ndarray) -> tuple[int, float]:
    """(n*, projected speed-up over plain decoding): the tree size n (query tokens) maximising
    ``(1 + accepted[n]) / curve(n)``, and that maximum times ``curve(1)``; n up to the curve's last size."""
    upto = min(curve.max_size, len(accepted) - 1)
    best, rate = theory.best_size(accepted[: upto + 1], dict(zip(curve.sizes, curve.ms)))
    return best, float(rate[best] * curve(1))


def measure_size(size: str, fmt: str, sizes: tuple[int, ...], prefix: int, repeats: int,
                 accepted: np.ndarray, ariths: tuple[str, ...] = ("exact",)) -> list[dict]:
    """Build one model, measure its cost curve in each arithmetic (one row each), project; the model is released
    before returning."""
    shape = SHAPES[size]
    t0 = time.perf_counter()
    net = build(shape, fmt)
    built = time.perf_counter() - t0
    params, nbytes = weight_stats(net)
    rows = []
    for arith in ariths:
        fwd = LeanForward(net, arith=arith)
        curve = costmodel.measure(fwd, shape.vocab, sizes=sizes, cache_len=prefix, repeats=repeats)
        n_star, speedup = project(curve, accepted)
        rows.append({"size": size, "shape": asdict(shape), "format": fmt, "arith": arith, "params": params,
                     "weight_bytes": nbytes, "backend": fwd.backend, "build_s": round(built, 1),
                     "sizes": list(curve.sizes), "ms": list(curve.ms), "spread": curve.spread, "n_star": n_star,
                     "speedup": speedup})
        if curve.spread > costmodel.MAX_SPREAD:
            print(f"{size} ({arith}): the timed passes varied {curve.spread:.1f}x (is the machine busy?)",
                  file=sys.stderr)
        del fwd
        gc.collect()
    del net
    gc.collect()
    return rows


def _amount(x: float, big: str, small: str) -> str:
    """x in units of 1e9 (`big`) from 1e8 up, else of 1e6 (`small`): 0.63B, 1.7M, 4.52 GB, 1.0 MB."""
    return f"{x / 1e9:.2f}{big}" if x >= 1e8 else f"{x / 1e6:.1f}{small}"


def _ratio(row: dict, n: int) -> str:
    ms = dict(zip(row["sizes"], row["ms"]))
    return f"{ms[n] / ms[1]:.2f}" if n in ms and 1 in ms else "–"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1.5b,3b,8b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--format", default="Q4_0", choices=BUILD_FORMATS)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64", help="query tokens per forward (must include 1)")
    ap.add_argument("--prefix", type=int, default=256, help="KV cache length each forward sees")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--acceptance", type=Path, help='JSON {"n": E[accepted], ...}; default: the built-in model')
    ap.add_argument("--arith", default="exact", help="comma list of exact, int8 (each measured on the same model)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown sizes {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    ariths = tuple(a.strip() for a in args.arith.split(",") if a.strip())
    if not ariths or any(a not in ARITHS for a in ariths):
        ap.error(f"--arith: a comma list of {', '.join(ARITHS)}")
    tokens = tuple(sorted({int(t) for t in args.tokens.split(",")}))
    if tokens[0] != 1:
        ap.error("--tokens must include 1 (plain decoding, the speed-up's reference)")
    try:
        accepted = (load_acceptance(args.acceptance, tokens[-1]) if args.acceptance
                    else default_acceptance(tokens[-1]))
    except ValueError as exc:
        ap.error(str(exc))
    source = (f"file {args.acceptance}" if args.acceptance else f"built-in two-source model (p_s = "
              f"{DEFAULT_MODEL.p_s}, p_t = {DEFAULT_MODEL.p_t} x {DEFAULT_MODEL.k} ranks)")
    torch.set_num_threads(args.threads)
    cpu = cpu_name()
    print(f"CPU: {cpu}; threads {args.threads}; KV cache {args.prefix} tokens; median of {args.repeats} "
          f"(after one warm-up pass); random {args.format} weights")
    print(f"Projection, not a measurement: the cost curves of these random-weight models (goose's forward) "
          f"combined with E[accepted](n) from the {source}; speed-up = max over n of (1 + E[accepted](n)) / "
          "cost(n) * cost(1). The acceptance is not measured on these models (see the module docstring).")
    print()
    print("| size | like | params | weight bytes | arith | " + " | ".join(f"N={n} ms" for n in tokens) +
          " | cost(8)/cost(1) | cost(16)/cost(1) | projected n* | projected speed-up |")
    print("|---" * (len(tokens) + 9) + "|")
    rows = []
    for size in sizes:
        for row in measure_size(size, args.format, tokens, args.prefix, args.repeats, accepted, ariths):
            rows.append(row)
            cells = [size, row["shape"]["like"], _amount(row["params"], "B", "M"),
                     _amount(row["weight_bytes"], " GB", " MB"), row["arith"], *(f"{m:.1f}" for m in row["ms"]),
                     _ratio(row, 8), _ratio(row, 16), str(row["n_star"]), f"{row['speedup']:.2f}x"]
            print("| " + " | ".join(cells) + " |", flush=True)
    for arith in ariths:
        backend = next(r["backend"] for r in rows if r["arith"] == arith) if rows else None
        if backend:
            print(f"\nforward backend ({arith}): {backend}")
    if args.json:
        acceptance = {"source": source, "accepted": {n: float(accepted[n]) for n in range(1, len(accepted))}}
        out = {"cpu": cpu, "threads": args.threads, "prefix": args.prefix, "repeats": args.repeats,
               "format": args.format, "acceptance": acceptance, "models": rows}
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
