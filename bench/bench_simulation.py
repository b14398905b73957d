"""The same FL task run to the same number of rounds by fedkernels' simulator and by the
simulators researchers use: wall time per round, client updates per second, peak memory and
final accuracy.

    python bench/bench_simulation.py                      # the grid: results/simulation-<cpu>.json
    python bench/bench_simulation.py --models mlp --epochs 1 --repeats 1
    python bench/bench_simulation.py --tiny               # seconds: checks that every path runs
    python bench/bench_simulation.py --methods sequential vmap plain --out /tmp/sim.json

The task: MNIST-1D (5000 signals of 40 steps, ``fedkernels.sim.datasets.mnist_1d``) split IID
among 100 clients (40 training and 10 test rows each), FedAvg for ``--rounds`` rounds, K = 10
or 100 clients a round, 1 or 5 local epochs of plain SGD (lr 0.05, batch 32), on an MLP
40-64-10 or the MNIST-1D CNN (``mnist1d_cnn``). Methods, each in a fresh child process:

  sequential  ``fedkernels run``, one client after another
  vmap        ``fedkernels run --vmap``, a round's clients in one batched step
  flower      Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend), a
              ClientApp doing the same local training, fedkernels' drop-in FedAvg
              (``fedkernels.integrations.flower``) as the ServerApp's strategy
  pfl         pfl-research's ``FederatedAveraging`` with its PyTorch model and simulated backend
  plain       a plain PyTorch loop (load the global state, SGD, weighted mean): the floor

The peers build the same federation and model with fedkernels' own builders, so every method
trains the same rows from the same initial model; client sampling, shuffling and the order of
the sums are each method's own, so accuracies agree to noise, not bitwise. Every method gets
``--threads`` torch threads (Flower: Ray gets that many CPUs, one per client actor).

Reported per method and cell: the median time of a round after the first (the first holds
one-off warm-up: Ray actors, lazy imports), in wall time and in CPU time of the child's process
tree (user + system, Ray's workers included: on a shared machine other jobs inflate wall time,
much less CPU time), client updates per second (K over the wall time), the end-to-end time of
the child process, the peak resident set of the child's process tree (sampled at 20 Hz, so
Ray's workers count), and the final global model's accuracy on the pooled test rows. Every
method cuts rounds at the same marks (a round's end). Repeats interleave the methods (all
methods once, then again), and the results JSON keeps every repeat and the medians, plus the
load average of the machine before and after: compare methods through their ratios.

A method that cannot run here (a package missing, an API that refuses) is recorded with the
reason instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from harness.sim_task import (
    BATCH,
    LR,
    MODELS,
    NUM_CLIENTS,
    SEED,
    build_task,
    generator,
    local_sgd,
    model_flags,
    pooled_accuracy,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

METHODS = ("sequential", "vmap", "flower", "pfl", "plain")


# ---------------------------------------------------------------- the methods (in a child)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux /proc), children first."""
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                found += kids
                stack += kids
        except (OSError, ValueError):
            continue
    return found


def tree_cpu_s() -> float:
    """CPU seconds (user + system) so far of this process and the live processes below it:
    Flower's clients train in Ray worker processes, which this process's clock leaves out."""
    ticks = 0
    for p in descendants(os.getpid()):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return time.process_time() + ticks / os.sysconf("SC_CLK_TCK")


