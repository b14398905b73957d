"""``--check``: a fresh run's ratios compared with the committed results for this device.

The ratios are speed-ups over the baselines and fractions of the bandwidth probe, never
absolute times, so a machine that is slower today as a whole does not fail the check. The exit
status is 1 when a ratio regressed by more than ``--tolerance`` (20 % by default) and 2 when
there is nothing to compare with. A ratio flagged by the run is timed again before it counts:
the script runs once more in a fresh process (same arguments; it writes no results) and a ratio
is reported as regressed only when the better of its two fresh values is still worse by more
than the tolerance, so that one burst of load on a shared machine does not fail a check.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch

from .cli import fail
from .machine import device_name
from .results import RECHECK_ENV, committed_path


def _committed_run(name: str, path: str) -> dict | None:
    try:
        with open(path) as f:
            committed = json.load(f).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return committed if isinstance(committed, dict) else None


def _missing_committed(name: str, device: torch.device, path: str) -> str:
    return (f"no committed {name!r} results for {device_name(device)} in {path}; "
            "run once with --save to record them")


def require_committed(name: str, device: torch.device, path: str | None = None) -> None:
    """--check's precondition, tested before the run rather than after it: a committed run
    ``name`` for this device, or the one-line error (exit status 2) that the comparison would
    give minutes later."""
    path = path or committed_path(device)
    if _committed_run(name, path) is None:
        fail("--check: " + _missing_committed(name, device, path))


def _setting_differences(committed: dict, fresh: dict) -> list[str]:
    """What differs between the committed run and this one that moves ratios by itself: the
    CPU behind one device name, the thread count (a loop's time over a two-thread op's), the
    clock, the torch version, the size of the read probe. Settings the committed run did not
    record are not compared."""
    old, new = committed.get("environment") or {}, fresh.get("environment") or {}
    notes = []
    if old.get("cpu") and new.get("cpu") and old["cpu"] != new["cpu"]:
        def described(cpu: dict) -> str:
            return ", ".join(f"{key} {value}" for key, value in sorted(cpu.items()))

        notes.append(f"another CPU behind the name {new.get('device', '')!r}: "
                     f"{described(old['cpu'])} in the committed run, {described(new['cpu'])} "
                     "in this one")
    for key, what in (("threads", "torch threads"), ("torch", "torch")):
        if key in old and key in new and old[key] != new[key]:
            notes.append(f"{what} {old[key]} in the committed run, {new[key]} in this one")
    if old and new:
        clocks = old.get("cpu_clock", "wall"), new.get("cpu_clock", "wall")
        if clocks[0] != clocks[1]:
            notes.append(f"{clocks[0]} clock in the committed run, {clocks[1]} in this one")
    # a probe that fits in a cache reads faster: every fraction of it moves (--probe-bytes)
    sizes = [(run.get("probes") or {}).get("probe_bytes") for run in (committed, fresh)]
    if None not in sizes and sizes[0] != sizes[1]:
        notes.append(f"a read probe of {sizes[0] / 2**20:g} MiB in the committed run, "
                     f"{sizes[1] / 2**20:g} MiB in this one")
    return notes


def ratio_regressions(committed: dict[str, float], fresh: dict[str, float],
                      tolerance: float = 0.2) -> tuple[list[tuple[str, float, float, float]],
                                                       list[str]]:
    """Compares two sets of named ratios, each oriented so that higher is better (how many
    times faster than a baseline, or what fraction of the bandwidth probe). A ratio regressed
    when the committed value is more than ``1 + tolerance`` times the fresh one: with the
    default 0.2, a case that took 1.0x a baseline's time now takes more than 1.2x.

    Returns ``(regressions, compared)``: ``(name, committed, fresh, committed / fresh)`` for
    each regressed ratio (worst first), and the names found in both sets. Names in only one
    set (a case the run did not include) are not compared; non-positive or non-finite values
    are skipped."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    compared, regressions = [], []
    for name in sorted(set(committed) & set(fresh)):
        old, new = committed[name], fresh[name]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (old, new)):
            continue
        compared.append(name)
        if old / new > 1 + tolerance:
            regressions.append((name, old, new, old / new))
    regressions.sort(key=lambda item: -item[3])
    return regressions, compared


def rerun_ratios() -> dict[str, float] | None:
    """Runs this benchmark script once more, in a fresh process with the same arguments, and
    returns its fresh ratios (None if that run failed, or if no script is running: a main()
    called from other code)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script or not sys.argv or os.path.abspath(sys.argv[0]) != os.path.abspath(script):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratios.json")
        env = dict(os.environ, **{RECHECK_ENV: out})
        proc = subprocess.run([sys.executable, *sys.argv], env=env, stdout=subprocess.DEVNULL)
        if proc.returncode != 0 or not os.path.exists(out):
            return None
        with open(out) as f:
            return json.load(f)


def check_against_committed(name: str, device: torch.device, fresh_payload: dict,
                            ratios: Callable[[dict], dict[str, float]],
                            tolerance: float = 0.2, path: str | None = None,
                            recheck: bool = False) -> int:
    """Prints the comparison of ``fresh_payload``'s ratios with the committed run ``name`` of
    this device and returns the exit status: 0 (no regression), 1 (some ratio regressed by
    more than ``tolerance``), 2 (no committed run, or no ratio in common). With ``recheck``
    (the benchmark scripts' own call), flagged ratios are timed again by a second run of the
    script (rerun_ratios) and count only if the better of the two values still regressed.
    In that second run this only writes its ratios to the file RECHECK_ENV names."""
    recheck_to = os.environ.get(RECHECK_ENV)
    if recheck and recheck_to:
        with open(recheck_to, "w") as f:
            json.dump(ratios(fresh_payload), f)
        return 0
    path = path or committed_path(device)
    committed = _committed_run(name, path)
    if committed is None:
        print("check: " + _missing_committed(name, device, path), file=sys.stderr)
        return 2
    regressions, compared = ratio_regressions(ratios(committed), ratios(fresh_payload), tolerance)
    when = committed.get("environment", {}).get("date", "?")
    if not compared:
        print(f"check: the committed {name!r} run ({when}) has no case in common with this run",
              file=sys.stderr)
        return 2
    print(f"# check: {len(compared)} ratios compared with the committed run of {when} "
          f"(higher is better; flagged when more than {tolerance:.0%} worse)")
    for note in _setting_differences(committed, fresh_payload):
        print(f"# check: not like for like: {note}; a ratio may move for that reason alone")
    if regressions and recheck:
        print(f"# check: {len(regressions)} flagged; timing them again in a second run",
              flush=True)
        again = rerun_ratios()
        if again is None:
            print("# check: no second run (it failed, or this is not a script run); "
                  "reporting the first run's flags")
        else:
            best = {key: max(new, again.get(key, new)) for key, _, new, _ in regressions}
            regressions, _ = ratio_regressions(ratios(committed), best, tolerance)
            cleared = len(best) - len(regressions)
            print(f"# check: {cleared} of {len(best)} flagged ratios did not regress in the "
                  "second run (the better of the two values is compared)")
    for key, old, new, factor in regressions:
        print(f"REGRESSED  {key}: {old:.3g} -> {new:.3g} ({factor:.2f}x worse)")
    if regressions:
        print(f"# check: {len(regressions)} of {len(compared)} ratios regressed")
        return 1
    print("# check: no ratio regressed")
    return 0
