"""goose against llama.cpp (llama-cpp-python) on the same GGUF file and the same prompt token ids.

Every engine runs in a process of its own, one after the other (their peak RSS is their own), on the same
token ids (the model's chat template applied by goose's tokenizer), greedy, the same `--max-new-tokens`,
ignoring end-of-sequence tokens (every prompt decodes the full length, so tokens/s compare like for like):

- `llama`       llama.cpp plain decoding (`Llama.generate`, top_k 1, 2 threads, n_batch 512);
- `llama-pld`   llama.cpp with its prompt-lookup drafting (`LlamaPromptLookupDecoding`, 10 tokens);
- `goose-ar`    goose plain decoding on the file's quantized blocks (`weights="gguf"`);
- `goose`       goose's device-aware `goose` method on the same blocks;
- `goose-ar-int8`, `goose-int8`: the same two with `arith="int8"` (8-bit activations times the blocks in integers).

Per engine: time to first token (the prompt's prefill + first token), decode tok/s after the first token,
end-to-end tok/s, peak RSS of the process (model loading included), and whether its tokens equal its own
plain decoding (llama.cpp: `llama-pld` against `llama`; goose: `goose` against `goose-ar` in its arithmetic) and goose's
against llama.cpp's (their float arithmetic differs; reported, not required).

    .venv-llama/bin/pip install llama-cpp-python==0.3.36 numpy     # builds llama.cpp from source (~4-10 min)

(On a VM whose CPU lists AMX, llama.cpp's native build crashed at the first token, SIGILL or SIGSEGV: build
it with the CMAKE_ARGS given in docs/performance-log.md §7, which turn AMX off and keep AVX-512.)
    .venv/bin/python benchmarks/vs_llamacpp.py --limit 1 --max-new-tokens 128
    .venv/bin/python benchmarks/vs_llamacpp.py --engines llama,goose-ar-int8,goose-int8 --busy 2   # a contended CPU

`--busy N` starts N Python busy loops (`while True: pass`) before each engine's process and kills them after it.

Writes OUT/vs_llamacpp.json and OUT/vs_llamacpp.md. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("llama", "llama-pld", "goose-ar", "goose", "goose-ar-int8", "goose-int8")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_llama(gguf: str, prompts: list[list[int]], max_new: int, threads: int, pld: bool) -> dict:
    from llama_cpp import Llama  # noqa: PLC0415 (the llama venv)

    draft = None
    if pld:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: PLC0415

        draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, draft_model=draft, seed=0, logits_all=pld)  # drafts verify every row
    rows = []
    for ids in prompts:
        llm.reset()
        out, t0, first = [], time.perf_counter(), None
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if len(out) >= max_new:
                break
        rows.append({"tokens": out, "ttft_s": first - t0, "total_s": time.perf_counter() - t0})
    return {"rows": rows, "peak_rss_mb": peak_rss_mb()}


def run_goose(model_name: str, prompts: list[list[int]], max_new: int, threads: int, method: str,
              arith: str = "exact") -> dict:
    import torch  # noqa: PLC0415

    from goose import Decoder, load_model  # noqa: PLC0415
    from goose.decoding import DecodeConfig  # noqa: PLC0415

    torch.set_num_threads(threads)
    model, tok = load_model(model_name, weights="gguf", arith=arith)
    dec = Decoder(model, tok, method)
    dec.generate_ids([1, 2, 3, 4], DecodeConfig(max_new_tokens=8), eos=set())  # warm-up (cost curve, kernels)
    rows = []
    for ids in prompts:
        t0, first = time.perf_counter(), []

        def on_tokens(block, first=first):
            if not first:
                first.append(time.perf_counter())

        out, _ = dec.generate_ids(list(ids), DecodeConfig(max_new_tokens=max_new), on_tokens=on_tokens, eos=set())
        rows.append({"tokens": out, "ttft_s": first[0] - t0, "total_s": time.perf_counter() - t0})
    return {"rows": rows, "peak_rss_mb": peak_rss_mb()}


def worker(args) -> None:
    job = json.loads(Path(args.job).read_text())
    if args.worker.startswith("llama"):
        res = run_llama(job["gguf"], job["prompts"], job["max_new"], job["threads"], args.worker == "llama-pld")
    else:
        name = args.worker.removesuffix("-int8")
        res = run_goose(job["model"], job["prompts"], job["max_new"], job["threads"],
                        "ar" if name == "goose-ar" else "goose", "int8" if name != args.worker else "exact")
    print("RESULT " + json.dumps(res), flush=True)


def summarise(res: dict) -> dict:
    rows = res["rows"]
    toks = sum(len(r["tokens"]) for r in rows)
    total = sum(r["total_s"] for r in rows)
    after_first = sum(r["total_s"] - r["ttft_s"] for r in rows)
    ttfts = sorted(r["ttft_s"] for r in rows)
    return {"tokens": toks, "e2e_tok_s": toks / total, "decode_tok_s": (toks - len(rows)) / after_first,
            "ttft_ms_median": 1e3 * ttfts[len(ttfts) // 2], "peak_rss_mb": res["peak_rss_mb"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m", help="packaged name or .gguf file")
    ap.add_argument("--prompts", default="spec-bench")
    ap.add_argument("--limit", type=int, default=1, help="questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--llama-python", default=str(ROOT / ".venv-llama" / "bin" / "python"))
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside every engine (a contended CPU)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "vs_llamacpp"))
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    from transformers import AutoTokenizer  # noqa: PLC0415

    from goose.bench import datasets  # noqa: PLC0415
    from goose.decoding import encode  # noqa: PLC0415
    from goose.loading.model import gguf_source, model_dir  # noqa: PLC0415
    from goose.machine import cpu_name  # noqa: PLC0415

    gguf = gguf_source(args.model)
    if gguf is None:
        raise SystemExit(f"{args.model} has no GGUF file")
    tok = AutoTokenizer.from_pretrained(model_dir(args.model))
    prompts = [encode(tok, q.turns[0], True) for q in datasets.load(args.prompts, limit=args.limit)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = out / "job.json"
    job.write_text(json.dumps({"gguf": str(gguf), "model": args.model, "prompts": prompts,
                               "max_new": args.max_new_tokens,
                               "threads": args.threads}))
    results = {}
    for name in args.engines.split(","):
        py = args.llama_python if name.startswith("llama") else sys.executable
        print(f"[{name}] {len(prompts)} prompts", file=sys.stderr, flush=True)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            proc = subprocess.run([py, __file__, "--worker", name, "--job", str(job)], capture_output=True, text=True,
                                  cwd=ROOT)
        finally:
            for b in busy:
                b.kill()
                b.wait()
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results[name] = json.loads(line[len("RESULT "):])
    same = lambda a, b: sum(x["tokens"] == y["tokens"] for x, y in zip(results[a]["rows"], results[b]["rows"]))  # noqa: E731
    n = len(prompts)
    lines = [f"CPU: {cpu_name()}, {args.threads} threads; {gguf.name}; {n} prompts (chat template), greedy, "
             f"{args.max_new_tokens} new tokens each (end-of-sequence ignored)"
             + (f"; beside {args.busy} busy-loop processes" if args.busy else ""), "",
             "| engine | decode tok/s | end-to-end tok/s | TTFT median ms | peak RSS MB | equals its plain decoding "
             "| equals llama.cpp plain |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for name, res in results.items():
        s = summary[name] = summarise(res)
        plain = "llama" if name.startswith("llama") else "goose-ar" + ("-int8" if name.endswith("-int8") else "")
        own = f"{same(name, plain)}/{n}" if plain in results else "-"
        vs = f"{same(name, 'llama')}/{n}" if "llama" in results else "-"
        lines.append(f"| {name} | {s['decode_tok_s']:.1f} | {s['e2e_tok_s']:.1f} | {s['ttft_ms_median']:.0f} | "
                     f"{s['peak_rss_mb']:.0f} | {own} | {vs} |")
    if "llama" in summary:
        base = summary["llama"]
        lines += ["", "Ratios against llama.cpp plain: " + ", ".join(
            f"{k} decode {v['decode_tok_s'] / base['decode_tok_s']:.2f}x, end to end "
            f"{v['e2e_tok_s'] / base['e2e_tok_s']:.2f}x" for k, v in summary.items() if k != "llama")]
    md = "\n".join(lines) + "\n"
    (out / "vs_llamacpp.json").write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    (out / "vs_llamacpp.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
