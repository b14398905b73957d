"""The figure of ``fedkernels compare``, sized for a paper (3.5 in wide, text of at least 9 pt;
PNG and PDF, :mod:`fedkernels.sim.plots`).

Top: the pooled test accuracy per round of each method, the mean over its seeds with a band of
± one standard deviation. Below: per method, the worst-10%, average and best-10% client
accuracy (mean over seeds, ± std as error bars), as points on an axis scaled to the data;
points rather than bars, because bars would have to start at zero to be read honestly. The
same for the client AUROC when the methods have one. Each method keeps one colour, line style
and marker throughout (:func:`~fedkernels.sim.plots.series_style`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from fedkernels.sim.plots import (
    COLUMN_WIDTH_IN,
    paper_style,
    save_figure,
    series_style,
    wrap_title,
)

from .compare_tables import has_auroc

LABEL_CHARS = 24  # a method's label on the points' axis, per line
LEGEND_CHARS = 17  # the longest label two legend columns hold across the width
# the three statistics of the point panels: key suffix, legend label, marker
TAILS = [("worst10", "worst-10%", "v"), ("mean", "average", "o"), ("best10", "best-10%", "^")]


def _curve(entry: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds, mean and std over seeds of a method's accuracy curve (the rounds every seed
    evaluated)."""
    curves = [dict(run["curve"]) for run in entry["runs"] if run.get("curve")]
    if not curves:
        return np.array([]), np.array([]), np.array([])
    rounds = sorted(set.intersection(*(set(c) for c in curves)))
    values = np.array([[c[r] for r in rounds] for c in curves], dtype=np.float64)
    return np.array(rounds), values.mean(0), values.std(0)


def _points(ax, entries: list[dict[str, Any]], metric: str, xlabel: str) -> None:
    """Worst-10%, average and best-10% of ``metric`` per method, one row each."""
    rows = np.arange(len(entries))[::-1]  # the first method on top
    offsets = {"worst10": 0.18, "mean": 0.0, "best10": -0.18}
    shown: list[float] = []
    for i, (entry, row) in enumerate(zip(entries, rows)):
        color = series_style(i)["color"]
        for suffix, _, marker in TAILS:
            mean = entry["mean"].get(f"{metric}_{suffix}")
            std = entry["std"].get(f"{metric}_{suffix}") or 0.0
            if mean is None:
                continue
            ax.errorbar(100 * mean, row + offsets[suffix], xerr=100 * std, fmt=marker,
                        color=color, markersize=4, elinewidth=0.8, capsize=1.5)
            shown += [100 * (mean - std), 100 * (mean + std)]
    labels = [textwrap.fill(e["label"], LABEL_CHARS) for e in entries]
    ax.set_yticks(rows, labels)
    ax.set_ylim(-0.6, len(entries) - 0.4)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", linewidth=0.4, alpha=0.5)
    if shown:
        lo, hi = min(shown), max(shown)
        pad = max(1.0, 0.06 * (hi - lo))
        # past 100 by the margin, so that a point at 100 is drawn whole
        ax.set_xlim(max(0.0, lo - pad), hi + pad)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=marker, linestyle="none", color="0.25", markersize=4)
               for _, _, marker in TAILS]
    # the statistics' key, above the panel (centred on it, not on the axes beside the labels)
    ax.figure.legend(handles, [label for _, label, _ in TAILS], loc="outside upper center",
                     ncol=3, handletextpad=0.2, columnspacing=1.0)


def plot(entries: list[dict[str, Any]], path: Path, title: str):
    """The comparison figure (see the module docstring) into ``path`` and the PDF beside it.
    Returns the (closed) figure: ``axes[0]`` client accuracy, ``axes[1]`` the curves,
    ``axes[2]`` client AUROC when there is one."""
    auroc = has_auroc(entries)
    rows_height = 0.34 * len(entries) + 0.75
    heights = [2.3, rows_height] + ([rows_height] if auroc else [])
    # two legend columns while the labels are short enough to stay within the width
    columns = 2 if entries and max(len(e["label"]) for e in entries) <= LEGEND_CHARS else 1
    heights[0] += 0.2 * -(-len(entries) // columns)  # the legend's rows under the curves
    with paper_style() as plt:
        fig = plt.figure(figsize=(COLUMN_WIDTH_IN, sum(heights) + 0.5), layout="constrained")
        # panels of their own layout: the methods' labels beside the points do not narrow the
        # curves above them
        panels = fig.subfigures(len(heights), 1, height_ratios=heights)
        points = panels[1].add_subplot()  # created first: axes[0], as before
        curves = panels[0].add_subplot()
        _points(points, entries, "client_accuracy", "client test accuracy (%)")
        if auroc:
            _points(panels[2].add_subplot(), entries, "client_auroc", "client test AUROC (%)")
        shown: list[float] = []
        for i, entry in enumerate(entries):
            rounds, mean, std = _curve(entry)
            if not len(rounds):
                continue
            look = series_style(i)
            curves.plot(rounds, 100 * mean, label=entry["label"],
                        markevery=max(1, len(rounds) // 8), **look)
            if len(entry["runs"]) > 1:  # a band over the seeds
                curves.fill_between(rounds, 100 * (mean - std), 100 * (mean + std),
                                    color=look["color"], alpha=0.15, linewidth=0)
            # the axis follows the curves once past the first rounds' climb
            tail = slice(len(rounds) // 5, None) if len(rounds) >= 10 else slice(None)
            shown += list(100 * (mean - std)[tail]) + list(100 * (mean + std)[tail])
        from matplotlib.ticker import MaxNLocator

        curves.xaxis.set_major_locator(MaxNLocator(integer=True))
        curves.set(xlabel="round", ylabel="pooled test accuracy (%)")
        curves.grid(linewidth=0.4, alpha=0.5)
        if shown:
            lo, hi = min(shown), max(shown)
            pad = max(0.5, 0.08 * (hi - lo))
            curves.set_ylim(max(0.0, lo - pad), min(100.0, hi + pad))
        if entries:
            curves.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=columns,
                          handlelength=2.6, columnspacing=1.0)
        if title:
            fig.suptitle(wrap_title(title))
        save_figure(fig, path)
    return fig
