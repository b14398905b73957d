"""One SuPerFed local step (mix, forward/backward through the mixed model, regularizers,
optimizer step over both endpoints) with the fused ops against the same step in plain
PyTorch, and against a plain FedAvg step, for a CNN and a ResNet-18-sized model.

    OMP_NUM_THREADS=1 python bench/bench_superfed.py [--device cuda] [--repeats 15]

Variants of the step (all with SGD(momentum=0.9, weight_decay=1e-4): torch.optim.SGD with its
default implementation for the device, or with ``fused=True`` under ``--sgd fused``, except the
SuPerFedSGD variants; the same network code via functional_call):

- ``fedavg``: the module's own parameters, CE, backward, step (the reference cost);
- ``superfed_sgd_step_mm`` / ``_lm``: fedkernels.SuPerFedSGD (what the simulation runs): the
  forward of superfed_mix, then one pass after the backward that applies the SGD update to both
  endpoints and their momentum buffers without writing their gradients (its own update, so
  ``--sgd`` does not change it);
- ``superfed_fused_mm`` / ``_lm``: fedkernels.superfed_mix (one lambda / one per module): the
  mixed weights and nu cos^2 + prox from one fused pass, their gradients from one pass back;
- ``superfed_two_ops_lm``: fedkernels.mix_endpoints + fedkernels.superfed_regularizer (two
  passes each way, and autograd adds the two gradients of each endpoint);
- ``superfed_loops_mm`` / ``_lm``: the official code's way: per-parameter
  ``(1-lam)*w + lam*w_local``, the cosine from per-parameter dots and norms summed in Python,
  the prox as a per-parameter loop;
- ``superfed_foreach_lm``: mixing with ``torch._foreach_lerp`` (ScalarList, one lambda per
  tensor: the best plain-PyTorch multi-tensor baseline), the regularizers with ``_foreach_*``.

Also the ops alone (mix forward+backward and regularizer forward+backward, no network), with
their effective bandwidth over their minimum traffic and its fraction of a copy probe.
The machine is shared: the variants are timed interleaved, round-robin, and each ratio is
the median over rounds of the per-round ratio. Results: bench/results/<device>.json under
``superfed`` (``superfed_fused_sgd`` for ``--sgd fused``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import fedkernels

from harness.cli import add_output_arguments, at_least, check_output_arguments, resolve_device
from harness.machine import environment
from harness.probes import MIN_PROBE_BYTES, bandwidth_probes
from harness.results import write_results
from harness.timing import synchronize

NU, MU = 1.0, 0.01


# ---------------------------------------------------------------- models


class TwoCNN(nn.Module):
    """The paper's TwoCNN: conv5(32)-pool-conv5(64)-pool-FC
    3136-200-200-10 on 28x28x1; here with biases (as the simulation's models have them):
    0.72M parameters in 10 tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=1)
        self.pool = nn.MaxPool2d(2, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = nn.Linear(200, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18 (3x3 stem, no max-pool): 11.17M parameters in 62 tensors."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ---------------------------------------------------------------- the steps


class Setup:
    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 fused_sgd: bool = False) -> None:
        self.model, self.x, self.y = model, x, y
        self.names = [n for n, _ in model.named_parameters()]
        params = [p.detach() for p in model.parameters()]
        gen = torch.Generator().manual_seed(1)
        self.g = [p.clone().requires_grad_() for p in params]
        self.l = [
            (p + 0.05 * torch.randn(p.shape, generator=gen).to(p)).requires_grad_() for p in params
        ]
        self.anchor = [p.clone() for p in params]
        owners = [n.rsplit(".", 1)[0] for n in self.names]
        modules = list(dict.fromkeys(owners))
        self.lam_lm_modules = torch.rand(len(modules), generator=gen)
        self.lam_lm = self.lam_lm_modules[torch.tensor([modules.index(o) for o in owners])]
        self.lam_mm = torch.tensor(0.37)
        sgd = dict(lr=1e-3, momentum=0.9, weight_decay=1e-4, **({"fused": True} if fused_sgd else {}))
        self.opt_fedavg = torch.optim.SGD(model.parameters(), **sgd)
        self.opt_superfed = torch.optim.SGD(self.g + self.l, **sgd)
        sgd.pop("fused", None)
        self.opt_step = {
            name: fedkernels.SuPerFedSGD(self.g, self.l, self.anchor, nu=NU, mu=MU, **sgd)
            for name in ("mm", "lm")
        }

    def forward_loss(self, theta):
        logits = functional_call(self.model, dict(zip(self.names, theta)), (self.x,))
        return F.cross_entropy(logits, self.y)


def step_fedavg(s: Setup) -> None:
    loss = F.cross_entropy(s.model(s.x), s.y)
    s.opt_fedavg.zero_grad(set_to_none=True)
    loss.backward()
    s.opt_fedavg.step()


def step_fused(s: Setup, layerwise: bool) -> None:
    theta, reg = fedkernels.superfed_mix(
        s.g, s.l, s.lam_lm if layerwise else s.lam_mm, s.anchor, nu=NU, mu=MU
    )
    loss = s.forward_loss(theta)
    s.opt_superfed.zero_grad(set_to_none=True)
    (loss + reg).backward()
    s.opt_superfed.step()


def step_fused_sgd(s: Setup, layerwise: bool) -> None:
    opt = s.opt_step["lm" if layerwise else "mm"]
    theta, reg = opt.mix(s.lam_lm if layerwise else s.lam_mm)
    loss = s.forward_loss(theta)
    (loss + reg).backward()
    opt.step()


def step_two_ops(s: Setup) -> None:
    theta = fedkernels.mix_endpoints(s.g, s.l, s.lam_lm)
    loss = s.forward_loss(theta)
    reg = fedkernels.superfed_regularizer(s.g, s.l, s.anchor, nu=NU, mu=MU)
    s.opt_superfed.zero_grad(set_to_none=True)
    (loss + reg).backward()
    s.opt_superfed.step()


def step_loops(s: Setup, layerwise: bool) -> None:
    lams = s.lam_lm.tolist() if layerwise else [float(s.lam_mm)] * len(s.g)
    theta = [(1 - lam) * g + lam * l for g, l, lam in zip(s.g, s.l, lams)]
    loss = s.forward_loss(theta)
    prox = sum((g - a).pow(2).sum() for g, a in zip(s.g, s.anchor)) * (MU / 2)
    dot = sum((g * l).sum() for g, l in zip(s.g, s.l))
    gg = sum(g.pow(2).sum() for g in s.g)
    ll = sum(l.pow(2).sum() for l in s.l)
    reg = NU * dot.pow(2) / (gg * ll) + prox
    s.opt_superfed.zero_grad(set_to_none=True)
    (loss + reg).backward()
    s.opt_superfed.step()


def step_foreach_lm(s: Setup) -> None:
    theta = torch._foreach_lerp(s.g, s.l, s.lam_lm.tolist())
    loss = s.forward_loss(theta)
    diff = torch._foreach_sub(s.g, s.anchor)
    prox = torch.stack(torch._foreach_norm(diff)).pow(2).sum() * (MU / 2)
    dot = torch.stack([x.sum() for x in torch._foreach_mul(s.g, s.l)]).sum()
    gg = torch.stack(torch._foreach_norm(s.g)).pow(2).sum()
    ll = torch.stack(torch._foreach_norm(s.l)).pow(2).sum()
    reg = NU * dot.pow(2) / (gg * ll) + prox
    s.opt_superfed.zero_grad(set_to_none=True)
    (loss + reg).backward()
    s.opt_superfed.step()


# The ops alone: mix forward + backward, regularizer forward + backward (no network).
def ops_fused(s: Setup) -> None:
    theta, reg = fedkernels.superfed_mix(s.g, s.l, s.lam_lm, s.anchor, nu=NU, mu=MU)
    torch.autograd.backward([reg] + theta, [None] + [torch.ones_like(t) for t in theta])
    for p in s.g + s.l:
        p.grad = None


def ops_loops(s: Setup) -> None:
    lams = s.lam_lm.tolist()
    theta = [(1 - lam) * g + lam * l for g, l, lam in zip(s.g, s.l, lams)]
    prox = sum((g - a).pow(2).sum() for g, a in zip(s.g, s.anchor)) * (MU / 2)
    dot = sum((g * l).sum() for g, l in zip(s.g, s.l))
    gg = sum(g.pow(2).sum() for g in s.g)
    ll = sum(l.pow(2).sum() for l in s.l)
    reg = NU * dot.pow(2) / (gg * ll) + prox
    torch.autograd.backward([reg] + theta, [None] + [torch.ones_like(t) for t in theta])
    for p in s.g + s.l:
        p.grad = None


def interleaved(
    fns: dict, device: torch.device, repeats: int, warmup: int = 2
) -> tuple[dict, dict]:
    """Per-round wall-clock and process-CPU seconds of each function, timed round-robin. The
    CPU time (all threads of the process) is less disturbed than the wall clock by other jobs
    on a shared machine; on a GPU it only counts the host side."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return times, cpu


def ratio(times: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def bench_model(name: str, model: nn.Module, x, y, device, repeats: int,
                fused_sgd: bool = False) -> dict:
    s = Setup(model.to(device), x.to(device), y.to(device), fused_sgd)
    n_params = sum(p.numel() for p in s.g)
    fns = {
        "fedavg": lambda: step_fedavg(s),
        "superfed_fused_mm": lambda: step_fused(s, False),
        "superfed_fused_lm": lambda: step_fused(s, True),
        "superfed_sgd_step_mm": lambda: step_fused_sgd(s, False),
        "superfed_sgd_step_lm": lambda: step_fused_sgd(s, True),
        "superfed_loops_mm": lambda: step_loops(s, False),
        "superfed_loops_lm": lambda: step_loops(s, True),
        "superfed_foreach_lm": lambda: step_foreach_lm(s),
        "superfed_two_ops_lm": lambda: step_two_ops(s),
    }
    times, cpu = interleaved(fns, device, repeats)
    ops_times, _ = interleaved(
        {"ops_fused": lambda: ops_fused(s), "ops_loops": lambda: ops_loops(s)}, device, repeats
    )
    # Minimum traffic of the fused ops (mix + statistics forward: read g, l, a, write theta;
    # backward: read g, l, a, G, write grad_g, grad_l): 10 parameter-sized passes.
    traffic = 10 * sum(p.numel() * p.element_size() for p in s.g)
    ops_fused_s = statistics.median(ops_times["ops_fused"])
    result = {
        "parameters": n_params,
        "ops_fused_min_traffic_bytes": traffic,
        "ops_fused_effective_GBps": traffic / ops_fused_s / 1e9,
        "tensors": len(s.g),
        "batch": list(x.shape),
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in {**times, **ops_times}.items()},
        "median_cpu_ms": {k: 1e3 * statistics.median(v) for k, v in cpu.items()},
        "ratios": {
            "fused_mm_over_fedavg": ratio(times, "superfed_fused_mm", "fedavg"),
            "fused_lm_over_fedavg": ratio(times, "superfed_fused_lm", "fedavg"),
            "sgd_step_mm_over_fedavg": ratio(times, "superfed_sgd_step_mm", "fedavg"),
            "sgd_step_lm_over_fedavg": ratio(times, "superfed_sgd_step_lm", "fedavg"),
            "fused_mm_over_sgd_step_mm": ratio(times, "superfed_fused_mm", "superfed_sgd_step_mm"),
            "loops_mm_over_fused_mm": ratio(times, "superfed_loops_mm", "superfed_fused_mm"),
            "loops_lm_over_fused_lm": ratio(times, "superfed_loops_lm", "superfed_fused_lm"),
            "foreach_lm_over_fused_lm": ratio(times, "superfed_foreach_lm", "superfed_fused_lm"),
            "two_ops_lm_over_fused_lm": ratio(times, "superfed_two_ops_lm", "superfed_fused_lm"),
            "loops_mm_over_fedavg": ratio(times, "superfed_loops_mm", "fedavg"),
            "ops_loops_over_ops_fused": ratio(ops_times, "ops_loops", "ops_fused"),
        },
        "cpu_time_ratios": {
            "fused_mm_over_fedavg": ratio(cpu, "superfed_fused_mm", "fedavg"),
            "fused_lm_over_fedavg": ratio(cpu, "superfed_fused_lm", "fedavg"),
            "sgd_step_mm_over_fedavg": ratio(cpu, "superfed_sgd_step_mm", "fedavg"),
            "sgd_step_lm_over_fedavg": ratio(cpu, "superfed_sgd_step_lm", "fedavg"),
        },
    }
    print(
        f"\n{name}: {n_params / 1e6:.2f}M parameters in {len(s.g)} tensors, batch {list(x.shape)}"
    )
    print(
        f"  fused ops: {result['ops_fused_effective_GBps']:.1f} GB/s effective "
        f"over {traffic / 1e6:.0f} MB minimum traffic"
    )
    for k, v in result["median_ms"].items():
        print(f"  {k:24s} {v:9.2f} ms")
    for k, v in result["median_cpu_ms"].items():
        print(f"  {k:24s} {v:9.2f} ms process CPU time")
    for k, v in result["ratios"].items():
        print(f"  {k:28s} {v:6.2f}x")
    for k, v in result["cpu_time_ratios"].items():
        print(f"  {k:28s} {v:6.2f}x (process CPU time)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=at_least(1), default=15)
    parser.add_argument("--batch", type=at_least(1), default=10, help="the paper's B = 10")
    # a name outside these would time nothing, and --save would then replace the committed
    # results with an empty run
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet18"],
                        choices=["cnn", "resnet18"])
    parser.add_argument("--probe-bytes", type=at_least(MIN_PROBE_BYTES), default=1 << 30)
    parser.add_argument("--sgd", choices=("default", "fused"), default="default",
                        help="torch.optim.SGD's implementation in every step: the device's "
                        "default (foreach), or fused=True (one pass per tensor)")
    parser.add_argument("--tiny", action="store_true",
                        help="the CNN only, batch 2, 1 repeat, small probe: checks the script runs")
    add_output_arguments(parser)
    args = parser.parse_args()
    device = resolve_device(args.device)
    check_output_arguments(args)
    if args.tiny:
        args.models, args.batch, args.repeats = ["cnn"], 2, 1
        args.probe_bytes = min(args.probe_bytes, 1 << 23)
    torch.manual_seed(0)
    payload = {"environment": environment(device), "nu": NU, "mu": MU, "sgd": args.sgd,
               "models": {}}
    fused_sgd = args.sgd == "fused"
    b = args.batch
    if "cnn" in args.models:
        payload["models"]["cnn"] = bench_model(
            "TwoCNN (28x28x1)",
            TwoCNN(),
            torch.randn(b, 1, 28, 28),
            torch.randint(0, 10, (b,)),
            device,
            args.repeats,
            fused_sgd,
        )
    if "resnet18" in args.models:
        payload["models"]["resnet18"] = bench_model(
            "ResNet-18 (32x32x3)",
            ResNet18(),
            torch.randn(b, 3, 32, 32),
            torch.randint(0, 10, (b,)),
            device,
            args.repeats,
            fused_sgd,
        )
    payload["probes"] = probes = bandwidth_probes(device, args.probe_bytes)
    for m in payload["models"].values():
        m["ops_fused_fraction_of_copy_probe"] = m["ops_fused_effective_GBps"] / probes["copy_GBps"]
    print(f"\nprobes: read {probes['read_GBps']:.1f} GB/s, copy {probes['copy_GBps']:.1f} GB/s")
    name = "superfed_fused_sgd" if fused_sgd else "superfed"
    path = write_results(name, device, payload, save=args.save, out=args.out)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
