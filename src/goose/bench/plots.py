"""PNG plots of a summary (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from .. import cachefs  # noqa: E402
from .summary import ALL  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = cachefs.temp_path(path)
    try:
        fig.savefig(tmp, dpi=100, format="png")  # then renamed: a killed run never leaves a torn plot
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return path


def _grouped_bars(summary: dict, key: str, ylabel: str, path: Path, baseline: float | None = None) -> Path:
    methods, cats = summary["methods"], summary["categories"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cats) + 2), 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [summary["table"][m][c][key] for c in cats]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=m)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    return _save(fig, path)


def _small_multiples(n: int):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def accept_histogram(summary: dict, path: Path, key: str = "tokens_per_step_hist",
                     xlabel: str = "tokens per decoding step") -> Path:
    """One histogram panel per method of a per-step quantity (tokens per step, or verified tree size)."""
    methods = [m for m in summary["methods"] if summary["detail"][m].get(key)]
    fig, axes = _small_multiples(max(len(methods), 1))
    for ax, m in zip(axes, methods):
        hist = summary["detail"][m][key]
        ax.bar([int(k) for k in hist], list(hist.values()))
        ax.set_title(f"{m} (MAT {summary['table'][m][ALL]['mat'] or 0:.2f})", fontsize=9)
        ax.set_xlabel(xlabel)
    if not methods:
        axes[0].text(0.5, 0.5, "no per-step data", ha="center")
    return _save(fig, path)


def depth_acceptance(summary: dict, path: Path) -> Path:
    """Acceptance rate by tree depth, spine vs branch nodes, one panel per drafting method."""
    methods = [m for m in summary["methods"]
               if any(summary["detail"][m]["depth"][s]["drafted"] for s in ("spine", "branch"))]
    fig, axes = _small_multiples(max(len(methods), 1))
    for ax, m in zip(axes, methods):
        for src, style in (("spine", "o-"), ("branch", "s--")):
            d = summary["detail"][m]["depth"][src]
            pts = [(i + 1, a / n) for i, (n, a) in enumerate(zip(d["drafted"], d["accepted"])) if n]
            if pts:
                ax.plot(*zip(*pts), style, label=src, markersize=3)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("depth")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    if not methods:
        axes[0].text(0.5, 0.5, "no drafted nodes", ha="center")
    return _save(fig, path)


def write_plots(summary: dict, out: Path) -> list[Path]:
    return [
        _grouped_bars(summary, "speedup_vs_ar", "speedup vs ar (tokens/s ratio)", out / "speedup_by_category.png", 1.0),
        _grouped_bars(summary, "tau", "τ (tokens per forward)", out / "tau_by_category.png", 1.0),
        accept_histogram(summary, out / "accept_length_hist.png"),
        accept_histogram(summary, out / "tree_size_hist.png", "tree_size_hist", "nodes verified per step"),
        depth_acceptance(summary, out / "acceptance_by_depth.png"),
    ]