class RoundMarks:
    """Wall and CPU clocks at the start and at each round's end; a round's time is the
    difference between two marks, the same cut for every method. CPU time leaves out the
    other jobs of a shared machine that inflate wall time."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def mark(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(tree_cpu_s())

    def rounds(self, first_wall: float | None = None) -> dict:
        wall = [b - a for a, b in zip(self.wall, self.wall[1:])]
        cpu = [b - a for a, b in zip(self.cpu, self.cpu[1:])]
        if first_wall is not None:  # marks only at rounds' ends: the first round from its record
            wall, cpu = [first_wall, *wall], [None, *cpu]
        return {"round_s": wall, "round_cpu_s": cpu}


def run_fedkernels(args, vmap: bool) -> dict:
    from fedkernels.cli import main as cli_main
    from fedkernels.sim import run as sim_run

    # the same marks as the peers' (a round's end), wall and CPU, around the simulator's round
    marks = RoundMarks()
    play_round = sim_run.Simulation.play_round

    def timed(self, *a, **k):
        result = play_round(self, *a, **k)
        marks.mark()
        return result

    sim_run.Simulation.play_round = timed

    with tempfile.TemporaryDirectory() as out:
        participation = (["--participation.kind", "full"] if args.per_round == NUM_CLIENTS else
                         ["--participation.kind", "uniform", "--participation.fraction",
                          str(args.per_round / NUM_CLIENTS)])
        argv = ["run", "--data.name", "mnist1d", "--data.num_samples", str(args.num_samples),
                "--partition.kind", "iid", "--partition.num_clients", str(NUM_CLIENTS),
                *participation, *model_flags(args.model), "--client.epochs", str(args.epochs),
                "--client.batch_size", str(BATCH), "--client.lr", str(LR),
                "--rounds", str(args.rounds), "--eval_every", str(args.rounds),
                "--checkpoint_every", str(args.rounds), "--seed", str(SEED),
                "--threads", str(args.threads), "--no-progress", "--no-plots",
                "--out", os.path.join(out, "run")]
        if vmap:
            argv += ["--vmap", "true"]
        start = time.perf_counter()
        code = cli_main(argv)
        run_s = time.perf_counter() - start
        sim_run.Simulation.play_round = play_round
        if code not in (None, 0):
            raise RuntimeError(f"fedkernels run exited {code}")
        with open(os.path.join(out, "run", "results.json")) as f:
            results = json.load(f)
    # the first mark is the first round's end: its time is the simulator's own record
    return {**marks.rounds(first_wall=results["rounds"][0]["wall_time_s"]),
            "accuracy": results["summary"]["test_accuracy"], "run_s": run_s}


def run_plain(args) -> dict:
    import copy

    import numpy as np
    import torch

    fed, model = build_task(args.model, args.num_samples)
    local = copy.deepcopy(model)
    rng = np.random.default_rng(SEED)
    gen = torch.Generator().manual_seed(SEED)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    marks = RoundMarks()
    start = time.perf_counter()
    marks.mark()
    for _ in range(args.rounds):
        ids = rng.choice(NUM_CLIENTS, size=args.per_round, replace=False)
        total = 0
        acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for i in ids:
            c = fed.clients[int(i)]
            local.load_state_dict(global_state)
            local_sgd(local, c.train_x, c.train_y, args.epochs, gen)
            for k, v in local.state_dict().items():
                acc[k].add_(v, alpha=c.num_train)
            total += c.num_train
        global_state = {k: v / total for k, v in acc.items()}
        marks.mark()
    model.load_state_dict(global_state)
    accuracy = pooled_accuracy(model, fed)
    return {**marks.rounds(), "accuracy": accuracy, "run_s": time.perf_counter() - start}


def run_flower(args) -> dict:
    import copy
    import logging

    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedkernels.integrations.flower import FedAvg

    logging.getLogger("flwr").setLevel(logging.WARNING)
    fed, model = build_task(args.model, args.num_samples)
    model = copy.deepcopy(model)  # build_task's is cached: the actors in this process share it
    initial = ArrayRecord(model.state_dict())
    epochs, threads, num_samples, model_name = args.epochs, args.threads, args.num_samples, \
        args.model
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        # build_task caches per process: one federation and model per Ray actor, as Flower's
        # examples keep their data sets in a module global
        torch.set_num_threads(1)
        fed_here, net = build_task(model_name, num_samples)
        client = fed_here.clients[int(context.node_config["partition-id"])]
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        local_sgd(net, client.train_x, client.train_y, epochs, generator(context.node_id))
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                              "metrics": MetricRecord({"num-examples": client.num_train})})
        return Message(content=content, reply_to=msg)

    marks = RoundMarks()

    class TimedFedAvg(FedAvg):
        def aggregate_train(self, server_round, replies):
            result = super().aggregate_train(server_round, replies)
            marks.mark()
            return result

    outcome: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(fraction_train=args.per_round / NUM_CLIENTS,
                               fraction_evaluate=0.0, min_train_nodes=args.per_round,
                               min_evaluate_nodes=0, min_available_nodes=NUM_CLIENTS)
        marks.mark()
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=args.rounds)
        outcome["state"] = result.arrays.to_torch_state_dict()

    start = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=NUM_CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": threads, "num_gpus": 0,
                                                 "logging_level": "error",
                                                 "log_to_driver": False}})
    run_s = time.perf_counter() - start
    if "state" not in outcome or len(marks.wall) != args.rounds + 1:
        raise RuntimeError(f"Flower's simulation finished {len(marks.wall) - 1} of "
                           f"{args.rounds} rounds")
    model.load_state_dict(outcome["state"])
    return {**marks.rounds(), "accuracy": pooled_accuracy(model, fed), "run_s": run_s}


def run_pfl(args) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    fed, model = build_task(args.model, args.num_samples)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    class Wrapped(torch.nn.Module):
        """pfl's PyTorch model needs ``loss`` and ``metrics`` on the module."""

        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=False):
            self.eval() if eval else self.train()
            out = self(x)
            n = len(y)
            return {"loss": Weighted(float(F.cross_entropy(out, y, reduction="sum")), n),
                    "accuracy": Weighted(float((out.argmax(1) == y).sum()), n)}

    net = Wrapped(model)
    ids = list(range(NUM_CLIENTS))

    def federated(split: str) -> FederatedDataset:
        def make(uid):
            c = fed.clients[uid]
            x, y = (c.train_x, c.train_y) if split == "train" else (c.test_x, c.test_y)
            return Dataset(raw_data=[x, y], user_id=uid)

        return FederatedDataset(make, get_user_sampler("minimize_reuse", ids))

    pfl_model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                             central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    marks = RoundMarks()

    class Timer(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            marks.mark()
            return False, Metrics()

    backend = SimulatedBackend(training_data=federated("train"), val_data=federated("test"))
    algorithm_params = NNAlgorithmParams(central_num_iterations=args.rounds,
                                         evaluation_frequency=args.rounds + 1,
                                         train_cohort_size=args.per_round, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_num_epochs=args.epochs, local_learning_rate=LR,
                                      local_batch_size=BATCH)
    start = time.perf_counter()
    marks.mark()
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend,
                             model=pfl_model, model_train_params=train_params,
                             model_eval_params=NNEvalHyperParams(local_batch_size=256),
                             callbacks=[Timer()], send_metrics_to_platform=False)
    run_s = time.perf_counter() - start
    return {**marks.rounds(), "accuracy": pooled_accuracy(net.net, fed), "run_s": run_s}


