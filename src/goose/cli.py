"""Command line: `goose generate`, plus the subcommands other modules register (bench, report, ...).

Bad input ends with a one-line ``goose: error: ...`` message and exit status 2, never a traceback.
Start-up stays light: torch and transformers are imported by the command that runs, and a subcommand that
another module registers is imported only when it is the one asked for (`goose --help` lists it by name).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from .cliargs import (
    METHODS,
    add_head_arg,
    add_model_args,
    add_sampling_args,
    cli_arith,
    first_mismatch,  # noqa: F401  (re-exported)
    goose_config,
    method_name,
    positive_int,
    sampling_options,
)
from .errors import GooseError
from .loading.packaged import DEFAULT_MODEL

# subcommands registered by other modules: module -> {command: its one-line help, as `goose --help` lists it}
# (tests/test_cli.py checks this against what each module's `register` adds)
REGISTERED = {
    "goose.headtrain": {
        "train-head": "train an EAGLE draft head for a model (eagle2, and goose with a head)",
    },
    "goose.bench.cli": {
        "bench": "benchmark methods side by side (Spec-Bench-compatible answers, report, plots)",
        "report": "re-render summary.json, report.md and plots of a bench directory",
        "demo": "goose against ar, Hugging Face generate and its prompt lookup on 12 questions",
    },
    "goose.server.cli": {
        "serve": "serve a model over an OpenAI-compatible HTTP API (with a web playground)",
        "bench-serve": "load-test an OpenAI-compatible server (loopback only)",
    },
    "goose.server.replicas": {
        "replicas": "N goose serve replicas behind vLLM's router (a tenant stays on one)",
    },
}


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise GooseError(f"prompt file not found: {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise GooseError(f"cannot read prompt file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise GooseError(f"prompt file {path} is not UTF-8 text (byte {exc.start})") from None
        if "\x00" in text:
            raise GooseError(f"prompt file {path} looks binary (it holds NUL bytes), not text")
        return text
    if args.prompt is None:
        raise GooseError("give a PROMPT or --prompt-file")
    return args.prompt


def cmd_generate(args) -> int:
    from .loading.model import load_model

    prompt = _read_prompt(args)
    if not prompt.strip():
        raise GooseError("the prompt is empty")
    if args.stream and args.json:
        raise GooseError("--stream prints text as it is accepted; it cannot be combined with --json")
    if args.stream and args.verify:
        raise GooseError("--verify compares the finished tokens with ar; it cannot be combined with --stream")
    options = sampling_options(args)
    model, tok = load_model(args.model, args.dtype, args.device, weights=args.weights, arith=cli_arith(args))
    from .decoding import Decoder  # (after the load: a first run compiles kernels while transformers imports)

    dec = Decoder(model, tok, args.method, goose_config(args))
    ids = dec.encode(prompt, chat=args.chat)
    if args.stream:
        text = []
        for piece in dec.stream(ids, args.max_new_tokens, **options):
            print(piece, end="", flush=True)
            text.append(piece)
        print()
        _hint_if_empty("".join(text), tok, args)
        return 0
    res = dec.generate(ids, args.max_new_tokens, **options)
    _hint_if_empty(res.text, tok, args)
    payload = res.to_dict()
    if args.verify:
        ref = Decoder(model, tok, "ar").generate(ids, args.max_new_tokens, **options).token_ids
        payload["lossless"] = ref == res.token_ids
        if ref != res.token_ids:
            payload["mismatch"] = first_mismatch(model, ids, ref, res.token_ids)
    if args.json:
        print(json.dumps(payload))
        return 0
    print(res.text)
    if args.verify:  # the text stays alone on stdout; the verdict goes to stderr
        if payload["lossless"]:
            print(f"goose: verify: the {len(res.token_ids)} tokens are identical to ar's", file=sys.stderr)
        else:
            mm = payload["mismatch"]
            print(f"goose: verify: differs from ar at token {mm['position']} ({mm['token']} instead of "
                  f"{mm['ar_token']}; logits {mm.get('logit')} vs {mm.get('ar_logit')})", file=sys.stderr)
            return 1
    return 0


def _hint_if_empty(text: str, tok, args) -> None:
    """One line on stderr when a prompt without --chat gave no text and the tokenizer has a chat template: an
    instruct model given raw text often ends at once (SmolLM2-135M-Instruct does on "Tell me a story.")."""
    if not text.strip() and not args.chat and getattr(tok, "chat_template", None):
        print("goose: the model gave no text: it ended at once. This tokenizer has a chat template; an instruct "
              "model usually needs --chat", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump): ``goose: error: ...``, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"goose: error: {message} (see '{self.prog} --help')\n")


def cmd_profile(args) -> int:
    from .backends import cpukernel
    from .decoding import default_forward
    from .engine.measure import batch_counts, load_or_measure
    from .loading.model import load_model

    model, _ = load_model(args.model, args.dtype, args.device, weights=args.weights, arith=cli_arith(args))
    fwd = default_forward(model)
    curve = load_or_measure(model, fwd, remeasure=args.remeasure)
    batches = [(b, load_or_measure(model, fwd, remeasure=args.remeasure, sequences=b))
               for b in (batch_counts(args.max_batch) if args.max_batch else []) if b > 1]
    why = cpukernel.unavailable_reason()
    kernels = fwd.backend + ("" if why is None else f"; goose's CPU kernel unavailable: {why}")
    print(f"forward cost of {args.model} ({args.dtype}, {args.device}, {type(fwd).__name__}, kernels: {kernels})")
    print(f"{'tokens':>6} {'ms':>9} {'x cost(1)':>10} {'break-even accepted':>20}")
    for n, ms in zip(curve.sizes, curve.ms):
        print(f"{n:>6} {ms:>9.1f} {ms / curve.ms[0]:>10.2f} {curve.break_even(n):>20.2f}")
    print(f"(on {curve.cache_len} cached tokens; each query row costs {curve.context_ms * 1e3:.2f} us more per "
          f"further cached token)")
    for b, c in batches:
        sizes = sorted({n for n in (b, b + 1, b + 2, b + 4, 2 * b) if n <= c.max_size})
        print(f"{b} sequences in one forward (the Engine): " + ", ".join(f"{c(n):.1f} ms for {n} rows" for n in sizes))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(curve.sizes, curve.ms, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("query tokens per forward")
        ax.set_ylabel("ms per forward (median)")
        ax.set_title(f"forward cost: {args.model}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")
    return 0


def cmd_datastore_build(args) -> int:
    from transformers import AutoTokenizer

    from .drafting import datastore
    from .loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir(args.model))
    tok.model_max_length = 1 << 62  # whole documents are tokenized; no length warning
    sources = args.source or list(datastore.SOURCES)
    path = datastore.store_dir(args.name)
    print(f"datastore: building '{args.name}' from {', '.join(sources)} with the tokenizer of {args.model} "
          f"-> {path}", file=sys.stderr)
    store = datastore.build(tok, sources, args.name, args.max_docs, progress=not args.no_progress, model=args.model)
    _print_info(store.info())
    return 0


def _print_info(info: dict) -> None:
    tok = info.get("tokenizer") or {}
    size = info.get("bytes") or 0
    print(f"datastore {info.get('name')}  ({info.get('path')})")
    print(f"  sources   {', '.join(f'{k} ({v} docs)' for k, v in (info.get('sources') or {}).items())}")
    print(f"  documents {info.get('docs')}   tokens {info.get('tokens'):,}   size {size / 2**20:.1f} MiB")
    print(f"  tokenizer of {info.get('model')}: {tok.get('name_or_path')} (vocab {tok.get('vocab_size')}, "
          f"fingerprint {tok.get('fingerprint')})")
    split = (f" (tokenizing {info['tokenize_s']} s, suffix array {info['index_s']} s)"
             if info.get("tokenize_s") is not None else "")
    print(f"  built     {info.get('created')} in {info.get('build_s')} s{split}"
          + (f" (max {info['max_docs']} docs per source)" if info.get("max_docs") else ""))


def cmd_datastore_info(args) -> int:
    from .drafting import datastore

    _print_info(datastore.load(args.name).info())
    return 0


def cmd_cache_path(args) -> int:
    from .paths import cache_root

    print(cache_root())
    return 0


def cmd_cache_verify(args) -> int:
    """One line per bad entry (damaged, without a digest, or another user's or writable by others), then a
    summary; exit status 1 when any is bad."""
    from . import cachefs
    from .paths import cache_root

    root = cache_root()
    if not root.exists():
        print(f"no cache at {root}")
        return 0
    checked, bad = cachefs.verify_tree(root)
    for path, why in bad:
        print(f"{path}: {why}")
    print(f"{checked} entries in {root}: " + (f"{len(bad)} bad (a damaged entry is built again on its next use, "
                                              "a datastore by goose datastore build)" if bad else "all whole"))
    return 1 if bad else 0


def cmd_cache_clear(args) -> int:
    from . import cachefs
    from .paths import cache_root

    root = cache_root()
    if root.exists():
        cachefs.clear(root)
    print(f"emptied {root}")
    return 0


def build_parser(load: set[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. `load`: the modules of `REGISTERED` whose subcommands are built in full (None:
    all); the others' subcommands appear by name and help only."""
    parser = _Parser(prog="goose", description="Lossless speculative decoding with GOOSE spine trees.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", nargs="?", help="the prompt text")
    g.add_argument("--prompt-file", help="read the prompt from this file")
    add_model_args(g)
    g.add_argument("--method", type=method_name, default="goose", help=f"one of {', '.join(METHODS)} (default goose)")
    add_head_arg(g)
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="default 128")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    g.add_argument("--verify", action="store_true",
                   help="also run ar (same sampling options and seed) and report token identity (in the JSON "
                        "with --json, else on stderr; exit status 1 when they differ)")
    g.add_argument("--stream", action="store_true", help="print the text as it is accepted")
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    pr = sub.add_parser("profile", help="measure (or show the cached) forward cost curve of a model")
    add_model_args(pr)
    pr.add_argument("--remeasure", action="store_true", help="measure again instead of using the cached curve")
    pr.add_argument("--max-batch", type=positive_int, default=None,
                    help="also the Engine's curves for up to this many requests per forward (its max_batch; "
                         "default: none)")
    pr.add_argument("--plot", default="goose-profile.png", help="PNG to write (default goose-profile.png; '' for none)")
    pr.set_defaults(func=cmd_profile)
    ds = sub.add_parser("datastore", help="build or inspect REST's datastore (in the user cache dir)")
    dsub = ds.add_subparsers(dest="datastore_command", required=True, parser_class=_Parser)
    b = dsub.add_parser("build", help="tokenize corpora and build the suffix array")
    b.add_argument("--source", action="append",
                   help="sharegpt, python-stdlib, or a folder / file path (repeatable; default: sharegpt and "
                        "python-stdlib)")
    b.add_argument("--model", default=DEFAULT_MODEL, help=f"whose tokenizer to use (default {DEFAULT_MODEL})")
    b.add_argument("--name", default="default", help="store name (default 'default', what `rest` uses)")
    b.add_argument("--max-docs", type=positive_int, help="at most N documents per source (default: all)")
    b.add_argument("--no-progress", action="store_true", help="no progress lines")
    b.set_defaults(func=cmd_datastore_build)
    i = dsub.add_parser("info", help="size, token count, build time and tokenizer of a store")
    i.add_argument("--name", default="default", help="store name (default 'default')")
    i.set_defaults(func=cmd_datastore_info)
    ca = sub.add_parser("cache", help="check or empty goose's cache folder (kernels, packed weights, curves, stores)")
    csub = ca.add_subparsers(dest="cache_command", required=True, parser_class=_Parser)
    csub.add_parser("path", help="print the cache folder").set_defaults(func=cmd_cache_path)
    csub.add_parser("verify", help="check every entry's digest and owner; exit status 1 when any is bad"
                    ).set_defaults(func=cmd_cache_verify)
    csub.add_parser("clear", help="delete everything in the cache (run while no goose process runs)"
                    ).set_defaults(func=cmd_cache_clear)
    for module, commands in REGISTERED.items():
        if load is None or module in load:
            importlib.import_module(module).register(sub)
        else:
            for name, text in commands.items():
                sub.add_parser(name, help=text, add_help=False)
    return parser


def _modules_for(argv: list[str]) -> set[str]:
    """The `REGISTERED` module of the subcommand in `argv` (the first word that is not an option), if any."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return {m for m, commands in REGISTERED.items() if word in commands}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_modules_for(argv))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except GooseError as exc:
        print(f"goose: error: {' '.join(str(exc).split())}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:
        print("goose: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader went away (`goose generate ... | head -c 100`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot raise again
        return 141  # as a shell reports a process killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
