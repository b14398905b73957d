r"""Privacy accounting of server-side central DP, through Google's ``dp-accounting``.

A round of central DP (clipped updates, Gaussian noise of standard deviation
:math:`\sigma C / K` on their mean, ``fedkernels.private_aggregate``) is the Gaussian mechanism
with noise multiplier :math:`\sigma` applied to the sampled clients. With clients sampled at
rate :math:`q = K / N` it is accounted as a Poisson-subsampled Gaussian, and the rounds compose:

.. math:: \varepsilon(\delta) \text{ of } \bigcirc_{t=1}^{T} \mathcal{S}_{q_t}(\mathcal{N}_\sigma).

The accounting itself is the library's (Rényi-DP or privacy-loss-distribution accountant); this
module only builds the event and reports :math:`\varepsilon`. ``dp-accounting`` is the optional
extra ``fedkernels[dp]``; nothing here imports it before it is needed.

Caveats the numbers inherit: Poisson subsampling is the model, while a simulator that draws a
fixed number of clients per round samples without replacement (the usual approximation); and the
guarantee is at the level of clients (neighbouring data sets differ in one client's data).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

Accountant = Literal["rdp", "pld"]


def _require_dp_accounting() -> Any:
    try:
        import dp_accounting
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "privacy accounting needs the optional extra fedkernels[dp] (the dp-accounting "
            "package): pip install 'fedkernels[dp]'",
            name="dp_accounting",
        ) from None
    return dp_accounting


def dp_accounting_available() -> bool:
    """Whether the ``fedkernels[dp]`` extra (``dp-accounting``) is installed."""
    try:
        _require_dp_accounting()
    except ModuleNotFoundError:
        return False
    return True


def _check(noise_multiplier: float, rates: Sequence[float], delta: float,
           accountant: str) -> None:
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    for t, q in enumerate(rates):
        if not 0 <= q <= 1:
            raise ValueError(f"sampling rate of round {t} must be in [0, 1], got {q!r}")
    if accountant not in ("rdp", "pld"):  # also when no round is accounted
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")


def epsilon_from_rates(
    noise_multiplier: float,
    sampling_rates: Sequence[float],
    delta: float,
    *,
    accountant: Accountant = "rdp",
) -> float:
    r""":math:`\varepsilon` after one round per entry of ``sampling_rates`` (round t samples each
    client with probability :math:`q_t`; a round with :math:`q_t = 0` releases nothing), each
    round a Gaussian mechanism with noise multiplier ``noise_multiplier``. ``accountant``:
    ``"rdp"`` (Rényi DP, fast, a slightly loose upper bound) or ``"pld"`` (privacy loss
    distributions, tighter, seconds per call). Returns 0 for no rounds."""
    # Read once: an iterator checked and then counted would count no round (epsilon 0).
    rates = [float(q) for q in sampling_rates]
    _check(noise_multiplier, rates, delta, accountant)
    return _epsilon_of_counts(noise_multiplier, Counter(q for q in rates if q > 0), delta,
                              accountant)


def _epsilon_of_counts(noise_multiplier: float, rounds: Counter, delta: float,
                       accountant: str) -> float:
    """Epsilon of ``rounds[q]`` rounds at each sampling rate q > 0."""
    if not rounds:
        return 0.0
    dpa = _require_dp_accounting()
    events = []
    for q, count in sorted(rounds.items()):
        event = dpa.GaussianDpEvent(noise_multiplier)
        if q < 1:
            event = dpa.PoissonSampledDpEvent(q, event)
        events.append(dpa.SelfComposedDpEvent(event, count))
    event = events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
    engine = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    # The RDP accountant logs a warning for every fractional order whose series it drops;
    # the orders left still give a valid bound.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        engine.compose(event)
        return float(engine.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    *,
    accountant: Accountant = "rdp",
) -> float:
    r""":math:`\varepsilon` after ``rounds`` rounds at the same ``sampling_rate``
    :math:`q = K/N` (see :func:`epsilon_from_rates`)."""
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral):
        raise TypeError(f"rounds must be an int, got {type(rounds).__name__}")
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds!r}")
    # Counted, not listed: the memory does not grow with the number of rounds.
    q = float(sampling_rate)
    _check(noise_multiplier, [q], delta, accountant)
    return _epsilon_of_counts(noise_multiplier, Counter({q: int(rounds)} if q > 0 and rounds
                                                        else {}), delta, accountant)
