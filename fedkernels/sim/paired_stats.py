"""Paired comparisons of two methods run on the same seeds.

Two methods run with the same seed see the same clients, initial model and minibatch order, so
the seed-to-seed spread that a "mean ± std" column mixes in cancels in the per-seed difference
``a_s - b_s``. :func:`paired_difference` reports that difference's mean, its sample standard
deviation and the Student-t confidence interval of its mean; an interval that holds 0 means the
data cannot tell the two methods apart ("within noise").

The t quantile comes from SciPy when it is installed and otherwise from a table (two-sided 95 %,
1-30 degrees of freedom, 6 decimals) extended by the Cornish-Fisher series beyond 30: SciPy is
only in the ``data`` extra, and a results table should not need it, nor change its digits
depending on whether it is there (the two agree to 1e-6, ``python_tests/test_paired_stats.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# t_{0.975, df} for df = 1..30 (two-sided 95 %), from scipy.stats.t.ppf, rounded to 6 decimals
T_975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
    2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
    2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
    2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)
Z_975 = 1.959963984540054


def _t_975_series(df: int) -> float:
    """Cornish-Fisher expansion of t_{0.975, df} around the normal quantile (error < 1e-6 for
    df > 30)."""
    z, v = Z_975, float(df)
    return (z + (z**3 + z) / (4 * v)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4))


def t_quantile(df: int, confidence: float = 0.95) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` degrees of freedom:
    SciPy's when installed; without SciPy only ``confidence=0.95`` is available."""
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}")
    try:
        from scipy.stats import t
    except ImportError:
        if abs(confidence - 0.95) > 1e-12:
            raise ValueError(
                f"confidence={confidence} needs SciPy (pip install scipy); without it only "
                "0.95 is tabulated") from None
        return T_975[df - 1] if df <= len(T_975) else _t_975_series(df)
    return float(t.ppf(0.5 + confidence / 2, df))


@dataclass(frozen=True)
class PairedDifference:
    """``a - b`` seed by seed: ``mean``, sample ``std`` (n - 1), the ``confidence`` interval
    ``[low, high]`` of the mean (None when n < 2), ``n`` pairs, and how many seeds ``a`` is
    ahead and behind."""

    mean: float
    std: float
    low: float | None
    high: float | None
    n: int
    ahead: int
    behind: int
    confidence: float = 0.95

    @property
    def within_noise(self) -> bool:
        """Whether the interval holds 0 (or there is no interval): no evidence of a
        difference."""
        return self.low is None or self.low <= 0.0 <= self.high

    def verdict(self, a: str = "A", b: str = "B") -> str:
        if self.within_noise:
            return "within noise"
        return f"{a} ahead" if self.mean > 0 else f"{b} ahead"

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        """``+1.2 ± 0.8 [+0.2, +2.2]`` (mean ± std, 95 % interval) in units of ``1/scale``."""
        f = f"{{:+.{digits}f}}"
        head = f"{f.format(scale * self.mean)} ± {scale * self.std:.{digits}f}"
        if self.low is None:
            return f"{head} [n={self.n}]"
        return f"{head} [{f.format(scale * self.low)}, {f.format(scale * self.high)}]"


def paired_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> PairedDifference:
    """The per-seed differences ``a[i] - b[i]`` summarised (see :class:`PairedDifference`);
    ``a`` and ``b`` must list the same seeds in the same order. Non-finite pairs are refused:
    a diverged run is a result to report, not a number to average."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs equal lengths, got {len(a)} and {len(b)}")
    if not len(a):
        raise ValueError("paired_difference needs at least one pair")
    diff = [float(x) - float(y) for x, y in zip(a, b)]
    if not all(math.isfinite(d) for d in diff):
        raise ValueError("paired_difference: a value is NaN or infinite")
    n = len(diff)
    mean = sum(diff) / n
    ahead = sum(d > 1e-12 for d in diff)
    behind = sum(d < -1e-12 for d in diff)
    if n < 2:
        return PairedDifference(mean, math.nan, None, None, n, ahead, behind, confidence)
    std = math.sqrt(sum((d - mean) ** 2 for d in diff) / (n - 1))
    half = t_quantile(n - 1, confidence) * std / math.sqrt(n)
    return PairedDifference(mean, std, mean - half, mean + half, n, ahead, behind, confidence)
