"""Secure aggregation's arithmetic: fedkernels' fused ring ops against Flower's NumPy SecAgg+
arithmetic (docs/algorithms/secagg.md), on the ResNet-18 shape (11.7 M parameters).

    OMP_NUM_THREADS=2 python bench/bench_secagg.py [--clients 10 100] [--repeats 3] --out FILE

For K clients in the complete neighbour graph (Flower's default) with one client dropped
after sharing its keys, timed interleaved (medians of the rounds):

- ``client``: one client's masked vector from its float update and weight: ours is
  ``w * x`` then one ``secagg_mask`` pass (K - 1 pair masks and the self-mask expanded in the
  pass); Flower's is what ``secaggplus_mod`` computes: ``parameters_multiply``, ``quantize``,
  ``factor_combine``, ``pseudo_rand_gen`` for the self-mask and each pair (NumPy
  ``RandomState.randint``), additions and ``parameters_mod``;
- ``server``: the K - 1 survivors' masked vectors to floats: ours is one
  ``secagg_unmask_sum`` pass (K - 1 self-masks and the dropped client's K - 1 pair masks) and
  ``secagg_decode``; Flower's is what ``SecAggPlusWorkflow`` computes in its collect and
  unmask stages (sum, masks regenerated and subtracted, mod, ``factor_extract``,
  ``dequantize``).

The key agreement and Shamir shares are the same work for both and left out. Masked vectors
are four distinct ones cycled over the K clients (the memory of K copies at K = 100 would not
fit a small machine; each is larger than the caches, so each read still comes from memory).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fedkernels.ops.secagg import secagg_decode, secagg_mask, secagg_unmask_sum

from harness.case_runs import add_case_arguments, finish_case_run, start_case_run
from harness.model_shapes import resnet18_shapes
from harness.timing import interleaved_medians

CLIP, QRANGE, MOD = 8.0, 2**22, 2**32
SCALE = QRANGE / (2 * CLIP)


def _flower():
    from flwr.common.secure_aggregation import ndarrays_arithmetic as na
    from flwr.common.secure_aggregation.quantization import dequantize, quantize
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    return na, quantize, dequantize, pseudo_rand_gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    add_case_arguments(parser, "3 small tensors, K=3, 1 repeat, small probe: checks the script runs",
                       cpu_only=True)
    parser.set_defaults(repeats=3)
    args, device, probes, _ = start_case_run(parser, "secagg")
    if min(args.clients) < 2:
        parser.error("--clients: each K must be at least 2 (one client drops out)")
    na, quantize, dequantize, prg = _flower()
    shapes = [(8, 3), (5,), (4, 4)] if args.tiny else resnet18_shapes()
    if args.tiny:
        args.clients = [3]
    g = torch.Generator().manual_seed(0)
    update = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    update_np = [t.numpy() for t in update]
    w = 0.25
    rows = []
    for K in args.clients:
        rng = np.random.default_rng(K)
        pair_seeds = torch.from_numpy(rng.integers(-2**63, 2**63 - 1, (K, 2), dtype=np.int64))
        signs = [1 if j % 2 else -1 for j in range(K - 1)] + [1]
        flower_seeds = [rng.bytes(32) for _ in range(K)]

        def ours_client():
            return secagg_mask([t * w for t in update], clip=CLIP, scale=SCALE,
                               seeds=pair_seeds, signs=signs)

        def flower_client():
            p = na.parameters_multiply(update_np, w)
            q = quantize(p, CLIP, QRANGE)
            q = na.factor_combine(round(w * QRANGE), q)
            dims = [a.shape for a in q]
            q = na.parameters_addition(q, prg(flower_seeds[-1], MOD, dims))
            for j in range(K - 1):
                m = prg(flower_seeds[j], MOD, dims)
                q = na.parameters_addition(q, m) if signs[j] > 0 else na.parameters_subtraction(q, m)
            return na.parameters_mod(q, MOD)

        ours_masked = [ours_client() for _ in range(4)]
        flower_masked = [flower_client() for _ in range(2)]
        survivors = K - 1
        server_seeds = torch.cat([pair_seeds[:K - 1], pair_seeds[:K - 1]])
        server_signs = [1] * (K - 1) + signs[:K - 1]

        def ours_server():
            z = secagg_unmask_sum([ours_masked[k % 4] for k in range(survivors)],
                                  seeds=server_seeds, signs=server_signs)
            return secagg_decode(z, SCALE)

        def flower_server():
            total = flower_masked[0]
            for k in range(1, survivors):
                total = na.parameters_addition(total, flower_masked[k % 2])
            total = na.parameters_mod(total, MOD)
            dims = [a.shape for a in total]
            for j in range(K - 1):  # the survivors' self-masks
                total = na.parameters_subtraction(total, prg(flower_seeds[j], MOD, dims))
            for j in range(K - 1):  # the dropped client's pairs
                m = prg(flower_seeds[j], MOD, dims)
                total = na.parameters_addition(total, m) if signs[j] > 0 else \
                    na.parameters_subtraction(total, m)
            total = na.parameters_mod(total, MOD)
            ratio, total = na.factor_extract(total)
            return dequantize(total, CLIP, QRANGE)

        t = interleaved_medians({"ours_client": ours_client, "flower_client": flower_client,
                                 "ours_server": ours_server, "flower_server": flower_server},
                                device, repeats=args.repeats, warmup=0)
        row = {"K": K, "params": sum(t.numel() for t in update),
               **{f"{k}_s": v for k, v in t.items()},
               "client_speedup": t["flower_client"] / t["ours_client"],
               "server_speedup": t["flower_server"] / t["ours_server"]}
        rows.append(row)
        print(f"K={K:4d}  client: ours {t['ours_client']:.3f} s, Flower "
              f"{t['flower_client']:.3f} s ({row['client_speedup']:.1f}x)   server: ours "
              f"{t['ours_server']:.3f} s, Flower {t['flower_server']:.3f} s "
              f"({row['server_speedup']:.1f}x)", flush=True)
    finish_case_run("secagg", device, args, probes, rows, _ratios)


def _ratios(payload: dict) -> dict[str, float]:
    """--check's higher-is-better ratios: Flower's time over ours, per K and side."""
    found = {}
    for r in payload.get("rows", []):
        found[f"K={r['K']}: Flower client time / ours"] = r.get("client_speedup")
        found[f"K={r['K']}: Flower server time / ours"] = r.get("server_speedup")
    return found

if __name__ == "__main__":
    main()
