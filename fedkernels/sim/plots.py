"""PNG plots of a run: learning curves and the distribution of per-client accuracy."""

from __future__ import annotations

from pathlib import Path

from .results import RunResult


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install 'fedkernels[sim]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_rounds(*axes) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# Distinct colour, line style and marker per series, so curves that lie on top of each other
# stay visible (markers are thinned on long runs).
_STYLES = {
    "global test": dict(color="tab:blue", linestyle="-", marker="o"),
    "client mean": dict(color="tab:orange", linestyle="--", marker="s"),
    "client worst 10%": dict(color="tab:green", linestyle=":", marker="^"),
    "local train": dict(color="tab:orange", linestyle="--", marker="s"),
}


def _plot_series(ax, x, y, label: str, style: str | None = None) -> None:
    ax.plot(x, y, label=label, markersize=4, markevery=max(1, len(x) // 15),
            **_STYLES[style or label])


def _same_curve(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(u - v) <= 1e-9 for u, v in zip(a, b))


def curves_figure(result: RunResult):
    """The figure of :func:`plot_curves` (the caller closes it)."""
    plt = _pyplot()
    evaluated = [r for r in result.rounds if "test_accuracy" in r]
    trained = [r for r in result.rounds if "train_loss" in r]
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["round"] for r in evaluated]
    pooled = [r["test_accuracy"] for r in evaluated]
    client_mean = [r["client_accuracy_mean"] for r in evaluated]
    if _same_curve(pooled, client_mean):
        _plot_series(acc_ax, x, pooled, "global test = client mean", "global test")
    else:
        _plot_series(acc_ax, x, pooled, "global test")
        _plot_series(acc_ax, x, client_mean, "client mean")
    _plot_series(acc_ax, x, [r["client_accuracy_worst10"] for r in evaluated], "client worst 10%")
    acc_ax.set(xlabel="round", ylabel="accuracy", title="accuracy")
    acc_ax.legend()
    _plot_series(loss_ax, x, [r["test_loss"] for r in evaluated], "global test")
    _plot_series(loss_ax, [r["round"] for r in trained], [r["train_loss"] for r in trained],
                 "local train")
    loss_ax.set(xlabel="round", ylabel="cross-entropy", title="loss")
    loss_ax.legend()
    _integer_rounds(acc_ax, loss_ax)
    config = result.config
    fig.suptitle(
        f"{config['algorithm']} on {result.dataset}, {config['partition']['kind']} partition, "
        f"{len(result.clients)} clients, {config['participation']['kind']} participation"
    )
    fig.tight_layout()
    return fig


def plot_curves(result: RunResult, path: str | Path) -> Path:
    """Test accuracy (pooled, client mean, client worst-10%) and test/train loss per round.

    Where the pooled accuracy equals the client mean at every evaluation (equal-sized client
    test splits, e.g. an IID partition), one curve labelled with both names is drawn instead of
    two lines on top of each other."""
    return _save(curves_figure(result), path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def accuracy_range(values: list[float], margin: float = 0.02) -> tuple[float, float]:
    """The x range of the per-client histogram: the data plus a margin (at least ``margin``, or
    5% of the spread), clipped to [0, 1]."""
    lo, hi = min(values), max(values)
    pad = max(margin, 0.05 * (hi - lo))
    return max(0.0, lo - pad), min(1.0, hi + pad)


def client_accuracy_figure(result: RunResult):
    """The figure of :func:`plot_client_accuracy` (the caller closes it)."""
    plt = _pyplot()
    accuracy = [c["test_accuracy"] for c in result.clients]
    fig, ax = plt.subplots(figsize=(5, 3.8))
    lo, hi = accuracy_range(accuracy)
    ax.hist(accuracy, bins=20, range=(lo, hi), edgecolor="black")
    mean = result.summary["client_accuracy_mean"]
    ax.axvline(mean, color="red", linestyle="--", label=f"mean {mean:.3f}")
    ax.set_xlim(lo, hi)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="test accuracy", ylabel="clients", title="per-client accuracy (final model)")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_client_accuracy(result: RunResult, path: str | Path) -> Path:
    """Histogram of the final model's accuracy on each client's test split, over the range of
    the data (:func:`accuracy_range`), not all of [0, 1]."""
    return _save(client_accuracy_figure(result), path)
