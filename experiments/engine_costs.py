"""The cost of a FedAvg round on every engine, on one small task.

Every folder of examples/ trains the same task (examples/*/task.py: scikit-learn's digits, an
MLP 64-64-10, IID clients, one local epoch of SGD per round), and so does the simulator with its
defaults (``fedkernels run``: digits, MLP with 64 hidden units, batch 16, learning rate 0.1).
This script runs each engine's command as its README gives it, with K clients and R rounds, in a
copy of the folder, and reads the time of each round from the run's own log:

- the simulator: ``wall_time_s`` of each round in results.json;
- plain PyTorch, FedLab, torch.distributed (torchrun, 2 ranks on gloo), Flower (simulation on
  Ray, and a deployment of a SuperLink and SuperNodes on 127.0.0.1): the "round N: ..., T s"
  lines that the example prints;
- NVIDIA FLARE's simulator: the timestamps of the server's "Round N started." records.

A round's time is from the server sending the global model to the new global model (evaluation
included); the rest of the command's wall time is start-up and shutdown. Writes
experiments/engine_costs.json, the table of docs/guide/running_at_scale.md.

    python experiments/engine_costs.py                         # every case
    python experiments/engine_costs.py --only plain_pytorch,flower_simulation --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ROUND_LINE = re.compile(r"round (\d+): test accuracy ([\d.]+), loss [\d.]+, ([\d.]+) s")
# (engine, clients); ten Flower SuperNodes or NVFlare sites would be ten processes that each
# import torch every round (Flower) or hold a site (NVFlare) on two cores, so those run K = 2 only
CASES = [
    ("simulator", 2), ("plain_pytorch", 2), ("fedlab", 2), ("torch_distributed", 2),
    ("flower_simulation", 2), ("flower_deployment", 2), ("nvflare", 2),
    ("simulator", 10), ("plain_pytorch", 10), ("fedlab", 10), ("torch_distributed", 10),
    ("flower_simulation", 10),
]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def end_processes_naming(text: str) -> None:
    """Ends the processes whose command line contains ``text`` (Flower's managed SuperLink, which
    names its Flower home) and their descendants."""
    parents, named = {}, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                named.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = list(named), list(named)
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        tree += frontier
    for pid in reversed(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(command: list[str], cwd: Path, env: dict, timeout: float) -> tuple[str, float]:
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n"
                           f"{output[-3000:]}")
    return output, wall


def printed_rounds(output: str) -> tuple[list[float], float]:
    rows = [(int(r), float(a), float(s)) for r, a, s in ROUND_LINE.findall(output)]
    rows = sorted(r for r in rows if r[0] > 0)
    return [s for _, _, s in rows], rows[-1][1]


def nvflare_rounds(log: Path) -> list[float]:
    stamp, starts = None, []
    for line in log.read_text().splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        elif re.search(r"Round \d+ started\.|Finished FedAvg\.", line):
            starts.append(stamp)
    return [b - a for a, b in zip(starts, starts[1:])]


def measure(engine: str, clients: int, rounds: int, work: Path) -> dict:
    env = dict(os.environ, PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    python = str(BIN / "python") if (BIN / "python").exists() else sys.executable
    folder = {"simulator": None, "flower_simulation": "flower_fedavg",
              "flower_deployment": "flower_fedavg", "nvflare": "nvflare_job"}.get(engine, engine)
    cwd = work
    if folder:
        cwd = work / folder
        shutil.copytree(ROOT / "examples" / folder, cwd,
                        ignore=shutil.ignore_patterns("__pycache__", "workspace"))
    accuracy = None
    if engine == "simulator":
        out = work / "run"
        _, wall = run([python, "-m", "fedkernels.cli", "run", "--rounds", str(rounds),
                       "--partition.num_clients", str(clients), "--out", str(out)], cwd, env, 900)
        results = json.loads((out / "results.json").read_text())
        seconds = [r["wall_time_s"] for r in results["rounds"]]
        accuracy = results["summary"]["test_accuracy"]
    elif engine in ("plain_pytorch", "fedlab"):
        script = "fedavg.py"
        output, wall = run([python, script, "--clients", str(clients), "--rounds", str(rounds)],
                           cwd, env, 900)
        seconds, accuracy = printed_rounds(output)
    elif engine == "torch_distributed":
        output, wall = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                            "train.py", "--clients", str(clients), "--rounds", str(rounds)],
                           cwd, env, 900)
        seconds, accuracy = printed_rounds(output)
    elif engine == "flower_simulation":
        home = work / "flwr-home"
        link, control = free_ports(2)
        env.update(FLWR_HOME=str(home), FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(link),
                   FLWR_LOCAL_CONTROL_API_PORT=str(control), FLWR_DISABLE_UPDATE_CHECK="1")
        try:
            output, wall = run([str(BIN / "flwr"), "run", ".", "--stream", "--federation-config",
                                f"num-supernodes={clients}", "--run-config",
                                f"num-server-rounds={rounds} min-nodes={clients}"], cwd, env, 900)
        finally:
            end_processes_naming(str(home))
        seconds, accuracy = printed_rounds(output)
    elif engine == "flower_deployment":
        env["TMPDIR"] = str(work)
        output, wall = run([python, "run_deployment.py", "--nodes", str(clients), "--run-config",
                            f"num-server-rounds={rounds}"], cwd, env, 900)
        seconds, accuracy = printed_rounds(output)
    elif engine == "nvflare":
        output, wall = run([python, "job.py", "--sites", str(clients), "--rounds", str(rounds),
                            "--workspace", str(work / "ws")], cwd, env, 900)
        seconds = nvflare_rounds(work / "ws" / "digits_fedavg" / "server" / "log.txt")
        accuracy = float(re.search(r"final global model: test accuracy ([\d.]+)", output).group(1))
    else:
        raise ValueError(engine)
    return {"engine": engine, "clients": clients, "rounds": rounds, "wall_s": round(wall, 2),
            "round_s": [round(s, 3) for s in seconds],
            "first_round_s": round(seconds[0], 3),
            "later_round_median_s": round(statistics.median(seconds[1:]), 3),
            "outside_rounds_s": round(wall - sum(seconds), 2), "final_accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated engines")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "engine_costs.json"))
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    cases = [c for c in CASES if not only or c[0] in only]
    records = []
    for engine, clients in cases:
        with tempfile.TemporaryDirectory(prefix=f"cost-{engine}-") as work:
            load_before = os.getloadavg()[0]
            try:
                record = measure(engine, clients, args.rounds, Path(work))
            except Exception as err:  # one engine failing should not lose the others' figures
                print(f"{engine} K={clients}: {err}", file=sys.stderr)
                continue
            record["load_average_1min_before"] = round(load_before, 2)
            records.append(record)
            print(json.dumps(record), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    Path(args.out).write_text(json.dumps({
        "what": "seconds per FedAvg round on the same task (digits, MLP 64-64-10, one local "
                "epoch), each engine's command as its README gives it",
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                    "note": "a shared 2-core machine, under load from other jobs; "
                            "OMP_NUM_THREADS=1"},
        "date": datetime.now().strftime("%Y-%m-%d"),
        "cases": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
