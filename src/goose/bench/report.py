"""`report.md` from a summary: run metadata, the overall table, per-category tables, mismatches, plots."""

from __future__ import annotations

from pathlib import Path

from .summary import ALL

# (header, summary key, format) of the overall table
COLUMNS = (
    ("tokens/s", "tokens_per_s", "{:.1f}"), ("speedup vs ar", "speedup_vs_ar", "{:.2f}x"),
    ("speedup vs hf-ar", "speedup_vs_hf_ar", "{:.2f}x"), ("τ", "tau", "{:.2f}"), ("MAT", "mat", "{:.2f}"),
    ("acc. spine", "acceptance_rate_spine", "{:.1%}"), ("acc. branch", "acceptance_rate_branch", "{:.1%}"),
    ("spine/branch", "heterogeneity", "{:.1f}x"), ("spine cont.", "spine_continuation_share", "{:.1%}"),
    ("tree size", "mean_tree_size", "{:.1f}"), ("draft ms/step", "draft_ms_per_step", "{:.2f}"),
    ("forward ms/step", "forward_ms_per_step", "{:.2f}"),
)
# shown when a method drafted from a draft head (eagle2, goose with a head)
HEAD_COLUMNS = (("acc. head", "acceptance_rate_head", "{:.1%}"),)
# shown when the run has memory variants (goose@cold, goose@earlier, goose@warm)
MEMORY_COLUMNS = (("acc. memory", "acceptance_rate_memory", "{:.1%}"), ("from memory", "memory_token_share", "{:.1%}"))
PER_CATEGORY = (("Speedup vs ar", "speedup_vs_ar", "{:.2f}x"), ("Speedup vs hf-ar", "speedup_vs_hf_ar", "{:.2f}x"),
                ("τ (tokens per forward)", "tau", "{:.2f}"), ("Tokens/s", "tokens_per_s", "{:.1f}"))


