"""A rank of a torch.distributed aggregation killed outright (SIGKILL, sent by the parent)
while the ranks loop over all_reduce_aggregate, so that it dies inside one of its collectives
(the layout agreement or the model's all-reduce, wherever the signal lands): every surviving
rank raises fedkernels' RuntimeError ("a rank died, crashed or did not join it within ...")
within the call's ``timeout`` plus a margin, and none hangs or crashes. (The distributed API
writes no files, so nothing on disk can be left half-written; test_integrations_distributed.py
covers a rank that exits inside the call and one that never joins.)

Three gloo ranks over loopback; the middle one is the victim, so that both of its neighbours
in the ring lose a peer. Every round completed before the kill is checked to be the exact mean.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fedkernels.integrations.distributed import all_reduce_aggregate

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")]

WORLD = 3
VICTIM = 1
TIMEOUT_S = 5.0  # the call's timeout=
MARGIN_S = 25.0  # start-up of the failure path on a loaded machine
STORE_TIMEOUT = timedelta(seconds=120)
SPAWN_BOUND_S = 300.0


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore("faults", store), rank=rank,
                            world_size=WORLD, timeout=STORE_TIMEOUT)
    mine = {"w": torch.full((2_000_000,), float(rank + 1)), "n": torch.tensor(rank)}
    rounds = 0
    start = None
    try:
        while True:
            result = all_reduce_aggregate([mine], torch.ones(1), normalize=True,
                                          timeout=TIMEOUT_S)
            # every completed round is the exact mean: nothing half-summed is ever returned
            assert torch.equal(result["w"], torch.full((2_000_000,), 2.0)), rounds
            assert int(result["n"]) == WORLD - 1
            rounds += 1
            if rounds == 2:
                store.set(f"looping/{rank}", "1")  # the parent may kill the victim now
                start = time.monotonic()
            if rounds > 100_000:
                store.set(f"outcome/{rank}", "never failed")
                break
    except RuntimeError as err:
        elapsed = time.monotonic() - (start or time.monotonic())
        store.set(f"outcome/{rank}", f"{elapsed:.1f}|{err}")
    except BaseException as err:  # noqa: BLE001  (reported to the parent)
        store.set(f"outcome/{rank}", f"other|{type(err).__name__}: {err}")
    os._exit(0)  # no destroy_process_group: it would wait on the broken group


def test_a_rank_killed_mid_collective_fails_every_survivor_clearly(monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}"
                               f"{os.environ.get('PATH', '')}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=STORE_TIMEOUT)
    mp.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "fedkernels", "fedkernels.integrations.distributed"])
    context = mp.start_processes(_rank, args=(store.port,), nprocs=WORLD, join=False,
                                 start_method="forkserver")
    processes = context.processes
    survivors = [r for r in range(WORLD) if r != VICTIM]
    try:
        store.wait([f"looping/{r}" for r in range(WORLD)], timedelta(seconds=SPAWN_BOUND_S))
        os.kill(processes[VICTIM].pid, signal.SIGKILL)
        store.wait([f"outcome/{r}" for r in survivors],
                   timedelta(seconds=TIMEOUT_S + MARGIN_S + 30))
        outcomes = {r: store.get(f"outcome/{r}").decode() for r in survivors}
        deadline = time.monotonic() + 60
        while any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert processes[VICTIM].exitcode == -signal.SIGKILL
    assert all(processes[r].exitcode == 0 for r in survivors), \
        [p.exitcode for p in processes]
    for r, outcome in outcomes.items():
        elapsed, _, message = outcome.partition("|")
        assert elapsed not in ("other", "never failed"), (r, outcome)
        assert "fedkernels.integrations.distributed" in message and "a rank died" in message, \
            (r, message)
        assert "destroy it" in message, (r, message)  # says what to do next
        assert float(elapsed) < TIMEOUT_S + MARGIN_S, (r, outcome)
