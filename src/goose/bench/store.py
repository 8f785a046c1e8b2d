"""The files of a bench run in DIR: `run.json` (what was run, by whom) and `answers/<method>.jsonl`.

Rows are appended and flushed one question at a time, so an interrupted run keeps every finished
question and a rerun skips them. A run directory belongs to one setting (model, dtype, max_new_tokens,
chat mode, sampling, goose's arithmetic, and what its timings depend on: threads, device, goose's source
and the versions of torch and transformers): mixing settings would make its tables meaningless, so a resume
with another one is refused. A resume keeps run.json's record of the first run and adds its own command.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .. import cachefs
from ..errors import GooseError

# Settings a run directory holds one value of: those that change the generated tokens, and those that
# change the timings (threads, device, the code and its main libraries), so one table never mixes them.
PINNED = ("model", "dtype", "max_new_tokens", "chat", "sampling", "arith", "threads", "device", "software")
RECORDED_BEFORE = {"arith": "exact"}  # a pinned setting's value in runs recorded before it was pinned


def software() -> dict:
    """What the timings depend on in software: goose's version and a hash of its source files (so an edit
    counts, in a checkout or an installed copy), torch and transformers."""
    import transformers

    from .. import __version__

    return {"goose": f"{__version__}+{source_hash()}", "torch": torch.__version__,
            "transformers": transformers.__version__}


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 (first 12 hex digits) of goose's own source files (.py and .cpp), read once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def pinned_conflict(out: Path, old: dict | None, new: dict) -> str | None:
    """Why the run in `out` (its run.json `old`) cannot be resumed with the settings `new` (None if it can)."""
    if old is None:
        return None
    for key in PINNED:
        a, b = old.get(key, RECORDED_BEFORE.get(key)), new.get(key, RECORDED_BEFORE.get(key))
        if a == b:
            continue
        if a is None and key in ("threads", "device", "software"):
            return (f"{out} was recorded without its {key}, so it cannot be told whether the timings "
                    f"would match; use another --out directory")
        if isinstance(a, dict) and isinstance(b, dict):
            diff = ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                             if a.get(k) != b.get(k))
            return (f"{out} holds a run made with other {key} ({diff}); its timings would not be comparable: "
                    f"use another --out directory")
        return f"{out} holds a run with {key}={a!r}, not {b!r}; use another --out directory"
    return None


def answers_dir(out: Path) -> Path:
    return out / "answers"


def answers_path(out: Path, method: str) -> Path:
    return answers_dir(out) / f"{method}.jsonl"


def read_answers(path: Path, repair: bool = False) -> list[dict]:
    """Rows of one answers file. A torn last line (the run was killed mid-write) is dropped, and with
    `repair` removed from the file; a malformed line elsewhere is an error naming the line."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):  # torn tail
                if repair:
                    cachefs.write_text(path, "\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else ""))
                break
            raise GooseError(f"{path} line {n}: not valid JSON; fix or remove that line") from None
    return rows


def load_all(out: Path) -> dict[str, list[dict]]:
    """Every method's rows in `out`, keyed by method (file name)."""
    d = answers_dir(out)
    if not d.is_dir():
        return {}
    return {p.stem: read_answers(p) for p in sorted(d.glob("*.jsonl"))}


def append_row(out: Path, method: str, row: dict) -> None:
    path = answers_path(out, method)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_meta(out: Path) -> dict | None:
    path = out / "run.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise GooseError(f"{path} is not valid JSON; is this a goose bench directory?") from None


def open_run(out: Path, meta: dict) -> dict:
    """Create or reopen the run directory `out` for `meta`; refuse one holding a different setting."""
    if out.exists() and not out.is_dir():
        raise GooseError(f"--out {out} exists and is not a directory")
    old = read_meta(out)
    if old is None and answers_dir(out).is_dir() and any(answers_dir(out).glob("*.jsonl")):
        raise GooseError(f"{out} holds answers but no run.json; use another --out directory")
    if old is not None:
        why = pinned_conflict(out, old, meta)
        if why:
            raise GooseError(why)
        # a resume keeps what the run was made with and adds its command (and commit, if another)
        resumed = {k: meta[k] for k in ("methods", "method_settings", "repeats", "dataset") if k in meta}
        commits = old.get("git_commits") or [old.get("git_commit")]
        if meta.get("git_commit") not in commits:
            commits = commits + [meta.get("git_commit")]
        meta = {**meta, **old, **resumed, "commands": old.get("commands", []) + meta.get("commands", [])}
        if commits != [old.get("git_commit")]:
            meta["git_commits"] = commits
    out.mkdir(parents=True, exist_ok=True)
    for folder in (out, answers_dir(out)):  # temporaries of a killed run (a plot, summary, answers being written)
        cachefs.clean_stale(folder)
    for p in answers_dir(out).glob("*.jsonl"):
        read_answers(p, repair=True)
    cachefs.write_text(out / "run.json", json.dumps(meta, indent=2) + "\n")  # atomic: a kill leaves old or new
    return meta


def environment(model_name: str, model, dtype: str, device: str, command: list[str]) -> dict:
    """Run metadata: the pinned settings are added by the caller; this is the machine and the software."""
    import transformers

    from .. import __version__

    return {
        "model": model_name, "dtype": dtype, "device": str(next(model.parameters()).device),
        "requested_device": device, "threads": torch.get_num_threads(), "software": software(),
        "versions": {"goose": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "git_commit": git_commit(), "commands": [" ".join([Path(sys.argv[0]).name] + command)],
    }


def git_commit() -> str | None:
    """The commit of the goose checkout this code runs from (None outside a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if res.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return res.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None