# Where a method's packages come from: a missing one is a skip with the reason, not a failure.
REQUIRES = {"flower": ("flwr", "ray"), "pfl": ("pfl",)}


def child(args) -> dict:
    import importlib.util

    import torch

    torch.set_num_threads(args.threads)
    missing = [m for m in REQUIRES.get(args.child, ()) if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"not importable here: {', '.join(missing)} "
                           f"(pip install {'flwr[simulation]' if 'ray' in missing else 'pfl'})"}
    try:
        if args.child in ("sequential", "vmap"):
            return run_fedkernels(args, args.child == "vmap")
        return {"flower": run_flower, "pfl": run_pfl, "plain": run_plain}[args.child](args)
    except Exception as exc:  # recorded: the bench says why a peer could not run
        return {"error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-2000:]}


# ---------------------------------------------------------------- the driver


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f
                              if line.startswith("VmRSS:"))
        except (OSError, ValueError, StopIteration):
            continue
    return total


def run_child(method: str, model: str, per_round: int, epochs: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--model", model,
               "--per-round", str(per_round), "--epochs-one", str(epochs),
               "--rounds", str(args.rounds), "--threads", str(args.threads),
               "--num-samples", str(args.num_samples), "--result", result_path]
        # bench/ on the path too: Ray's workers import harness.sim_task by name
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   PYTHONPATH=os.pathsep.join(
                       p for p in (ROOT, HERE, os.environ.get("PYTHONPATH")) if p))
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            if time.perf_counter() - start > args.timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                return {"error": f"timed out after {args.timeout} s"}
            time.sleep(0.05)
        log = proc.stdout.read() if proc.stdout else ""
        wall = time.perf_counter() - start
        if not os.path.exists(result_path):
            return {"error": f"child exited {proc.returncode} without a result",
                    "log": log[-2000:]}
        with open(result_path) as f:
            result = json.load(f)
    if "round_s" in result:
        steady = result["round_s"][1:] or result["round_s"]
        steady_cpu = [c for c in result["round_cpu_s"][1:] if c is not None]
        result.update(end_to_end_s=wall, peak_rss_MB=peak / 2**20,
                      median_round_s=statistics.median(steady),
                      median_round_cpu_s=statistics.median(steady_cpu) if steady_cpu else None)
    return result


