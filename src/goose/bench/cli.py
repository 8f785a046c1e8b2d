"""`goose bench`, `goose report` and `goose demo`: registered into goose's command line by `register`."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from .. import cachefs
from ..cliargs import (
    add_head_arg,
    add_model_args,
    add_sampling_args,
    cli_arith,
    goose_config,
    positive_int,
    prefix_cache_mb,
    sampling_options,
)
from ..config import DEFAULT_MEMORY_MB, DEFAULT_PREFIX_CACHE_MB, check_memory_mb
from ..errors import GooseError
from ..loading.packaged import DEFAULT_MODEL
from . import datasets
from .methods import ALL_METHODS, HF_METHODS, MEMORY_MODES, check, parse_memory, split, with_memory

# torch, transformers and matplotlib are imported by the commands that use them, not at start-up

DEFAULT_METHODS = "ar,pld,tr,iso3,iso5,goose,hf-ar,hf-pld"
DEMO_METHODS = "goose,hf-ar,hf-pld"  # and ar, always run
DEMO_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")  # with HumanEval: 6 x --limit


def parse_methods(text: str, memory: str | None = None) -> list[str]:
    """--methods, checked, with the `@mode` variants `--memory` asks for (`methods.with_memory`)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise GooseError("--methods is empty")
    for m in methods:
        check(m)
    return with_memory(methods, parse_memory(memory))


