"""The prepared GPU check of `goose.backends.cuda.GPUForward`: one command, writes ``gpu_check.json`` and
``gpu_check.md`` to ``--out DIR`` after every section (so a run stopped at its limit keeps what it measured).

Sections (each skipped, and said so, when the time budget cannot hold it):

1. ``tests``: tests/test_cuda.py's GPU tests (graphs per bucket, Triton kernels row-count independent on the GPU).
2. ``curves``: the packaged model's cost curve, 1..128 rows, per mode (bf16 with and without graphs, fp32, fixed),
   through goose's own measurement (`goose.engine.measure.load_or_measure`, the curve `goose` sizes its trees with).
3. ``specbench``: Spec-Bench's 13 categories (``--per-category`` questions each, ``--max-new`` tokens, chat) with
   ar, goose, goose-paper, pld, tr through `Decoder(..., forward=GPUForward)` in each mode; every output compared
   with that mode's ar.
4. ``hf``: Hugging Face's `generate` and its prompt lookup (``prompt_lookup_num_tokens=10``) on the same model in
   bf16, compared with goose's bf16 ar.
5. ``synthetic``: cost curves of 8B-shaped random-weight Llamas in bf16 at two depths, extrapolated to 32 layers,
   and each method's speedup projected from its measured tree sizes (and host time per step).

    python benchmarks/gpu_check.py --out runs/gpu-check                          # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --tiny --out runs/gpu-rehearsal  # rehearsal here, ~2 minutes

``--model`` takes a packaged name, a GGUF file or a Hugging Face folder; ``--model-parts DIR`` joins a GGUF carried
in parts (benchmarks/gpu_carry.py) first. No number here is a target checked by a test: the check reports.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from goose.backends.cuda import BUCKETS, GPUForward  # noqa: E402
from goose.config import DecodeConfig  # noqa: E402
from goose.decoding import Decoder  # noqa: E402
from goose.engine import measure  # noqa: E402
from goose.engine.requests import encode_chat  # noqa: E402

METHODS = ("ar", "goose", "goose-paper", "pld", "tr")
SECTIONS = ("tests", "curves", "specbench", "hf", "synthetic")
SIZES = tuple(BUCKETS)  # the rows the cost curves report
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
TINY_8B = dict(vocab_size=4096, hidden_size=256, intermediate_size=896, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=2048, rope_theta=500000.0)


class StandInGraph:
    """For the CPU rehearsal: a graph's stand-in that replays by running the captured step again (the same
    bookkeeping as a CUDA graph: static buffers in, the captured outputs updated in place)."""

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        for old, new in zip(self.out, self.fn()):
            old.copy_(new)


class Check:
    """The run's results, written out after every section."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.t0, self.budget = out, time.perf_counter(), budget_s
        self.data: dict = {"sections": {}, "notes": []}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def note(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", flush=True)
        self.data["notes"].append(text)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the model -------------------------------------------------------------------------------------------------
def tiny_model(tokenizer_from: str):
    """A tiny random Llama with the packaged model's vocabulary and tokenizer (the rehearsal's model)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from goose.loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir(tokenizer_from))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)  # peaked, repetitive text: drafts get accepted
        model.lm_head.weight[96:] = 0  # it writes only the first 96 tokens (repeats, as tests/conftest.py's does)
    return model, tok


def real_model(name: str):
    from goose.loading.model import load_model

    return load_model(name, "float32", "cpu", weights="float32", pack=False)


def questions(per_category: int, tiny: bool) -> list:
    from goose.bench.datasets import load

    qs = load("spec-bench", limit=per_category)
    return qs[:3] if tiny else qs


def prompt_ids(tok, q) -> list[int]:
    msgs = [{"role": "system", "content": q.system}] if q.system else []
    return encode_chat(tok, msgs + [{"role": "user", "content": q.turns[0]}])


# ---- sections --------------------------------------------------------------------------------------------------
def run_tests(check: Check, device: torch.device) -> dict:
    """tests/test_cuda.py's GPU tests (they skip without a GPU; the rehearsal runs the CPU ones)."""
    sel = ["-k", "cuda_"] if device.type == "cuda" else ["-k", "bucket or graph_runner or row_count"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(REPO / "tests" / "test_cuda.py"),
           *sel]
    t = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src")] + [p for p in [os.environ.get(
        "PYTHONPATH")] if p]))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=max(30, min(240, check.left())))
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else "", "tail": tail,
            "seconds": round(time.perf_counter() - t, 1)}


