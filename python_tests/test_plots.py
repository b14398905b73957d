"""The run and comparison plots on small fake results: curves that coincide stay visible, the
per-client histogram fits its axis to the data, and round axes have integer ticks. The
matplotlib objects are checked, not pixels."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt  # noqa: E402

from fedkernels.cli.compare import plot as compare_plot  # noqa: E402
from fedkernels.sim.plots import (  # noqa: E402
    accuracy_range,
    client_accuracy_figure,
    curves_figure,
    plot_client_accuracy,
    plot_curves,
)
from fedkernels.sim.results import RunResult  # noqa: E402


def fake_result(pooled, client_mean, client_accuracy) -> RunResult:
    rounds = []
    for i, (p, m) in enumerate(zip(pooled, client_mean)):
        rounds.append({"round": i + 1, "train_loss": 2.0 - 0.1 * i, "test_accuracy": p,
                       "test_loss": 1.9 - 0.1 * i, "client_accuracy_mean": m,
                       "client_accuracy_worst10": m - 0.1})
    clients = [{"test_accuracy": a} for a in client_accuracy]
    config = {"algorithm": "fedavg", "partition": {"kind": "iid"},
              "participation": {"kind": "full"}}
    summary = {"client_accuracy_mean": sum(client_accuracy) / len(client_accuracy)}
    return RunResult(config=config, dataset="digits", rounds=rounds, clients=clients,
                     summary=summary)


def _labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def _integer_ticks(fig, ax) -> list[float]:
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def test_coinciding_global_and_client_mean_are_one_labelled_curve():
    acc = [0.2, 0.5, 0.7, 0.8]
    fig = curves_figure(fake_result(acc, list(acc), [0.9, 0.95]))
    acc_ax = fig.axes[0]
    assert _labels(acc_ax) == ["global test = client mean", "client worst 10%"]
    assert [t.get_text() for t in acc_ax.get_legend().get_texts()] == _labels(acc_ax)
    plt.close(fig)


def test_different_curves_have_distinct_styles():
    fig = curves_figure(fake_result([0.2, 0.5, 0.7], [0.25, 0.45, 0.72], [0.9, 0.95]))
    acc_ax, loss_ax = fig.axes
    assert _labels(acc_ax) == ["global test", "client mean", "client worst 10%"]
    for ax in (acc_ax, loss_ax):
        styles = {(line.get_linestyle(), line.get_marker()) for line in ax.get_lines()}
        assert len(styles) == len(ax.get_lines())
    for ax in (acc_ax, loss_ax):
        ticks = _integer_ticks(fig, ax)
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)


def test_histogram_axis_fits_the_data():
    accuracy = [0.86, 0.89, 0.92, 0.92, 0.95, 1.0]
    fig = client_accuracy_figure(fake_result([0.9], [0.9], accuracy))
    lo, hi = fig.axes[0].get_xlim()
    assert lo == pytest.approx(0.84) and hi == 1.0  # 0.02 below the lowest, never beyond 1
    patches = fig.axes[0].patches
    assert sum(p.get_height() for p in patches) == len(accuracy)
    assert min(p.get_x() for p in patches) >= lo
    plt.close(fig)


@pytest.mark.parametrize("values,expected", [
    ([0.0, 0.05, 0.1], (0.0, 0.12)),         # clipped at 0
    ([0.5], (0.48, 0.52)),                   # one value: the minimum margin
    ([0.0, 1.0], (0.0, 1.0)),                # the whole range: exactly [0, 1]
    ([0.2, 0.6], (0.18, 0.62)),              # 5% of the spread is 0.02
    ([0.1, 0.9], (0.06, 0.94)),              # 5% of the spread is 0.04
])
def test_accuracy_range(values, expected):
    assert accuracy_range(values) == pytest.approx(expected)


def test_plot_files_are_written(tmp_path):
    result = fake_result([0.2, 0.5], [0.2, 0.5], [0.7, 0.8, 0.9])
    assert plot_curves(result, tmp_path / "c.png").stat().st_size > 0
    assert plot_client_accuracy(result, tmp_path / "h.png").stat().st_size > 0


def _entry(label: str, curve: list[float]) -> dict:
    keys = ["client_accuracy_worst10", "client_accuracy_mean", "client_accuracy_best10"]
    runs = [{"curve": [(r, a + 0.01 * seed) for r, a in enumerate(curve)]} for seed in range(2)]
    return {"label": label, "runs": runs, "mean": {k: 0.5 for k in keys},
            "std": {k: 0.01 for k in keys}}


def test_compare_plot_few_rounds_has_integer_ticks(tmp_path):
    entries = [_entry("fedavg", [0.3, 0.5, 0.6]), _entry("fedprox", [0.31, 0.52, 0.61])]
    fig = compare_plot(entries, tmp_path / "compare.png", "three rounds")
    assert (tmp_path / "compare.png").exists()
    curves = fig.axes[1]
    ticks = _integer_ticks(fig, curves)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert fig._suptitle.get_text() == "three rounds"


def test_compare_plot_many_methods_stay_distinguishable(tmp_path):
    entries = [_entry(f"method {i}", [0.1 * i, 0.2, 0.3]) for i in range(13)]
    fig = compare_plot(entries, tmp_path / "compare.png", "")
    lines = fig.axes[1].get_lines()
    assert len(lines) == 13
    styles = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines}
    assert len(styles) == 13


# ---------------------------------------------------------------- fit for a paper


def _texts(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _saved_width_in(path) -> float:
    import matplotlib.image

    return matplotlib.image.imread(path).shape[1] / 300  # saved at 300 dpi


def adam_cnn_result() -> RunResult:
    result = fake_result([0.2, 0.5, 0.7], [0.25, 0.45, 0.72], [0.9, 0.95])
    result.config = {"algorithm": "fedavg", "algorithm_params": {},
                     "model": {"name": "cnn", "channels": [16, 32]},
                     "data": {"name": "digits"}, "server": {"optimizer": "fedadam", "lr": None},
                     "partition": {"kind": "dirichlet", "alpha": 0.3, "num_clients": 2},
                     "participation": {"kind": "uniform", "fraction": 0.5}, "rounds": 3}
    return result


def test_a_runs_title_says_what_ran():
    # a FedAdam + CNN run's figure was titled "fedavg on digits"
    fig = curves_figure(adam_cnn_result())
    title = " ".join(fig._suptitle.get_text().split())
    assert title.startswith("fedavg, server fedadam (lr 0.1); cnn on digits, dirichlet (α=0.3) "
                            "split, 2 clients, uniform (0.5) participation, 3 rounds"), title
    plt.close(fig)


def test_run_figures_fit_a_column_with_nine_point_text(tmp_path):
    result = adam_cnn_result()
    for make, name in ((plot_curves, "c.png"), (plot_client_accuracy, "h.png")):
        path = make(result, tmp_path / name)
        assert _saved_width_in(path) <= 3.5
        assert path.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"
    for figure in (curves_figure(result), client_accuracy_figure(result)):
        assert min(t.get_fontsize() for t in _texts(figure)) >= 9
        assert figure.get_figwidth() == 3.5
        plt.close(figure)


def test_the_first_eight_series_differ_in_colour_line_style_and_marker():
    from fedkernels.sim.plots import series_style

    looks = [series_style(i) for i in range(8)]
    for key in ("color", "linestyle", "marker"):
        assert len({str(look[key]) for look in looks}) == 8, key
    assert len({json_key(series_style(i)) for i in range(64)}) == 64


def json_key(look) -> str:
    return f"{look['color']}|{look['linestyle']}|{look['marker']}"


def _seeded_entry(label, base, auroc=None):
    keys = {"client_accuracy_worst10": base - 0.05, "client_accuracy_mean": base,
            "client_accuracy_best10": base + 0.03}
    if auroc is not None:
        keys.update(client_auroc_worst10=auroc - 0.02, client_auroc_mean=auroc,
                    client_auroc_best10=min(1.0, auroc + 0.01))
    runs = [{"curve": [(r, base - 0.3 / r + 0.01 * seed) for r in range(1, 21)]}
            for seed in range(3)]
    return {"label": label, "runs": runs, "mean": keys, "std": {k: 0.01 for k in keys}}


def test_the_comparison_figure_is_fit_for_a_paper(tmp_path):
    labels = ["fedavg", "fedprox, client.lr=0.05", "qffl, qffl.q=5", "term"]
    entries = [_seeded_entry(label, 0.85 + 0.02 * i, auroc=0.95 + 0.01 * i)
               for i, label in enumerate(labels)]
    fig = compare_plot(entries, tmp_path / "compare.png", "logreg on digits, iid split")
    points, curves, auroc = fig.axes
    lines = curves.get_lines()
    assert [line.get_label() for line in lines] == labels
    # a colour and a line style of its own per method
    assert len({line.get_color() for line in lines}) == 4
    assert len({str(line._unscaled_dash_pattern) for line in lines}) == 4
    assert len(curves.collections) == 4  # mean ± std bands over the seeds
    # metric axes over the data, not from 0
    assert points.get_xlim()[0] > 50 and auroc.get_xlim()[0] > 80
    assert curves.get_ylim()[0] > 40
    # the statistics' key sits above the points, not on them
    assert points.get_legend() is None and auroc.get_legend() is None
    assert min(t.get_fontsize() for t in _texts(fig)) >= 9
    assert _saved_width_in(tmp_path / "compare.png") <= 3.5
    assert (tmp_path / "compare.pdf").read_bytes()[:4] == b"%PDF"