def fmt(value, spec: str) -> str:
    return "–" if value is None else spec.format(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _heads(summary: dict) -> bool:
    return any(summary["table"][m][ALL].get("drafted_head") for m in summary["methods"])


def overall_table(summary: dict) -> list[str]:
    cols = COLUMNS + (MEMORY_COLUMNS if memory_groups(summary) else ()) + (HEAD_COLUMNS if _heads(summary) else ())
    rows = []
    for m in summary["methods"]:
        cell = summary["table"][m][ALL]
        rows.append([m] + [fmt(cell.get(k), f) for _, k, f in cols] + [_lossless(cell)])
    return _table(["method"] + [h for h, _, _ in cols] + ["lossless"], rows)


def memory_groups(summary: dict) -> dict[str, list[str]]:
    """{base method: [base (if run), its memory variants]} for every method run with a memory variant."""
    groups: dict[str, list[str]] = {}
    for m in summary["methods"]:
        base, sep, _ = m.partition("@")
        if sep:
            groups.setdefault(base, [base] if base in summary["methods"] else []).append(m)
    return groups


def memory_tables(summary: dict) -> list[str]:
    """Per base method, per category: τ, speedup vs ar and the share of tokens drafted from the memory,
    without memory and in each memory mode, side by side."""
    out = []
    for base, group in memory_groups(summary).items():
        header = (["category"] + [f"τ {m}" for m in group] + [f"vs ar {m}" for m in group]
                  + [f"from memory {m}" for m in group if "@" in m])
        rows = []
        for c in summary["categories"]:
            cells = [summary["table"][m][c] for m in group]
            rows.append([c] + [fmt(x["tau"], "{:.2f}") for x in cells]
                        + [fmt(x["speedup_vs_ar"], "{:.2f}x") for x in cells]
                        + [fmt(x.get("memory_token_share"), "{:.1%}") for m, x in zip(group, cells) if "@" in m])
        out += ([""] if out else []) + _table(header, rows)
    return out


def _lossless(cell: dict) -> str:
    checked = cell.get("checked", cell["turns"])
    return f"{cell['lossless']}/{checked}" if checked else "n/a"


def _decoding(meta: dict) -> str:
    s = meta.get("sampling")
    if not s:
        return "greedy"
    parts = [f"temperature {s['temperature']}"]
    parts += [f"{k.replace('_', '-')} {s[k]}" for k in ("top_k", "top_p") if s.get(k)]
    return "sampling (" + ", ".join(parts) + f", seed {s.get('seed')} per request)"


def category_table(summary: dict, key: str, spec: str) -> list[str]:
    cats = summary["categories"]
    rows = [[m] + [fmt(summary["table"][m][c][key], spec) for c in cats] for m in summary["methods"]]
    return _table(["method"] + cats, rows)


def settings_lines(settings: dict, methods: list[str]) -> list[str]:
    """One line per configured baseline in the run: its configuration, and REST's datastore."""
    out = []
    for m in methods:
        cfg = dict(settings.get(m) or {})
        if not cfg:
            continue
        st = cfg.pop("store", None)
        line = f"- {m}: " + ", ".join(f"{k}={v}" for k, v in cfg.items())
        if st:
            sources = ", ".join(f"{k} ({v} docs)" for k, v in (st.get("sources") or {}).items())
            line += (f"; datastore `{st.get('name')}` ({sources}; {st.get('tokens'):,} tokens, "
                     f"{(st.get('bytes') or 0) / 2**20:.0f} MiB, tokenizer of {st.get('model')})")
        out.append(line)
    return out


def render(summary: dict, plots: list[Path]) -> str:
    meta = summary["meta"]
    v = meta.get("versions", {})
    out = ["# goose bench report", "",
           f"- model: `{meta.get('model')}` ({meta.get('weights') or meta.get('dtype')} weights, "
           f"arith {meta.get('arith', 'exact')}, {meta.get('device')}, {meta.get('threads')} threads, "
           f"{meta.get('processor')})",
           f"- dataset: `{meta.get('dataset')}`; {summary['questions']} questions answered by every method; "
           f"max_new_tokens {meta.get('max_new_tokens')}; {'chat template' if meta.get('chat') else 'raw prompts'}; "
           f"{_decoding(meta)}, batch 1; repeats {meta.get('repeats', 1)} (median)",
           f"- versions: goose {(meta.get('software') or {}).get('goose') or v.get('goose')}, torch {v.get('torch')}, "
           f"transformers {v.get('transformers')}, python {v.get('python')}; commit "
           + ", ".join(f"`{c}`" for c in (meta.get("git_commits") or [meta.get("git_commit")]))]
    out += [f"- command: `{c}`" for c in meta.get("commands", [])]
    out += settings_lines(meta.get("method_settings") or {}, summary["methods"])
    if summary.get("left_out"):
        out.append("- left out (not answered by every method yet): "
                   + ", ".join(f"{m} {n}" for m, n in summary["left_out"].items()))
    out += ["", "Speedups are tokens/s ratios on the same prompts in the same run; τ = tokens per target forward "
            "(prefill included); MAT = accepted per decoding step + 1; acceptance = accepted / drafted nodes per "
            "source; lossless = turns token-identical to `ar` (when sampling: with the same seed; hf-* sampling draws "
            "other random numbers, so it is not compared; nor is hf-* beside goose's int8 arithmetic: it runs "
            "float32).", "", "## All categories", ""]
    out += overall_table(summary)
    for title, key, spec in PER_CATEGORY:
        out += ["", f"## {title} by category", ""] + category_table(summary, key, spec)
    if memory_groups(summary):
        out += ["", "## Suffix memory: cold and warm by category", "",
                "The memory variants start every session with the memory empty (`@cold`), holding the run's "
                "earlier sessions (`@earlier`) or every other session (`@warm`), each turn's prompt and answer; "
                "the session's own turns are added as they finish. \"from memory\" = tokens drafted from the "
                "memory and accepted, over all generated tokens.", ""]
        out += memory_tables(summary)
    out += ["", "## Lossless (identical turns) by category", ""]
    cats = summary["categories"]
    out += _table(["method"] + cats, [[m] + [_lossless(summary["table"][m][c]) for c in cats]
                                      for m in summary["methods"]])
    if summary["mismatches"]:
        out += ["", "## Mismatches against ar", "",
                "A small logit gap at the first differing position is a near-tie (floating-point order); "
                "a large one is a bug.", ""]
        rows = [[x["method"], str(x["question_id"]), str(x["turn"]), str(x["position"]),
                 str(x.get("ar_token")), str(x.get("token")),
                 fmt(x.get("ar_logit"), "{:.4f}"), fmt(x.get("logit"), "{:.4f}"),
                 "context differs" if x.get("context_differs") else ""] for x in summary["mismatches"]]
        header = ["method", "question", "turn", "position", "ar token", "token", "ar logit", "logit", "note"]
        out += _table(header, rows)
    if plots:
        out += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(out) + "\n"


def console_table(summary: dict) -> str:
    """The tables a terminal user wants first: overall, then speedup vs ar by category."""
    lines = overall_table(summary) + ["", "speedup vs ar by category:"]
    lines += category_table(summary, "speedup_vs_ar", "{:.2f}x")
    if memory_groups(summary):
        lines += ["", "suffix memory by category (τ, speedup vs ar, share of tokens drafted from memory):"]
        lines += memory_tables(summary)
    return "\n".join(lines)