def mode_forwards(model, device: torch.device, modes: list[str], max_len: int, graphs_off_too: bool,
                  no_dot: bool = False) -> dict:
    """name -> GPUForward: each mode with graphs (stand-ins on CPU), and bf16 without graphs for comparison.
    `no_dot`: the fixed mode's Triton matmul without `tl.dot` (`TritonFixed(dot=False)`)."""
    from goose.backends.fixed_kernels import TritonFixed

    stand_in = None if device.type == "cuda" else StandInGraph
    out = {}
    for mode in modes:
        kernels = TritonFixed(dot=False) if mode == "fixed" and no_dot and device.type == "cuda" else None
        out[mode] = GPUForward(model, device=device, mode=mode, max_len=max_len, graphs=True, make_graph=stand_in,
                               kernels=kernels)
    if graphs_off_too:
        first = modes[0]
        out[f"{first}-eager"] = GPUForward(model, device=device, mode=first, max_len=max_len, graphs=False)
    return out


def cost_curves(check: Check, model, forwards: dict) -> dict:
    """Each forward's cost curve through goose's measurement (the one `goose` sizes its trees with)."""
    import tempfile

    res = {}
    folder = Path(tempfile.mkdtemp(prefix="goose-gpu-curves-"))  # (the curves are in the JSON; few files come back)
    for name, fwd in forwards.items():
        if check.left() < 30:
            check.note(f"curves: no time left for {name}")
            break
        t = time.perf_counter()
        curve = measure.load_or_measure(model, fwd, remeasure=True, path=folder / f"{name}.json")
        ms = {n: round(curve(n), 4) for n in SIZES}
        res[name] = {"backend": fwd.backend, "arith": fwd.arith, "ms": ms, "ratio_64_1": round(ms[64] / ms[1], 3),
                     "context_ms_per_row_token": curve.context_ms, "curve": curve.to_json(),
                     "seconds": round(time.perf_counter() - t, 1)}
        check.note(f"curve {name}: " + " ".join(f"{n}:{ms[n]:.3f}" for n in SIZES) + " ms")
    return res


def spec_bench(check: Check, model, tok, forwards: dict, curves: dict, qs: list, max_new: int,
               modes: list[str]) -> dict:
    """Every method through each mode's forward on the questions; outputs compared with that mode's ar."""
    from goose.selection.costmodel import CostCurve

    res: dict = {}
    prompts = [prompt_ids(tok, q) for q in qs]
    for mode in modes:
        fwd = forwards[mode]
        cost = CostCurve.from_json(curves[mode]["curve"]) if mode in curves else None
        per: dict = {}
        ar_out: list = []
        for method in METHODS:
            if check.left() < 20:
                check.note(f"specbench: no time left for {mode}/{method}")
                break
            dec = Decoder(model, tok, method, forward=fwd, cost=cost, memory_mb=0)
            dec.generate_ids(prompts[0][:32], DecodeConfig(max_new_tokens=8))  # warm-up (host-side paths)
            rows = []
            for i, (q, ids) in enumerate(zip(qs, prompts)):
                sync(fwd.device)
                t = time.perf_counter()
                out, st = dec.generate_ids(ids, DecodeConfig(max_new_tokens=max_new))
                sync(fwd.device)
                wall = time.perf_counter() - t
                if method == "ar":
                    ar_out.append(out)
                same = out == ar_out[i] if i < len(ar_out) else None
                rows.append({"category": q.category, "id": q.question_id, "prompt_tokens": len(ids),
                             "new_tokens": len(out), "wall_s": wall, "forward_calls": st.forward_calls,
                             "tree_sizes": list(st.tree_sizes), "identical_to_ar": same, "tokens": out,
                             "stage_ms": {k: round(v, 3) for k, v in st.stage_ms.items()}})
            per[method] = summarize(rows)
            per[method]["rows"] = rows
            s = per[method]
            check.note(f"specbench {mode}/{method}: {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.2f}, "
                       f"identical {s['identical']}/{s['questions']}")
        for method, s in per.items():
            if "ar" in per and per["ar"]["tokens_per_s"] > 0:
                s["speedup_vs_ar"] = round(s["tokens_per_s"] / per["ar"]["tokens_per_s"], 3)
        res[mode] = per
    return res


