"""`make results`: run the README's benchmark on this machine and write its table, with the CPU, the commit,
the date and the command, to a markdown file the README quotes (docs/results/current.md).

    python -m goose.bench.results [--limit N] [--max-new-tokens N] [--methods ...] [--out DIR] [--write FILE]

The run is an ordinary `goose bench` directory (resumable: rerun the same command after an interruption);
this module only chooses its settings, renders the table and copies it into README.md between the
`<!-- results: ... -->` and `<!-- end results -->` lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

from .. import cachefs
from ..errors import GooseError
from ..machine import cpu_name
from .report import fmt
from .summary import ALL

METHODS = "goose,ar,pld,hf-ar,hf-pld"
LIMIT = 1  # questions per Spec-Bench category (13 categories)
MAX_NEW = 128
OUT = "runs/results"
WRITE = "docs/results/current.md"
README = "README.md"
QUOTE = re.compile(r"(<!-- results:[^\n]*-->\n)(.*?)(\n<!-- end results -->)", re.S)
# what each method is, in the table's words
MEANING = {
    "ar": "goose's own loop, one token per forward (the lossless reference)",
    "goose": "goose: GOOSE spine trees (the default method)",
    "pld": "goose's loop with prompt lookup drafts",
    "hf-ar": "Hugging Face `generate` (greedy), float32 `nn.Linear`",
    "hf-pld": "Hugging Face `generate` with `prompt_lookup_num_tokens=10`",
}


def load_line(before: tuple | None, after: tuple | None) -> str:
    """The machine's 1-minute load average before and after the run, against its CPU count: how busy it was."""
    cpus = os.cpu_count()
    parts = [f"{when} {load[0]:.1f}" for when, load in (("before", before), ("after", after)) if load]
    return f"- load average (1 min) {', '.join(parts)}, on {cpus} CPUs" if parts else ""


def render(summary: dict, command: str, bench_command: str, cpu: str, date: str, load: str = "") -> str:
    """The markdown file: where and how the numbers were made, then one row per method."""
    meta = summary["meta"]
    table = summary["table"]
    cats = [c for c in summary["categories"] if c != ALL]
    lines = [
        "# Current results",
        "",
        f"- CPU: {cpu} ({meta.get('threads')} torch thread{'' if meta.get('threads') == 1 else 's'})",
        f"- commit: `{meta.get('git_commit')}`",
        f"- date: {date}",
        f"- command: `{command}` (runs `{bench_command}`)",
        f"- model: {Path(str(meta.get('model'))).name}, {meta.get('dtype')}, goose's weights: {meta.get('weights')}, "
        f"arith {meta.get('arith', 'exact')}; "
        f"hf-* run on their own float32 copy in transformers' modules",
        f"- questions: {summary['questions']} from Spec-Bench ({len(cats)} categories), "
        f"{meta.get('max_new_tokens')} new tokens per turn, greedy, "
        f"{'chat template' if meta.get('chat') else 'raw prompts'}",
        *([load] if load else []),
        "",
        "| method | what it is | tokens/s | vs hf-ar | vs ar | tokens per forward | identical to ar |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in summary["methods"]:
        cell = table[m][ALL]
        checked = cell.get("checked", cell["turns"])
        same = f"{cell['lossless']}/{checked} turns" if checked else "n/a"
        lines.append(f"| {m} | {MEANING.get(m, '')} | {fmt(cell['tokens_per_s'], '{:.1f}')} | "
                     f"{fmt(cell['speedup_vs_hf_ar'], '{:.2f}x')} | {fmt(cell['speedup_vs_ar'], '{:.2f}x')} | "
                     f"{fmt(cell['tau'], '{:.2f}')} | {same} |")
    if summary.get("mismatches"):
        lines += ["", f"{len(summary['mismatches'])} turns differ from ar; the run directory's report.md lists "
                      "each with both tokens' logits (hf-* run Hugging Face's float32 forward, which agrees with "
                      "goose's kernels up to floating-point near-ties)."]
    return "\n".join(lines) + "\n"


def _loadavg() -> tuple | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def quote(readme: str, results: str) -> str:
    """`readme` with the text between its results markers replaced by `results` (its title line dropped)."""
    body = "\n".join(line for line in results.strip().splitlines() if not line.startswith("# ")).strip()
    if not QUOTE.search(readme):
        raise GooseError("README.md has no '<!-- results: ... -->' ... '<!-- end results -->' lines")
    return QUOTE.sub(lambda m: m.group(1) + body + m.group(3), readme, count=1)


def main(argv: list[str] | None = None) -> int:
    from ..cli import main as goose_main

    p = argparse.ArgumentParser(prog="python -m goose.bench.results", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=LIMIT, help=f"questions per category (default {LIMIT})")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help=f"per turn (default {MAX_NEW})")
    p.add_argument("--methods", default=METHODS, help=f"default {METHODS}")
    p.add_argument("--dataset", default="spec-bench",
                   help="default: spec-bench (Spec-Bench's questions shipped with goose)")
    p.add_argument("--raw", action="store_true",
                   help="raw prompts (default: the chat template; an instruct model answers raw prompts briefly)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 on a busy machine)")
    p.add_argument("--out", default=OUT, help=f"the bench directory (default {OUT})")
    p.add_argument("--write", default=WRITE, help=f"the markdown file to write (default {WRITE})")
    p.add_argument("--command", default="make results", help="the command recorded in the file")
    p.add_argument("--no-run", action="store_true", help="only render the table from the finished run in --out")
    p.add_argument("--readme", default=README, help=f"the README that quotes the file (default {README}; '' for none)")
    args = p.parse_args(argv)
    bench = ["bench", "--dataset", args.dataset, "--limit", str(args.limit), "--max-new-tokens",
             str(args.max_new_tokens), "--methods", args.methods, "--out", args.out]
    if not args.raw:
        bench.append("--chat")
    if args.threads is not None:
        bench += ["--threads", str(args.threads)]
    before = None if args.no_run else _loadavg()
    rc = 0 if args.no_run else goose_main(bench)
    if rc != 0:
        return rc
    summary = json.loads((Path(args.out) / "summary.json").read_text(encoding="utf-8"))
    shown = " ".join(["goose"] + [a if " " not in a else f"'{a}'" for a in bench])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = render(summary, args.command, shown.replace(str(Path.cwd()) + "/", ""), cpu_name(), date,
                  load_line(before, _loadavg()))
    path = Path(args.write)
    path.parent.mkdir(parents=True, exist_ok=True)
    cachefs.write_text(path, text)
    print(f"results: {path}", file=sys.stderr)
    if args.readme and Path(args.readme).is_file():
        readme = Path(args.readme)
        cachefs.write_text(readme, quote(readme.read_text(encoding="utf-8"), text))
        print(f"results: quoted in {readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GooseError as exc:
        print(f"goose: error: {exc}", file=sys.stderr)
        sys.exit(2)