def summarize(repeats: list[dict], per_round: int) -> dict:
    done = [r for r in repeats if "median_round_s" in r]
    if not done:
        first = repeats[0]
        return {k: first[k] for k in ("skipped", "error", "traceback", "log") if k in first}
    round_s = statistics.median(r["median_round_s"] for r in done)
    cpu = [r["median_round_cpu_s"] for r in done if r["median_round_cpu_s"] is not None]
    return {"round_s": round_s, "updates_per_s": per_round / round_s,
            "round_cpu_s": statistics.median(cpu) if cpu else None,
            "end_to_end_s": statistics.median(r["end_to_end_s"] for r in done),
            "peak_rss_MB": statistics.median(r["peak_rss_MB"] for r in done),
            "accuracy": statistics.median(r["accuracy"] for r in done),
            "repeats": len(done)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "cnn"])
    parser.add_argument("--per-round", dest="per_rounds", type=int, nargs="+",
                        default=[10, 100], help="clients a round (of 100)")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-samples", type=int, default=5000)
    parser.add_argument("--merge", action="store_true",
                        help="keep the cells of an existing --out file that this run does not "
                             "measure (a grid run in parts)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a child may run")
    parser.add_argument("--tiny", action="store_true",
                        help="MLP, 10 clients a round, 1 epoch, 3 rounds, 1000 samples, once")
    parser.add_argument("--out", metavar="FILE",
                        help="results JSON (default: bench/results/simulation-<cpu>.json; "
                             "--tiny: a new file under bench/results/runs/)")
    # the child's own arguments
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--epochs-one", dest="epochs_one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        # the driver passes --per-round K (one value); read it back as the child's K
        args.per_round = args.per_rounds[0]
        args.epochs = args.epochs_one
        result = child(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    for name in ("rounds", "repeats", "threads", "num_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tiny:
        args.models, args.per_rounds, args.epochs = ["mlp"], [10], [1]
        args.rounds, args.repeats, args.num_samples = 3, 1, 1000
        if args.out is None:
            from harness.results import new_run_path

            args.out = new_run_path("simulation-tiny")
    if args.out is None:
        import torch

        from harness.machine import device_name

        args.out = os.path.join(HERE, "results", f"simulation-{device_name(torch.device('cpu'))}.json")
    cells = [(m, k, e) for m in args.models for k in args.per_rounds for e in args.epochs]
    load_before = os.getloadavg()
    rows, kept = [], []
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            kept = [r for r in json.load(f)["rows"]
                    if (r["model"], r["per_round"], r["epochs"]) not in cells]
    for model, k, e in cells:
        cell_load = os.getloadavg()[0]
        runs: dict[str, list[dict]] = {m: [] for m in args.methods}
        for rep in range(args.repeats):
            for method in args.methods:
                if rep and runs[method] and "median_round_s" not in runs[method][0]:
                    continue  # skipped or failed once: the reason is recorded already
                r = run_child(method, model, k, e, args)
                runs[method].append(r)
                shown = (f"{r['median_round_s'] * 1e3:9.1f} ms/round "
                         f"{(r['median_round_cpu_s'] or 0) * 1e3:9.1f} CPU ms  "
                         f"acc {r['accuracy']:.3f}  "
                         f"peak {r['peak_rss_MB']:.0f} MB  e2e {r['end_to_end_s']:.1f} s"
                         if "median_round_s" in r else
                         (r.get("skipped") or r.get("error", "?")))
                print(f"{model} K={k:3d} E={e} rep {rep} {method:10s} {shown}", flush=True)
        summary = {m: summarize(v, k) for m, v in runs.items()}
        base = summary.get("sequential", {})
        for s in summary.values():
            if base.get("round_s") and "round_s" in s:
                s["speedup_vs_sequential"] = base["round_s"] / s["round_s"]
            if base.get("round_cpu_s") and s.get("round_cpu_s"):
                s["cpu_ratio_vs_sequential"] = s["round_cpu_s"] / base["round_cpu_s"]
        rows.append({"model": model, "per_round": k, "epochs": e, "methods": summary,
                     "load_average": [round(cell_load, 2), round(os.getloadavg()[0], 2)],
                     "repeats": {m: [{kk: vv for kk, vv in r.items() if kk != "traceback"}
                                     for r in v] for m, v in runs.items()}})
        # after every cell, so that a grid cut short keeps the cells it finished
        payload = {"environment": environment(args, load_before), "task": task(args),
                   "rows": sorted(kept + rows, key=lambda r: (r["model"] != "mlp",
                                                              r["per_round"], r["epochs"]))}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
    print(f"wrote {args.out}")


def task(args) -> dict:
    return {"data": "mnist1d", "num_samples": args.num_samples, "clients": NUM_CLIENTS,
            "partition": "iid", "test_fraction": 0.2, "rounds": args.rounds, "lr": LR,
            "batch_size": BATCH, "optimizer": "sgd", "models": {m: MODELS[m] for m in args.models}}


def environment(args, load_before) -> dict:
    import datetime
    import importlib.metadata as md
    import platform

    import torch

    versions = {}
    for pkg in ("torch", "flwr", "ray", "pfl"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": args.threads, "torch": torch.__version__, "versions": versions,
            "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}


if __name__ == "__main__":
    main()