def summarize(rows: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    calls = sum(r["forward_calls"] for r in rows)
    sizes = [s for r in rows for s in r["tree_sizes"]]
    same = [r["identical_to_ar"] for r in rows if r["identical_to_ar"] is not None]
    stages: dict = {}
    for r in rows:
        for k, v in r.get("stage_ms", {}).items():
            stages[k] = round(stages.get(k, 0.0) + v, 3)
    return {"questions": len(rows), "stage_ms": stages, "new_tokens": tokens, "wall_s": round(wall, 4),
            "tokens_per_s": round(tokens / wall, 3) if wall else 0.0, "tau": round(tokens / max(1, calls), 3),
            "mean_tree": round(statistics.mean(sizes), 2) if sizes else 0.0,
            "identical": sum(1 for x in same if x), "compared": len(same)}


def hf_generate(check: Check, model, tok, device: torch.device, qs: list, max_new: int, ar_rows: list | None) -> dict:
    """Hugging Face's `generate`, plain and with prompt lookup, on a copy of the model on the device (bf16 on CUDA;
    float32 on CPU); outputs compared with goose's ar in the first mode (`ar_rows`)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = copy.deepcopy(model).to(device, dtype)  # (a copy: the GPU forwards keep the weights they copied)
    res = {}
    prompts = [prompt_ids(tok, q) for q in qs]
    eos = model.generation_config.eos_token_id
    for name, extra in (("hf-ar", {}), ("hf-pld", {"prompt_lookup_num_tokens": 10})):
        rows = []
        with torch.inference_mode():
            warm = torch.tensor([prompts[0][:32]], device=device)
            hf.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=8, **extra)
            for i, (q, ids) in enumerate(zip(qs, prompts)):
                if check.left() < 15:
                    check.note(f"hf: no time left for {name} question {i}")
                    break
                x = torch.tensor([ids], device=device)
                sync(device)
                t = time.perf_counter()
                y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                                eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None, **extra)
                sync(device)
                wall = time.perf_counter() - t
                out = y[0, len(ids):].tolist()
                same = out == ar_rows[i]["tokens"] if ar_rows and i < len(ar_rows) else None
                rows.append({"category": q.category, "new_tokens": len(out), "wall_s": wall, "forward_calls": 0,
                             "tree_sizes": [], "identical_to_ar": same, "tokens": out})
        s = summarize(rows)
        s["rows"], s["dtype"] = rows, str(dtype).replace("torch.", "")
        res[name] = s
        check.note(f"hf {name}: {s['tokens_per_s']:.1f} tok/s, identical to goose's ar {s['identical']}/"
                   f"{s['compared']}")
    del hf
    return res


def synthetic(check: Check, device: torch.device, tiny: bool, layers: tuple[int, int]) -> dict:
    """Cost curves of 8B-shaped random Llamas (bf16) at two depths, extrapolated per row count to 32 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY_8B if tiny else LLAMA_8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    curves = {}
    for n_layers in layers:
        if check.left() < 60:
            check.note(f"synthetic: no time left for {n_layers} layers")
            break
        t = time.perf_counter()
        cfg = LlamaConfig(num_hidden_layers=n_layers, **shape)
        cfg._attn_implementation = "sdpa"
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype).eval()
        fwd = GPUForward(model, device=device, mode="bf16" if device.type == "cuda" else "fp32", max_len=1024, slots=4,
                         graphs=True, make_graph=None if device.type == "cuda" else StandInGraph)
        curve = measure.measure(fwd, shape["vocab_size"], sizes=SIZES, cache_len=256, repeats=5)
        curves[n_layers] = {n: curve(n) for n in SIZES}
        check.note(f"synthetic {n_layers} layers: " + " ".join(f"{n}:{curves[n_layers][n]:.3f}" for n in SIZES)
                   + f" ms ({time.perf_counter() - t:.0f} s)")
        del fwd, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res: dict = {"shape": shape, "dtype": str(dtype), "measured": curves}
    if len(curves) == 2:
        (l1, c1), (l2, c2) = sorted(curves.items())
        per_layer = {n: (c2[n] - c1[n]) / (l2 - l1) for n in SIZES}
        res["projected_32_layers_ms"] = {n: round(c1[n] + (32 - l1) * per_layer[n], 4) for n in SIZES}
    return res


