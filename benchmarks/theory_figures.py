"""Regenerate the figures in docs/figures/ and the numbers quoted in docs/theory.md.

    .venv/bin/python benchmarks/theory_figures.py [--out docs/figures]

Pure model computation (goose.theory), no model weights; runs in a few seconds. The tables printed
on stdout are the ones pasted into docs/theory.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from goose.theory import (  # noqa: E402
    CPU_COST_MS,
    SPINE,
    TwoSourceModel,
    best_isotropic,
    best_size,
    expected_accepted,
    goose_tree,
    optimal_tree,
    optimal_values,
)

RATIOS = [1, 1.5, 2, 3, 4, 6, 8, 12, 18]
BUDGETS = [4, 8, 16, 32, 60, 100]


def iso_best(budget: int, model: TwoSourceModel) -> float:
    """Best k-ary BFS tree over either candidate set (same sources, or adjacency only)."""
    return max(best_isotropic(budget, model)[0], best_isotropic(budget, model, "branch")[0])


def goose_values(max_budget: int, model: TwoSourceModel, confidence: float) -> np.ndarray:
    vals = np.zeros(max_budget + 1)
    for n in range(1, max_budget + 1):
        vals[n] = expected_accepted(goose_tree(n, model, confidence))
    return vals


def fig_gain(out: Path, p_t: float) -> None:
    """(a) gain of the optimum over the best isotropic tree, by p_s/p_t and B."""
    ratios = [r for r in RATIOS if r * p_t <= 0.95]
    shape = np.zeros((len(ratios), len(BUDGETS)))
    paper = np.zeros_like(shape)
    for i, r in enumerate(ratios):
        m = TwoSourceModel(r * p_t, p_t)
        opt = optimal_values(max(BUDGETS), m)
        for j, b in enumerate(BUDGETS):
            shape[i, j] = 100 * (opt[b] / iso_best(b, m) - 1)
            paper[i, j] = 100 * (opt[b] / best_isotropic(b, m, "branch")[0] - 1)
    print(f"\n(a) gain of the optimum over the best isotropic tree, p_t = {p_t} (%)")
    print("| p_s/p_t | p_s | " + " | ".join(f"B={b}" for b in BUDGETS) + " |")
    print("|---" * (len(BUDGETS) + 2) + "|")
    for i, r in enumerate(ratios):
        cells = " | ".join(f"{shape[i, j]:.1f} ({paper[i, j]:.0f})" for j in range(len(BUDGETS)))
        print(f"| {r} | {r * p_t:.3f} | {cells} |")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, data, title in [(axes[0], shape, "vs best isotropic tree, same sources (shape only)"),
                            (axes[1], paper, "vs best adjacency-only isotropic tree (paper's control)")]:
        im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis")
        ax.set_xticks(range(len(BUDGETS)), [str(b) for b in BUDGETS])
        ax.set_yticks(range(len(ratios)), [str(r) for r in ratios])
        ax.set_xlabel("budget B (nodes incl. root)")
        ax.set_ylabel("p_s / p_t")
        ax.set_title(title, fontsize=10)
        for i in range(len(ratios)):
            for j in range(len(BUDGETS)):
                ax.text(j, i, f"{data[i, j]:.0f}" if data[i, j] >= 10 else f"{data[i, j]:.1f}",
                        ha="center", va="center", fontsize=7, color="w" if data[i, j] < data.max() / 2 else "k")
        fig.colorbar(im, ax=ax, label="gain of optimum (%)")
    fig.suptitle(f"Optimal (anisotropic) tree vs isotropic k-ary trees, p_t = {p_t} per rank")
    fig.tight_layout()
    fig.savefig(out / f"theory_gain_pt{int(p_t * 100):02d}.png", dpi=120)
    plt.close(fig)


def anisotropy_threshold(p_t: float) -> None:
    """Smallest B from which the optimum strictly beats every isotropic tree (and stays ahead)."""
    print(f"\n(a) anisotropy threshold, p_t = {p_t}: smallest B* with optimum > best isotropic for all B* <= B <= 128")
    ratios = [r for r in RATIOS if r * p_t <= 0.95]
    print("| p_s/p_t | " + " | ".join(str(r) for r in ratios) + " |")
    print("|---" * (len(ratios) + 1) + "|")
    row, shape = [], []
    for r in ratios:
        m = TwoSourceModel(r * p_t, p_t)
        opt = optimal_values(128, m)
        strict = [opt[b] > iso_best(b, m) * (1 + 1e-9) for b in range(2, 129)]
        b_star = next((b for b in range(2, 129) if all(strict[b - 2:])), None)
        row.append(str(b_star))
        opt60 = optimal_tree(60, m)
        shape.append(f"k={best_isotropic(60, m)[1]}; {max(opt60.depths)}x{opt60.width()}")
    print("| B* | " + " | ".join(row) + " |")
    print("| B=60: best iso k; optimum depth x width | " + " | ".join(shape) + " |")


def fig_trees(out: Path) -> None:
    """Draw the optimal tree and the best isotropic tree for one setting."""
    m, b = TwoSourceModel(0.6, 0.05), 32
    opt = optimal_tree(b, m)
    _, k, iso = best_isotropic(b, m)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, t, title in [(axes[0], opt, f"optimal, E={expected_accepted(opt):.2f}"),
                         (axes[1], iso, f"best isotropic (k={k}), E={expected_accepted(iso):.2f}")]:
        order, stack = [], [0]  # nodes stacked vertically in DFS order, spine child first
        kids = {v: [c for c in range(len(t)) if t.parents[c] == v] for v in range(len(t))}
        while stack:
            v = stack.pop()
            order.append(v)
            stack.extend(sorted(kids[v], key=lambda c: t.kinds[c] == SPINE))
        y = {v: -i for i, v in enumerate(order)}
        for v in range(1, len(t)):
            u = t.parents[v]
            ax.plot([t.depths[u], t.depths[v]], [y[u], y[v]], color="0.6", lw=0.8)
        for v in range(len(t)):
            ax.scatter(t.depths[v], y[v], s=25, color="tab:red" if t.kinds[v] == SPINE else
                       ("k" if v == 0 else "tab:blue"), zorder=3)
        ax.set_title(title)
        ax.set_xlabel("depth")
        ax.set_yticks([])
    fig.suptitle(f"p_s=0.6, p_t=0.05, B={b}  (red: spine, blue: adjacency branch)")
    fig.tight_layout()
    fig.savefig(out / "theory_trees.png", dpi=120)
    plt.close(fig)


def fig_single_sources(out: Path) -> None:
    """(b)/(c) GOOSE spine tree vs spine-only and branch-only at equal budget."""
    p_s_grid = np.round(np.arange(0.05, 0.96, 0.05), 2)
    p_t_grid = [0.02, 0.05, 0.1, 0.2, 0.3]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (conf, b) in zip(axes, [(0.0, 60), (0.7, 60), (0.0, 16)]):
        data = np.zeros((len(p_t_grid), len(p_s_grid)))
        for i, p_t in enumerate(p_t_grid):
            for j, p_s in enumerate(p_s_grid):
                m = TwoSourceModel(float(p_s), p_t)
                g = expected_accepted(goose_tree(b, m, conf))
                single = max(optimal_values(b, m, "spine")[b], optimal_values(b, m, "branch")[b])
                data[i, j] = 100 * (g / single - 1)
            ok = [float(x) for x in p_s_grid[data[i] >= -1e-9]]
            print(f"(b) B={b}, c={conf}, p_t={p_t}: GOOSE >= both single sources for p_s in {ok}; "
                  f"worst {data[i].min():.1f}% at p_s={p_s_grid[data[i].argmin()]}")
        lim = np.abs(data).max()
        im = ax.imshow(data, aspect="auto", origin="lower", cmap="RdBu", vmin=-lim, vmax=lim)
        ax.contour(data, levels=[0], colors="k", linewidths=1)
        ax.set_xticks(range(0, len(p_s_grid), 2), [f"{x:.2f}" for x in p_s_grid[::2]], rotation=45)
        ax.set_yticks(range(len(p_t_grid)), [str(x) for x in p_t_grid])
        ax.set_xlabel("p_s")
        ax.set_ylabel("p_t (per rank)")
        ax.set_title(f"B={b}, confidence c={conf}", fontsize=10)
        fig.colorbar(im, ax=ax, label="GOOSE vs best single source (%)")
    fig.suptitle("GOOSE spine tree (spec shape, self-consistent EMA) vs max(spine-only, branch-only); "
                 "blue = GOOSE ahead")
    fig.tight_layout()
    fig.savefig(out / "theory_goose_vs_single.png", dpi=120)
    plt.close(fig)


def single_source_table() -> None:
    print("\n(b)/(c) E[accepted] at equal budget: GOOSE (c=0 / c=0.7 / c=1) | optimum | spine-only | "
          "branch-only | best iso (same sources / adjacency)")
    print("| p_s | p_t | B | GOOSE c=0 | c=0.7 | c=1 | optimum | spine-only | branch-only | iso | iso-adj |")
    print("|---" * 11 + "|")
    for p_s, p_t in [(0.9, 0.05), (0.8, 0.1), (0.6, 0.1), (0.6, 0.05), (0.4, 0.05), (0.3, 0.05), (0.3, 0.1),
                     (0.2, 0.05), (0.1, 0.1), (0.05, 0.2)]:
        m = TwoSourceModel(p_s, p_t)
        for b in (4, 16, 60):
            g = [expected_accepted(goose_tree(b, m, c)) for c in (0.0, 0.7, 1.0)]
            vals = [optimal_values(b, m, s)[b] for s in ("both", "spine", "branch")]
            iso = [best_isotropic(b, m)[0], best_isotropic(b, m, "branch")[0]]
            single = max(vals[1:])
            cells = [f"**{x:.2f}**" if x < single - 1e-9 else f"{x:.2f}" for x in g]
            print(f"| {p_s} | {p_t} | {b} | " + " | ".join(cells) + " | "
                  + " | ".join(f"{x:.2f}" for x in vals + iso) + " |")


def fig_budget_lines(out: Path) -> None:
    cases = [(0.8, 0.05), (0.6, 0.1), (0.3, 0.1)]
    budgets = np.arange(1, 129)
    fig, axes = plt.subplots(1, len(cases), figsize=(15, 4.2))
    for ax, (p_s, p_t) in zip(axes, cases):
        m = TwoSourceModel(p_s, p_t)
        ax.plot(budgets, optimal_values(128, m)[1:], label="optimum", lw=2)
        ax.plot(budgets, goose_values(128, m, 0.0)[1:], label="GOOSE spine tree (c=0)")
        ax.plot(budgets, goose_values(128, m, 0.7)[1:], label="GOOSE spine tree (c=0.7)", ls="--")
        ax.plot(budgets, optimal_values(128, m, "spine")[1:], label="spine only")
        ax.plot(budgets, optimal_values(128, m, "branch")[1:], label="branch only")
        ax.plot(budgets, [iso_best(int(b), m) for b in budgets], label="best isotropic", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"p_s={p_s}, p_t={p_t}")
        ax.set_xlabel("budget B (nodes incl. root)")
        ax.set_ylabel("E[accepted tokens]")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "theory_budget_lines.png", dpi=120)
    plt.close(fig)


def fig_device(out: Path) -> None:
    """Tokens per second (E[accepted] + 1) / cost(n) on the CPU cost curve."""
    cases = [(0.9, 0.05), (0.8, 0.1), (0.6, 0.1), (0.4, 0.05), (0.2, 0.05), (0.05, 0.1)]
    print("\n(d) device-aware size on the CPU curve (tokens/s = (E+1)/cost(n); AR = 17.2 tok/s)")
    print("| p_s | p_t | best n (optimum) | E | tok/s | x AR | optimum at n=60: tok/s | "
          "best n (GOOSE c=0) | tok/s | GOOSE at B=60: tok/s |")
    print("|---" * 10 + "|")
    fig, ax = plt.subplots(figsize=(8, 5))
    ns = np.arange(1, 129)
    for p_s, p_t in cases:
        m = TwoSourceModel(p_s, p_t)
        vals = optimal_values(128, m)
        n, rate = best_size(vals, CPU_COST_MS)
        gn, grate = best_size(goose_values(128, m, 0.0), CPU_COST_MS)
        ar = rate[1]
        print(f"| {p_s} | {p_t} | {n} | {vals[n]:.2f} | {1000 * rate[n]:.1f} | {rate[n] / ar:.2f} | "
              f"{1000 * rate[60]:.1f} | {gn} | {1000 * grate[gn]:.1f} | {1000 * grate[60]:.1f} |")
        line, = ax.plot(ns, 1000 * rate[1:], label=f"p_s={p_s}, p_t={p_t}")
        ax.plot(ns, 1000 * grate[1:], ls=":", color=line.get_color())
        ax.scatter([n], [1000 * rate[n]], color=line.get_color(), zorder=3)
    ax.axvline(60, color="k", ls="--", lw=0.8)
    ax.text(61, ax.get_ylim()[1] * 0.95, "paper B=60", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size n (query tokens per forward)")
    ax.set_ylabel("expected tokens / s")
    ax.set_title("SmolLM2-135M on the 2-core CPU: solid = optimal tree, dotted = GOOSE spine tree (c=0)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "theory_device_sizing.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "figures"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for p_t in (0.05, 0.1):
        fig_gain(out, p_t)
        anisotropy_threshold(p_t)
    fig_trees(out)
    single_source_table()
    fig_single_sources(out)
    fig_budget_lines(out)
    fig_device(out)
    print(f"\nfigures written to {out}")


if __name__ == "__main__":
    main()