def model_key(model: str) -> str:
    """The model as recorded in run.json: packaged names as they are, paths made absolute."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model


def run_bench(args, questions: list, dataset: str, argv: list[str], replace: bool = False) -> int:
    """Shared by bench and demo: check the directory, load, run, then write summary, report and plots. A run in
    the directory that this one cannot continue (other settings or software) is an error, or with `replace`
    (the demo's own directory) moved to ``<out>.old`` (replacing an older one there) before a new run starts."""
    import torch

    from ..backends.quant import weights_kind
    from ..engine.scheduler import freeze_heap
    from ..loading.model import load_model, resolve_device
    from . import store
    from .engines import load_baseline, method_settings
    from .runner import Runner, with_reference

    out = Path(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # recorded in run.json as "threads"
    pinned = {"model": model_key(args.model), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "chat": args.chat, "sampling": sampling_options(args) or None, "arith": cli_arith(args),
              "threads": torch.get_num_threads(),
              "device": str(resolve_device(args.device)), "software": store.software()}
    old = store.read_meta(out) if out.is_dir() else None
    why = store.pinned_conflict(out, old, pinned)  # fail before the (slow) model load
    if why and replace:
        aside = out.with_name(out.name + ".old")
        if aside.exists():
            shutil.rmtree(aside)
        out.rename(aside)
        print(f"{why.split('; ')[0]}: moved to {aside}, starting a new run", file=sys.stderr)
        old = None
    elif why:
        raise GooseError(why)
    methods = with_reference(args.methods)
    memory_mb = getattr(args, "memory_mb", DEFAULT_MEMORY_MB) if any(split(m)[1] for m in methods) else None
    if old and old.get("memory_mb") is not None and memory_mb is not None and old["memory_mb"] != memory_mb:
        raise GooseError(f"{out} holds a run with memory_mb={old['memory_mb']!r}, not {memory_mb!r}; use another "
                         f"--out directory")
    settings = method_settings(methods)  # a missing datastore fails here, before the model load
    t0 = time.perf_counter()
    model, tok = load_model(args.model, args.dtype, args.device, weights=getattr(args, "weights", None),
                            arith=pinned["arith"])
    # Hugging Face's methods run on their own copy: float32 in transformers' modules and kernels
    baseline = load_baseline(args.model, args.dtype, args.device)[0] if any(m in HF_METHODS for m in methods) \
        else None
    runner = Runner(model, tok, methods, args.max_new_tokens, args.chat, args.repeats, model_id=pinned["model"],
                    config=goose_config(args), sampling=pinned["sampling"], baseline=baseline, memory_mb=memory_mb or 0)
    freeze_heap()  # no method's timing may hold a ~200 ms full collection of the libraries and models
    meta = {**store.environment(pinned["model"], model, args.dtype, args.device, argv), **pinned,
            "weights": weights_kind(model), "baseline_weights": None if baseline is None else "float32 (transformers)",
            "dataset": dataset, "repeats": args.repeats,
            "memory_mb": memory_mb if memory_mb is not None else (old or {}).get("memory_mb"),
            "method_settings": {**(old or {}).get("method_settings", {}), **settings},
            "methods": methods + [m for m in (old or {}).get("methods", []) if m not in methods]}
    store.open_run(out, meta)
    print(f"bench: {len(questions)} questions x {len(methods)} methods ({', '.join(methods)}), "
          f"max_new_tokens {args.max_new_tokens} -> {out}", file=sys.stderr)
    res = runner.run(questions, out, progress=not args.no_progress)
    if res.skipped:
        print(f"bench: {res.skipped} questions already done in {out} (skipped)", file=sys.stderr)
    if res.done == 0 and res.skipped == 0:
        raise GooseError("interrupted before any question finished; nothing written") if res.interrupted else \
            GooseError("no questions to run")
    rendered = render_dir(out)
    print(f"\nreport: {rendered}  ({time.perf_counter() - t0:.0f}s)")
    if res.interrupted:
        print("goose: interrupted; finished questions are kept, rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


def render_dir(out: Path) -> Path:
    """(Re)write summary.json, the plots and report.md from the files in `out`; print the main tables."""
    from .plots import write_plots
    from .report import console_table, render
    from .summary import summarize, write_summary

    summary = summarize(out)
    write_summary(out, summary)
    plots = write_plots(summary, out)
    path = out / "report.md"
    cachefs.write_text(path, render(summary, plots))
    print(console_table(summary))
    return path


def cmd_bench(args) -> int:
    if args.with_decoder and args.engine != "vllm":
        raise GooseError("--with-decoder runs goose's Decoder beside vLLM: it needs --engine vllm")
    if args.engine == "vllm" and args.arith == "auto":
        args.arith = "exact"  # (vLLM's engine runs its own arithmetic)
    if args.engine == "vllm" and args.arith != "exact":
        raise GooseError("--arith int8 is goose's own arithmetic; vLLM's engine runs its own (drop --arith or "
                         "--engine vllm)")
    if args.engine == "vllm":  # vLLM's methods and GooseProposer, from the vLLM venv (bench/vllm_engine.py)
        from .vllm_engine import VLLM_METHODS, cmd_bench_vllm

        args.methods = VLLM_METHODS if args.methods == DEFAULT_METHODS else args.methods
        questions = datasets.load(args.dataset, _split(args.categories), args.limit)
        return cmd_bench_vllm(args, questions, sys.argv[1:])
    args.methods = parse_methods(args.methods, args.memory)
    questions = datasets.load(args.dataset, _split(args.categories), args.limit)
    if not questions:
        raise GooseError(f"dataset '{args.dataset}' gave no questions")
    if args.concurrency is not None or args.rate is not None:
        if any(split(m)[1] for m in args.methods):
            raise GooseError("--memory runs sessions one at a time; it cannot be combined with --concurrency/--rate")
        return run_concurrency(args, questions)
    return run_bench(args, questions, args.dataset, sys.argv[1:])


def run_concurrency(args, questions: list) -> int:
    """`--concurrency N` / `--rate R`: the methods on one Engine each, N requests in flight."""
    import torch

    from ..loading.model import load_model
    from ..names import METHODS
    from .concurrency import run

    if args.rate is not None and not args.rate > 0:
        raise GooseError(f"--rate must be > 0 requests per second, got {args.rate}")
    other = [m for m in args.methods if m not in METHODS]
    if other:
        raise GooseError(f"--concurrency runs goose's methods on its engine; {', '.join(other)} cannot run there")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    methods = list(dict.fromkeys(args.methods + ["ar"]))  # in the order given (ar last unless named)
    model, tok = load_model(args.model, args.dtype, args.device, weights=getattr(args, "weights", None),
                            arith=cli_arith(args))
    path = run(model, tok, questions, methods, args.max_new_tokens, args.concurrency or 1, args.rate, args.chat,
               Path(args.out), sampling_options(args), prefix_cache_mb=args.prefix_cache_mb)
    print(f"\nreport: {path}")
    return 0


def cmd_report(args) -> int:
    out = Path(args.dir)
    if not out.is_dir():
        raise GooseError(f"not a directory: {out}")
    print(f"\nreport: {render_dir(out)}")
    return 0


def cmd_demo(args) -> int:
    args.methods = parse_methods(args.methods)
    # HumanEval and five categories of the packaged Spec-Bench questions, --limit each (default 2: 12 questions)
    dataset = "humaneval,spec-bench"
    qs = datasets.load("humaneval", None, args.limit) + datasets.load("spec-bench", list(DEMO_CATEGORIES), args.limit)
    rc = run_bench(args, qs, dataset, sys.argv[1:], replace=True)
    if rc == 0:
        print(demo_verdict(json.loads((Path(args.out) / "summary.json").read_text(encoding="utf-8"))))
    return rc


def demo_verdict(summary: dict) -> str:
    """One line saying what the demo's numbers mean: goose's speed against each baseline, and the check."""
    from .summary import ALL

    table = summary["table"]
    goose = next((m for m in ("goose", *summary["methods"]) if m in table and m != "ar"), "ar")
    cell = table[goose][ALL]
    speed = cell["tokens_per_s"]
    parts = []
    for m, what in (("hf-ar", "Hugging Face generate"), ("hf-pld", "Hugging Face prompt lookup"),
                    ("ar", "goose's one-token loop")):
        base = table.get(m, {}).get(ALL, {}).get("tokens_per_s")
        if base and speed and m != goose:
            parts.append(f"{speed / base:.2f}x {what} ({m})")
    checked = cell.get("checked", cell["turns"])
    same = f"{cell['lossless']} of {checked} answers token-identical to ar" if checked else "not checked against ar"
    return (f"demo: {goose} made {speed:.1f} tokens/s on {summary['questions']} questions: {', '.join(parts)}; "
            f"{same} (higher is faster; the same text, only sooner)")


def memory_mb_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        mb = check_memory_mb(value)
    except (GooseError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not mb > 0:
        raise argparse.ArgumentTypeError("must be > 0 (the memory variants need a memory)")
    return mb


def _split(text: str | None) -> list[str] | None:
    return [c.strip() for c in text.split(",") if c.strip()] if text else None


def _common(p: argparse.ArgumentParser, max_new: int, out: str, methods: str) -> None:
    add_model_args(p)
    add_head_arg(p)
    p.add_argument("--methods", default=methods,
                   help=f"comma-separated, from {', '.join(ALL_METHODS)} (default {methods}); 'ar' is always run "
                        f"as the reference of the lossless check and the speedups")
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new, help=f"per turn (default {max_new})")
    p.add_argument("--chat", action="store_true", help="apply the chat template (default: raw prompts, as the paper)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="run each question's round of methods R times; keep the median time (default 1)")
    p.add_argument("--out", default=out, help=f"output directory; rerunning resumes it (default {out})")
    p.add_argument("--threads", type=positive_int,
                   help="torch CPU threads (default: torch's choice; use 1 on a machine busy with other work)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sampling_args(p)


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods side by side (Spec-Bench-compatible answers, report, plots)")
    b.add_argument("--dataset", default="builtin",
                   help="builtin (default), humaneval, sharegpt, spec-bench[:PATH], mt-bench[:PATH], gsm8k[:PATH] "
                        "(without PATH: Spec-Bench's questions shipped with goose), jsonl:PATH, or the session "
                        "workloads multiturn[:PATH], code-edit, agent; several joined by commas")
    b.add_argument("--categories", help="comma-separated categories to keep")
    b.add_argument("--limit", type=int, help="first N questions of each category")
    b.add_argument("--engine", choices=("goose", "vllm"), default="goose",
                   help="vllm: vLLM's plain/ngram/suffix and goose's GooseProposer (--methods from "
                        "plain,ngram,suffix,goose; sessions and --memory: default plain,suffix, with suffix@MODE "
                        "rows), run from the venv of `make vllm`")
    b.add_argument("--with-decoder", action="store_true",
                   help="with --engine vllm: also run goose's own Decoder in the bench process (rows decoder/ar, "
                        "decoder/goose, decoder/goose@MODE for each --memory mode), taking turns with vLLM's "
                        "methods session by session")
    b.add_argument("--concurrency", type=positive_int,
                   help="serve the questions through one Engine per method with N requests in flight (aggregate "
                        "tokens/s, TTFT and TPOT percentiles, lossless column); writes OUT/concurrency.md")
    b.add_argument("--rate", type=float,
                   help="with --concurrency: Poisson arrivals of R requests per second (default: all at once)")
    b.add_argument("--prefix-cache-mb", type=prefix_cache_mb, default=DEFAULT_PREFIX_CACHE_MB,
                   help="with --concurrency: the engine's prefix cache (Engine(prefix_cache_mb=...); 0 = off; "
                        f"default {DEFAULT_PREFIX_CACHE_MB})")
    b.add_argument("--memory",
                   help=f"comma-separated, from {', '.join(MEMORY_MODES)}: run goose with its suffix memory too, "
                        "once per mode (rows goose@MODE): the memory starts each session empty (cold), holding "
                        "the run's earlier sessions (earlier) or every other session (warm); default: goose "
                        "without memory only")
    b.add_argument("--memory-mb", type=memory_mb_arg, default=DEFAULT_MEMORY_MB,
                   help=f"with --memory: MiB of each memory variant's suffix memory (default {DEFAULT_MEMORY_MB})")
    _common(b, 256, "runs/bench", DEFAULT_METHODS)
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="re-render summary.json, report.md and plots of a bench directory")
    r.add_argument("dir", help="a `goose bench` --out directory")
    r.set_defaults(func=cmd_report)

    d = sub.add_parser("demo", help="goose against ar, Hugging Face generate and its prompt lookup on 12 questions",
                       description=f"A short bench on {DEFAULT_MODEL}: HumanEval and five Spec-Bench categories, "
                                   "--limit prompts each (the built-in prompts and HumanEval without the Spec-Bench "
                                   "file), then one line on what the numbers mean.")
    d.add_argument("--limit", type=positive_int, default=2, help="prompts per category (default 2: 12 questions)")
    _common(d, 48, "runs/demo", DEMO_METHODS)
    # an instruct model answers raw Spec-Bench prompts in a token or two: the demo applies the chat template
    d.add_argument("--raw", dest="chat", action="store_false", help="raw prompts (default: the chat template)")
    d.set_defaults(func=cmd_demo, chat=True)
