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


def plot_curves(result: RunResult, path: str | Path) -> Path:
    """Test accuracy (pooled, client mean, client worst-10%) and test/train loss per round."""
    plt = _pyplot()
    evaluated = [r for r in result.rounds if "test_accuracy" in r]
    trained = [r for r in result.rounds if "train_loss" in r]
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["round"] + 1 for r in evaluated]
    acc_ax.plot(x, [r["test_accuracy"] for r in evaluated], label="global test")
    acc_ax.plot(x, [r["client_accuracy_mean"] for r in evaluated], label="client mean")
    acc_ax.plot(x, [r["client_accuracy_worst10"] for r in evaluated], label="client worst 10%")
    acc_ax.set(xlabel="round", ylabel="accuracy", title="accuracy")
    acc_ax.legend()
    loss_ax.plot(x, [r["test_loss"] for r in evaluated], label="global test")
    loss_ax.plot(
        [r["round"] + 1 for r in trained], [r["train_loss"] for r in trained], label="local train"
    )
    loss_ax.set(xlabel="round", ylabel="cross-entropy", title="loss")
    loss_ax.legend()
    _integer_rounds(acc_ax, loss_ax)
    config = result.config
    fig.suptitle(
        f"{config['algorithm']} on {result.dataset}, {config['partition']['kind']} partition, "
        f"{len(result.clients)} clients, {config['participation']['kind']} participation"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_client_accuracy(result: RunResult, path: str | Path) -> Path:
    """Histogram of the final model's accuracy on each client's test split."""
    plt = _pyplot()
    accuracy = [c["test_accuracy"] for c in result.clients]
    fig, ax = plt.subplots(figsize=(5, 3.8))
    ax.hist(accuracy, bins=20, range=(0.0, 1.0), edgecolor="black")
    mean = result.summary["client_accuracy_mean"]
    ax.axvline(mean, color="red", linestyle="--", label=f"mean {mean:.3f}")
    ax.set(xlabel="test accuracy", ylabel="clients", title="per-client accuracy (final model)")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