def project(spec: dict, synth: dict, real_curve: dict | None) -> dict:
    """Each method's speedup over ar on the 8B-shaped projection: its decoding steps' tree sizes priced on the
    projected curve (interpolated between the measured sizes), plus (second number) the host time per step measured
    on the real model (its wall time minus its steps priced on the real model's curve)."""
    curve = synth.get("projected_32_layers_ms")
    if not curve or "bf16" not in spec and "fp32" not in spec:
        return {}
    per = spec.get("bf16") or spec.get("fp32")

    def price(c: dict, n: int) -> float:
        xs = sorted(c)
        n = min(max(n, xs[0]), xs[-1])
        for a, b in zip(xs, xs[1:]):
            if a <= n <= b:
                return c[a] + (c[b] - c[a]) * (n - a) / (b - a)
        return c[xs[0]]

    out = {}
    base = None
    for method, s in per.items():
        steps = [n for r in s["rows"] for n in r["tree_sizes"]]
        gpu = sum(price(curve, n) for n in steps)
        host = 0.0
        if real_curve:
            real = sum(price(real_curve, n) for n in steps)
            host = max(0.0, s["wall_s"] * 1e3 - real)  # (prefill included: an upper bound of the host's share)
        if method == "ar":
            base = (gpu, host)
        out[method] = {"steps": len(steps), "gpu_ms": round(gpu, 2), "host_ms": round(host, 2)}
    if base:
        for method, o in out.items():
            o["speedup_gpu_only"] = round(base[0] / o["gpu_ms"], 3) if o["gpu_ms"] else None
            o["speedup_with_host"] = round((base[0] + base[1]) / (o["gpu_ms"] + o["host_ms"]), 3) \
                if o["gpu_ms"] + o["host_ms"] else None
    return out


# ---- the report ------------------------------------------------------------------------------------------------
def markdown(d: dict) -> str:
    env = d.get("env", {})
    lines = ["# goose GPU check", "", f"- device: {env.get('device')} ({env.get('device_name')}); torch "
             f"{env.get('torch')}, transformers {env.get('transformers')}, triton {env.get('triton')}",
             f"- model: {env.get('model')}; {env.get('questions')} questions, {env.get('max_new')} new tokens, chat",
             f"- elapsed: {d.get('elapsed_s')} s", ""]
    sec = d["sections"]
    if sec.get("tests"):
        t = sec["tests"]
        lines += ["## CUDA tests", "", f"`{t.get('summary', t)}`", ""]
    if sec.get("curves"):
        lines += ["## Cost curves (ms per forward, one sequence, 256 cached tokens)", "",
                  "| forward | " + " | ".join(str(n) for n in SIZES) + " | cost(64)/cost(1) |",
                  "|---|" + "---|" * (len(SIZES) + 1)]
        for name, c in sec["curves"].items():
            lines.append(f"| {name} (`{c['backend']}`) | " + " | ".join(f"{c['ms'][n]:.3f}" for n in SIZES)
                         + f" | {c['ratio_64_1']:.2f} |")
        lines.append("")
    if sec.get("specbench"):
        lines += ["## Spec-Bench", "", "host share: the step loop's time outside the forward (drafting, selection, "
                  "verification, harvest), what overlapping with the GPU could hide", "",
                  "| mode | method | tokens/s | vs ar | tau | mean tree | host share | identical to ar |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, per in sec["specbench"].items():
            for method, s in per.items():
                st = s.get("stage_ms") or {}
                total = sum(st.values())
                host = f"{(total - st.get('forward', 0.0)) / total:.0%}" if total else ""
                lines.append(f"| {mode} | {method} | {s['tokens_per_s']:.1f} | {s.get('speedup_vs_ar', '')} | "
                             f"{s['tau']:.2f} | {s['mean_tree']:.1f} | {host} | {s['identical']}/{s['compared']} |")
        first = next(iter(sec["specbench"]), "")
        for name, s in (sec.get("hf") or {}).items():
            lines.append(f"| Hugging Face, {s.get('dtype', '')} | {name} | {s['tokens_per_s']:.1f} | | | | "
                         f"{s['identical']}/{s['compared']} (vs goose's {first} ar) |")
        lines.append("")
    if (sec.get("synthetic") or {}).get("projected_32_layers_ms"):
        syn = sec["synthetic"]
        lines += ["## 8B-shaped random Llama (bf16), extrapolated to 32 layers (ms per forward)", "",
                  "| rows | " + " | ".join(str(n) for n in SIZES) + " |", "|---|" + "---|" * len(SIZES)]
        for k, c in syn["measured"].items():
            lines.append(f"| {k} layers (measured) | " + " | ".join(f"{c[n]:.3f}" for n in SIZES) + " |")
        lines.append("| 32 layers (projected) | " + " | ".join(f"{syn['projected_32_layers_ms'][n]:.3f}"
                                                             for n in SIZES) + " |")
        lines.append("")
    if sec.get("projection"):
        lines += ["## Projected speedup over ar on the 8B shape (real model's tree sizes)", "",
                  "| method | steps | GPU only | with host time |", "|---|---|---|---|"]
        for method, o in sec["projection"].items():
            lines.append(f"| {method} | {o['steps']} | {o.get('speedup_gpu_only')} | {o.get('speedup_with_host')} |")
        lines.append("")
    if sec.get("targets"):
        lines += ["## Targets (issue 45)", "", "| target | value | met |", "|---|---|---|"]
        for t in sec["targets"]:
            lines.append(f"| {t['target']} | {t['value']} | {t['met']} |")
        lines.append("")
    if d.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in d["errors"]] + [""]
    return "\n".join(lines)


