"""The figures of a run, sized for a paper: learning curves and the distribution of per-client
accuracy.

Every figure is 3.5 in wide (one column of a two-column paper) with text of at least 9 pt at
that size, and is saved as PNG (300 dpi) and, beside it, as PDF (vector, for LaTeX). Titles say
what the run was, from its resolved configuration: the algorithm and its parameters, the server
optimizer, the model, the data and how it was split among the clients
(:func:`describe_method`, :func:`describe_setting`).
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_SERVER_LR

if TYPE_CHECKING:  # results imports torch, which drawing does not need
    from .results import RunResult

COLUMN_WIDTH_IN = 3.5  # one column of a two-column paper (IEEE, ACM, NeurIPS-style)
FONT_PT = 9  # the smallest text on a figure, at COLUMN_WIDTH_IN
DPI = 300
TITLE_CHARS = 52  # characters of a 9-pt title line that fit across COLUMN_WIDTH_IN

# Okabe and Ito's colour-blind-safe palette, then line styles and markers that change with it,
# so that methods stay apart in colour, in grey print, and for colour-blind readers
COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
          "#F0E442"]
# solid, dashed, dotted, dash-dot, long dash, dash-dot-dot, sparse dots, long dash-dot
LINE_STYLES: list[Any] = ["-", (0, (4, 1.5)), (0, (1, 1.2)), (0, (4, 1.5, 1, 1.5)), (0, (8, 2)),
                          (0, (4, 1.5, 1, 1.5, 1, 1.5)), (0, (1, 3)), (0, (8, 2, 1, 2))]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def series_style(index: int) -> dict[str, Any]:
    """Colour, line style and marker of the ``index``-th series: the first eight differ in
    each of the three, and no two of the first 64 share all three."""
    n = len(COLORS)
    return {"color": COLORS[index % n],
            "linestyle": LINE_STYLES[(index + index // n) % len(LINE_STYLES)],
            "marker": MARKERS[(index + 3 * (index // n)) % len(MARKERS)]}


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install 'fedkernels[sim]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def paper_style() -> Iterator[Any]:
    """matplotlib settings of these figures: every text at :data:`FONT_PT`, thin frames,
    embedded TrueType fonts in the PDF (journals refuse Type 3). Yields pyplot."""
    plt = _pyplot()
    settings = {
        "font.size": FONT_PT, "axes.titlesize": FONT_PT, "axes.labelsize": FONT_PT,
        "xtick.labelsize": FONT_PT, "ytick.labelsize": FONT_PT, "legend.fontsize": FONT_PT,
        "figure.titlesize": FONT_PT, "legend.title_fontsize": FONT_PT,
        "axes.linewidth": 0.6, "lines.linewidth": 1.2, "lines.markersize": 3.5,
        "xtick.major.width": 0.6, "ytick.major.width": 0.6, "legend.frameon": False,
        "axes.spines.top": False, "axes.spines.right": False,
        "pdf.fonttype": 42, "ps.fonttype": 42, "savefig.bbox": "tight",
        "savefig.pad_inches": 0.02,
    }
    with plt.rc_context(settings):
        yield plt


def _integer_rounds(*axes) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_method(config: Mapping[str, Any]) -> str:
    """The algorithm with its parameters and the server optimizer, in words:
    ``fedprox (mu=0.01), server fedadam (lr 0.1)``; plain SGD with lr 1 is not named."""
    words = str(config.get("algorithm", "?"))
    params = config.get("algorithm_params") or {}
    shown = [f"{k}={_number(v)}" for k, v in params.items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool)][:3]
    if shown:
        words += f" ({', '.join(shown)})"
    server = config.get("server") or {}
    optimizer = server.get("optimizer", "sgd")
    lr = server.get("lr")
    if lr is None:
        lr = DEFAULT_SERVER_LR.get(optimizer)
    if optimizer != "sgd" or lr not in (None, 1, 1.0):
        words += f", server {optimizer}" + ("" if lr is None else f" (lr {_number(lr)})")
    return words


def describe_setting(config: Mapping[str, Any], dataset: str | None = None,
                     clients: int | None = None) -> dict[str, str]:
    """The experiment's setting, aspect by aspect (``model``: ``cnn on digits``, ``split``:
    ``dirichlet (α=0.3) split``, ``clients``, ``participation``, ``rounds``); a comparison's
    title keeps the aspects all its runs share."""
    model = config.get("model") or {}
    data = config.get("data") or {}
    partition = config.get("partition") or {}
    participation = config.get("participation") or {}
    kind = partition.get("kind", "iid")
    split = {"dirichlet": f"dirichlet (α={_number(partition.get('alpha', 0.5))})",
             "pathological": f"pathological ({partition.get('classes_per_client', 2)} classes "
                             "per client)"}.get(kind, kind)
    who = participation.get("kind", "full")
    if who != "full" and "fraction" in participation:
        who += f" ({_number(participation['fraction'])})"
    count = clients if clients is not None else partition.get("num_clients")
    return {
        "model": f"{model.get('name', '?')} on {dataset or data.get('name', '?')}",
        "split": f"{split} split",
        "clients": f"{count} clients" if count is not None else "",
        "participation": f"{who} participation",
        "rounds": f"{config['rounds']} rounds" if "rounds" in config else "",
    }


def wrap_title(text: str) -> str:
    """``text`` broken into lines that fit the figure's width at :data:`FONT_PT`."""
    return textwrap.fill(text, width=TITLE_CHARS)


