"""fedkernels.sim.paired_stats against scipy.stats on known data."""

from __future__ import annotations

import builtins
import math

import numpy as np
import pytest

from fedkernels.sim import paired_stats
from fedkernels.sim.paired_stats import paired_difference, t_quantile

stats = pytest.importorskip("scipy.stats")

# five seeds of two methods' accuracies (made-up, but with the spread of real tables)
A = [0.912, 0.934, 0.887, 0.951, 0.902]
B = [0.905, 0.921, 0.893, 0.930, 0.884]


def test_mean_std_and_interval_match_scipy():
    d = paired_difference(A, B)
    diff = np.subtract(A, B)
    assert d.n == 5 and d.ahead == 4 and d.behind == 1
    assert d.mean == pytest.approx(diff.mean(), abs=1e-15)
    assert d.std == pytest.approx(diff.std(ddof=1), rel=1e-12)
    low, high = stats.t.interval(0.95, len(diff) - 1, loc=diff.mean(), scale=stats.sem(diff))
    assert (d.low, d.high) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
    # the paired t-test and the interval agree on "within noise"
    p = stats.ttest_rel(A, B).pvalue
    assert d.within_noise == (p >= 0.05)


def test_a_clear_difference_is_not_within_noise():
    b = [x - 0.02 - 0.001 * i for i, x in enumerate(A)]
    d = paired_difference(A, b)
    assert d.low > 0 and not d.within_noise
    assert d.verdict("FedAU", "FedAvg") == "FedAU ahead"
    assert paired_difference(b, A).verdict("FedAU", "FedAvg") == "FedAvg ahead"
    assert paired_difference(A, B).verdict() == "within noise"


def test_other_confidence_levels_use_scipy():
    diff = np.subtract(A, B)
    d = paired_difference(A, B, confidence=0.9)
    low, _ = stats.t.interval(0.9, 4, loc=diff.mean(), scale=stats.sem(diff))
    assert d.low == pytest.approx(low, rel=1e-12)


@pytest.mark.parametrize("df", [*range(1, 41), 60, 120, 1000])
def test_the_table_and_series_match_scipy(df, monkeypatch):
    expected = stats.t.ppf(0.975, df)
    real_import = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    assert t_quantile(df) == pytest.approx(expected, abs=2e-6)
    with pytest.raises(ValueError, match="needs SciPy"):
        t_quantile(df, 0.9)
    assert paired_stats.T_975[0] == pytest.approx(12.706205)


def test_edge_cases():
    one = paired_difference([0.5], [0.4])
    assert one.n == 1 and one.low is None and math.isnan(one.std) and one.within_noise
    assert one.text() == "+10.0 ± nan [n=1]"
    same = paired_difference([0.5, 0.6], [0.5, 0.6])
    assert same.mean == 0 and same.std == 0 and same.within_noise
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        paired_difference([float("nan")], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        paired_difference([], [])


def test_text():
    d = paired_difference(A, B)
    mean, std = 100 * d.mean, 100 * d.std
    assert d.text() == f"{mean:+.1f} ± {std:.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