def targets(sec: dict) -> list[dict]:
    out = []

    def add(name, value, ok):
        out.append({"target": name, "value": value, "met": "yes" if ok else "no"})

    curves = sec.get("curves") or {}
    if "bf16" in curves:
        r = curves["bf16"]["ratio_64_1"]
        add("cost(64)/cost(1) <= 1.3 with graphs (bf16)", r, r <= 1.3)
    spec = sec.get("specbench") or {}
    bf = spec.get("bf16", {})
    hf = sec.get("hf") or {}
    if "ar" in bf and "hf-ar" in hf and hf["hf-ar"]["tokens_per_s"]:
        r = round(bf["ar"]["tokens_per_s"] / hf["hf-ar"]["tokens_per_s"], 2)
        add("one ar token >= 3x faster than HF generate", r, r >= 3)
    for method, want in (("goose", 2.0), ("goose-paper", 1.5)):
        if method in bf and "speedup_vs_ar" in bf[method]:
            add(f"{method} >= {want}x ar (bf16)", bf[method]["speedup_vs_ar"], bf[method]["speedup_vs_ar"] >= want)
    if "goose" in bf and "hf-pld" in hf and hf["hf-pld"]["tokens_per_s"]:
        r = round(bf["goose"]["tokens_per_s"] / hf["hf-pld"]["tokens_per_s"], 2)
        add("goose >= 1.5x HF prompt lookup", r, r >= 1.5)
    fixed = spec.get("fixed", {})
    if fixed:
        same = sum(s["identical"] for s in fixed.values())
        n = sum(s["compared"] for s in fixed.values())
        add("exact mode: 100% identical to ar", f"{same}/{n}", same == n and n > 0)
    for mode in ("bf16", "fp32"):
        if spec.get(mode):
            same = sum(s["identical"] for m, s in spec[mode].items() if m != "ar")
            n = sum(s["compared"] for m, s in spec[mode].items() if m != "ar")
            out.append({"target": f"{mode}: share identical to ar (reported)", "value": f"{same}/{n}", "met": "-"})
    return out