def run_title(result: RunResult) -> str:
    setting = describe_setting(result.config, result.dataset, len(result.clients))
    return wrap_title(f"{describe_method(result.config)}; "
                      + ", ".join(v for v in setting.values() if v))


def save_figure(fig, path: str | Path) -> Path:
    """``fig`` as ``path`` (PNG at :data:`DPI`) and as the PDF beside it; closes it."""
    path = Path(path)
    with paper_style() as plt:  # some settings (fonts of the PDF, the bounding box) act now
        fig.savefig(path, dpi=DPI)
        fig.savefig(path.with_suffix(".pdf"))
        plt.close(fig)
    return path


def _same_curve(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(u - v) <= 1e-9 for u, v in zip(a, b))


# name -> the series' style index (so a name keeps its look from panel to panel)
_SERIES = {"global test": 0, "client mean": 1, "client worst 10%": 2, "local train": 1}


def _plot_series(ax, x, y, label: str, style: str | None = None) -> None:
    look = series_style(_SERIES[style or label])
    ax.plot(x, y, label=label, markevery=max(1, len(x) // 12), **look)


def _fit(ax, values: list[float], lo: float | None = None, hi: float | None = None) -> None:
    """The y axis over the data with a margin (clipped to [lo, hi]), not over [0, 1]."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return
    bottom, top = min(finite), max(finite)
    pad = max(0.02 * (abs(top) or 1.0), 0.08 * (top - bottom))
    bottom, top = bottom - pad, top + pad
    ax.set_ylim(bottom if lo is None else max(lo, bottom), top if hi is None else min(hi, top))


def curves_figure(result: RunResult):
    """The figure of :func:`plot_curves` (the caller closes it)."""
    with paper_style() as plt:
        evaluated = [r for r in result.rounds if "test_accuracy" in r]
        trained = [r for r in result.rounds if "train_loss" in r]
        fig, (acc_ax, loss_ax) = plt.subplots(
            2, 1, figsize=(COLUMN_WIDTH_IN, 4.4), sharex=True, layout="constrained")
        x = [r["round"] for r in evaluated]
        pooled = [r["test_accuracy"] for r in evaluated]
        client_mean = [r["client_accuracy_mean"] for r in evaluated]
        worst = [r["client_accuracy_worst10"] for r in evaluated]
        if _same_curve(pooled, client_mean):
            _plot_series(acc_ax, x, pooled, "global test = client mean", "global test")
        else:
            _plot_series(acc_ax, x, pooled, "global test")
            _plot_series(acc_ax, x, client_mean, "client mean")
        _plot_series(acc_ax, x, worst, "client worst 10%")
        _fit(acc_ax, pooled + client_mean + worst, 0.0, 1.0)
        acc_ax.set(ylabel="test accuracy")
        acc_ax.legend(loc="lower right")
        test_loss = [r["test_loss"] for r in evaluated]
        train_loss = [r["train_loss"] for r in trained]
        _plot_series(loss_ax, x, test_loss, "global test")
        _plot_series(loss_ax, [r["round"] for r in trained], train_loss, "local train")
        _fit(loss_ax, test_loss + train_loss, 0.0)
        loss_ax.set(xlabel="round", ylabel="cross-entropy loss")
        loss_ax.legend(loc="upper right")
        _integer_rounds(acc_ax, loss_ax)
        fig.suptitle(run_title(result))
    return fig


def plot_curves(result: RunResult, path: str | Path) -> Path:
    """Test accuracy (pooled, client mean, client worst-10%) and test/train loss per round;
    writes ``path`` (PNG) and the PDF beside it.

    Where the pooled accuracy equals the client mean at every evaluation (equal-sized client
    test splits, e.g. an IID partition), one curve labelled with both names is drawn instead of
    two lines on top of each other."""
    return save_figure(curves_figure(result), path)


def accuracy_range(values: list[float], margin: float = 0.02) -> tuple[float, float]:
    """The x range of the per-client histogram: the data plus a margin (at least ``margin``, or
    5% of the spread), clipped to [0, 1]."""
    lo, hi = min(values), max(values)
    pad = max(margin, 0.05 * (hi - lo))
    return max(0.0, lo - pad), min(1.0, hi + pad)


def client_accuracy_figure(result: RunResult):
    """The figure of :func:`plot_client_accuracy` (the caller closes it)."""
    with paper_style() as plt:
        accuracy = [c["test_accuracy"] for c in result.clients]
        fig, ax = plt.subplots(figsize=(COLUMN_WIDTH_IN, 2.8), layout="constrained")
        lo, hi = accuracy_range(accuracy)
        ax.hist(accuracy, bins=20, range=(lo, hi), color=COLORS[0], edgecolor="white",
                linewidth=0.5)
        mean = result.summary["client_accuracy_mean"]
        ax.axvline(mean, color=COLORS[1], linestyle="--", label=f"mean {mean:.3f}")
        ax.set_xlim(lo, hi)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set(xlabel="test accuracy of the final global model", ylabel="clients")
        ax.legend(loc="upper left")
        fig.suptitle(run_title(result))
    return fig


def plot_client_accuracy(result: RunResult, path: str | Path) -> Path:
    """Histogram of the final model's accuracy on each client's test split, over the range of
    the data (:func:`accuracy_range`), not all of [0, 1]; PNG and PDF."""
    return save_figure(client_accuracy_figure(result), path)
