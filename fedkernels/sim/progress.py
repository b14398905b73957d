"""The progress bar of a run: rounds done, the rate and the time left (tqdm's own), the last
test accuracy and the peak memory of the run's device
(:func:`~fedkernels.sim.devices.peak_memory_bytes`: torch's tensors on a GPU, the process's
resident set on the CPU)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .devices import format_bytes, peak_memory_bytes

if TYPE_CHECKING:
    from .run import Simulation


@contextlib.contextmanager
def round_progress(
    simulation: Simulation, *, enabled: bool = True
) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A tqdm bar on stderr over ``simulation``'s rounds, from the round it continues at;
    yields the ``on_round`` callback of :meth:`Simulation.run` that moves it (a callback that
    does nothing when not ``enabled``)."""
    if not enabled:
        yield lambda record: None
        return
    from tqdm import tqdm

    bar = tqdm(total=simulation.config.rounds, initial=simulation.next_round, unit="round",
               file=sys.stderr)
    shown: dict[str, str] = {}

    def report(record: dict[str, Any]) -> None:
        if "test_accuracy" in record:
            shown["acc"] = f"{record['test_accuracy']:.3f}"
        shown["mem"] = format_bytes(peak_memory_bytes(simulation.device))
        bar.set_postfix(shown, refresh=False)
        bar.update(1)

    try:
        yield report
    finally:
        bar.close()