# ---- main ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model and 3 questions (the rehearsal)")
    ap.add_argument("--model", default="smollm2-135m", help="packaged name, GGUF file or Hugging Face folder")
    ap.add_argument("--model-parts", type=Path, help="join the GGUF carried in parts here (gpu_carry.py) and use it")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--questions", type=int, default=0, help="use only the first N questions (0: all)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--modes", default=None, help="GPUForward modes to decode with, in this order (default: "
                    "bf16,fixed,fp32 on CUDA; fp32,fixed on CPU, where bfloat16 is slow)")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--synthetic-layers", default="2,4", help="the two depths of the 8B-shaped models")
    ap.add_argument("--synthetic-from", type=Path, help="an earlier run's gpu_check.json whose synthetic section the "
                    "projection uses (when this run has no synthetic section)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections past this")
    ap.add_argument("--max-len", type=int, default=0, help="cache entries per sequence (0: from the prompts)")
    ap.add_argument("--fixed-no-dot", action="store_true", help="the fixed mode's matmul without tl.dot (if the "
                    "GPU tests find tl.dot's rows depend on their place in a tile)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device is available (use --device cpu --tiny to rehearse)",
              file=sys.stderr)
        return 2
    if device.type == "cpu":  # the rehearsal: one thread (two cores shared with other work spin OpenMP teams)
        torch.set_num_threads(1)
    sections = [s for s in args.sections.split(",") if s]
    modes = [m for m in (args.modes or ("bf16,fixed,fp32" if device.type == "cuda" else "fp32,fixed")).split(",")
             if m]
    check = Check(args.out, args.budget_s)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    check.data["env"] = {"device": str(device), "device_name": torch.cuda.get_device_name(device)
                         if device.type == "cuda" else platform.processor() or platform.machine(),
                         "torch": torch.__version__, "transformers": transformers.__version__,
                         "triton": triton_version, "python": platform.python_version(), "argv": sys.argv[1:],
                         "max_new": args.max_new}
    check.data["errors"] = []
    sec = check.data["sections"]

    def guarded(name, fn):
        try:
            return fn()
        except Exception as exc:  # a section's failure is reported, the others still run
            check.data["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            check.note(f"{name} failed: {exc}")
            traceback.print_exc()
            return None
        finally:
            check.save()

    if "tests" in sections:
        sec["tests"] = guarded("tests", lambda: run_tests(check, device))
        check.note(f"tests: {sec['tests'] and sec['tests']['summary']}")
    needs_model = {"curves", "specbench", "hf"} & set(sections)
    if needs_model:
        if device.type == "cuda":  # goose's CPU kernels are not used here: do not compile them while loading
            os.environ.setdefault("GOOSE_CPU_KERNEL", "0")
        t = time.perf_counter()
        if args.tiny:
            model, tok = tiny_model(args.model)
            name = f"tiny random Llama ({args.model}'s tokenizer)"
        else:
            source = args.model
            if args.model_parts is not None:
                from gpu_carry import join

                source = str(join(args.model_parts))
            model, tok = real_model(source)
            name = source
        qs = questions(args.per_category, args.tiny)
        qs = qs[: args.questions] if args.questions else qs
        prompts = [prompt_ids(tok, q) for q in qs]
        # room for the longest request and a step's tree (the engine's tree_room), and for the cost measurement's
        # longer cache (2 x 256 entries and a tree)
        need = max(max(len(p) for p in prompts) + args.max_new + 160, 2 * 256 + 128)
        max_len = args.max_len or (need + 255) // 256 * 256
        check.data["env"].update(model=name, questions=len(qs), max_len=max_len)
        check.note(f"model {name} loaded in {time.perf_counter() - t:.1f} s; {len(qs)} questions, cache {max_len}")
        forwards = guarded("forwards", lambda: mode_forwards(model, device, modes, max_len, "curves" in sections,
                                                             args.fixed_no_dot))
        curves = {}
        if forwards and "curves" in sections:
            curves = guarded("curves", lambda: cost_curves(check, model, forwards)) or {}
            sec["curves"] = curves
        if forwards and "specbench" in sections:
            sec["specbench"] = guarded("specbench", lambda: spec_bench(check, model, tok, forwards, curves, qs,
                                                                       args.max_new, modes))
        if "hf" in sections:
            ar_rows = ((sec.get("specbench") or {}).get(modes[0]) or {}).get("ar", {}).get("rows")
            sec["hf"] = guarded("hf", lambda: hf_generate(check, model, tok, device, qs, args.max_new, ar_rows))
        forwards = None
    if "synthetic" in sections:
        layers = tuple(int(x) for x in args.synthetic_layers.split(","))
        sec["synthetic"] = guarded("synthetic", lambda: synthetic(check, device, args.tiny, layers))
    elif args.synthetic_from is not None:
        sec["synthetic"] = guarded("synthetic-from", lambda: json.loads(args.synthetic_from.read_text())["sections"][
            "synthetic"])
    if sec.get("synthetic"):
        sec["synthetic"]["measured"] = {int(k): {int(n): v for n, v in c.items()}
                                        for k, c in sec["synthetic"]["measured"].items()}
        if "projected_32_layers_ms" in sec["synthetic"]:
            sec["synthetic"]["projected_32_layers_ms"] = {int(n): v for n, v in
                                                          sec["synthetic"]["projected_32_layers_ms"].items()}
        if sec.get("specbench"):
            real = (sec.get("curves") or {}).get(modes[0], {}).get("ms")
            sec["projection"] = guarded("projection", lambda: project(sec["specbench"], sec["synthetic"], real))
    sec["targets"] = targets(sec)
    check.save()
    print((check.out / "gpu_check.md").read_text())
    return 1 if check.data["errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
