"""Aggregate the answers files of a run into `summary.json`: τ (new tokens per target forward), MAT (mean
accepted tokens per step + 1), acceptance per draft source (spine, branch, memory, head), the share of tokens
drafted from the suffix memory, milliseconds of drafting and of the forward per step, and tokens per second, per
method.

Tables compare methods on the same prompts: only questions that every method has answered count (a
partial or interrupted run reports how many were left out). Ratios are of sums (tokens / seconds,
tokens / forwards), not means of per-prompt ratios. A metric a method cannot observe is None.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .. import cachefs
from ..errors import GooseError
from . import store

SOURCES = ("spine", "branch", "memory", "head")  # memory: the suffix memory of earlier requests (goose@MODE rows)
ALL = "all"


def _sum(stats: list[dict], key: str):
    vals = [s.get(key) for s in stats]
    return None if any(v is None for v in vals) else sum(vals)


def _ratio(a, b):
    return a / b if a is not None and b else None


def aggregate(rows: list[dict]) -> dict:
    """The metrics of one method over some questions (all their turns)."""
    st = [s for r in rows for s in r["stats"]]
    tokens, secs, fwd = _sum(st, "new_tokens") or 0, _sum(st, "wall_time_s") or 0.0, _sum(st, "forward_calls")
    accepts = None if any(s.get("accept_lengths") is None for s in st) else [a for s in st for a in s["accept_lengths"]]
    m = {"questions": len(rows), "turns": len(st), "new_tokens": tokens, "wall_time_s": secs,
         "tokens_per_s": _ratio(tokens, secs), "forward_calls": fwd, "tau": _ratio(tokens, fwd),
         "mat": 1.0 + sum(accepts) / len(accepts) if accepts else (1.0 if accepts == [] else None),
         "lossless": sum(ok is True for r in rows for ok in r["lossless"]),
         "checked": sum(ok is not None for r in rows for ok in r["lossless"])}
    steps = len(accepts) if accepts is not None else None
    observed = all(s.get("drafted") is not None for s in st)
    for src in SOURCES:  # rows recorded before the memory existed have no "memory" entry: none drafted
        d = sum(s["drafted"].get(src, 0) for s in st) if observed else None
        a = sum(s["accepted"].get(src, 0) for s in st) if observed else None
        m[f"drafted_{src}"], m[f"accepted_{src}"], m[f"acceptance_rate_{src}"] = d, a, _ratio(a, d)
    m["memory_token_share"] = _ratio(m["accepted_memory"], tokens)  # tokens that were drafted from the memory
    m["heterogeneity"] = _ratio(m["acceptance_rate_spine"], m["acceptance_rate_branch"])
    cont, cont_tok = _sum(st, "spine_continuations"), _sum(st, "spine_continuation_tokens")
    m["spine_continuation_share"] = _ratio(cont, steps)
    m["spine_continuation_token_share"] = _ratio(cont_tok, tokens)
    stage = None if any(s.get("stage_ms") is None for s in st) else \
        {k: sum(s["stage_ms"].get(k, 0.0) for s in st) for k in ("draft", "forward")}
    m["draft_ms_per_step"] = _ratio(stage["draft"], steps) if stage else None  # drafting a step's tree
    m["forward_ms_per_step"] = _ratio(stage["forward"], steps) if stage else None
    sizes = None if any(s.get("tree_sizes") is None for s in st) else [n for s in st for n in s["tree_sizes"]]
    m["mean_tree_size"] = sum(sizes) / len(sizes) if sizes else None
    return m


def detail(rows: list[dict]) -> dict:
    """Per-method distributions for the plots: tokens per step, verified tree sizes, acceptance by depth."""
    st = [s for r in rows for s in r["stats"]]
    hist = Counter(a + 1 for s in st for a in (s.get("accept_lengths") or []))
    sizes = Counter(n for s in st for n in (s.get("tree_sizes") or []))
    depth = {}
    for src in SOURCES:
        drafted, accepted = [], []
        for s in st:
            if s.get("depth_drafted") is None or src not in s["depth_drafted"]:
                continue
            for i, (d, a) in enumerate(zip(s["depth_drafted"][src], s["depth_accepted"][src])):
                while len(drafted) <= i:
                    drafted.append(0)
                    accepted.append(0)
                drafted[i] += d
                accepted[i] += a
        depth[src] = {"drafted": drafted, "accepted": accepted}
    return {"tokens_per_step_hist": {str(k): hist[k] for k in sorted(hist)},
            "tree_size_hist": {str(k): sizes[k] for k in sorted(sizes)}, "depth": depth}


def summarize(out: Path) -> dict:
    meta = store.read_meta(out)
    if meta is None:
        raise GooseError(f"{out} is not a goose bench directory (no run.json)")
    by_method = {m: rows for m, rows in store.load_all(out).items() if rows}
    if not by_method:
        raise GooseError(f"{out} holds no answers yet")
    named = meta.get("methods", [])
    order = [m for m in named if m in by_method] + sorted(set(by_method) - set(named))
    ids = [{r["question_id"] for r in by_method[m]} for m in order]
    common = set.intersection(*ids)
    categories: list[str] = []
    for r in by_method[order[0]]:
        if r["question_id"] in common and r["category"] not in categories:
            categories.append(r["category"])
    table, details, mismatches = {}, {}, []
    for m in order:
        rows = [r for r in by_method[m] if r["question_id"] in common]
        table[m] = {c: aggregate([r for r in rows if r["category"] == c]) for c in categories}
        table[m][ALL] = aggregate(rows)
        details[m] = detail(rows)
        for r in rows:
            for t, mm in enumerate(r.get("mismatches") or []):
                if mm is not None:
                    mismatches.append({"method": m, "question_id": r["question_id"], "turn": t, **mm})
    for m in order:
        for c, cell in table[m].items():
            for ref, key in (("ar", "speedup_vs_ar"), ("hf-ar", "speedup_vs_hf_ar")):
                base = table.get(ref, {}).get(c, {}).get("tokens_per_s")
                cell[key] = _ratio(cell["tokens_per_s"], base)
    return {"meta": meta, "methods": order, "categories": categories + [ALL], "questions": len(common),
            "left_out": {m: len(i - common) for m, i in zip(order, ids) if i - common},
            "table": table, "detail": details, "mismatches": mismatches}


def write_summary(out: Path, summary: dict) -> Path:
    path = out / "summary.json"
    cachefs.write_text(path, json.dumps(summary, indent=2) + "\n")
    return path
