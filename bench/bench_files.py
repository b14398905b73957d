"""Benchmark of fedkernels.aggregate_files (checkpoint files summed in chunks) against the
page-cache read bandwidth of the same files and against what users write instead.

    python bench/bench_files.py                       # K=4 clients of a 0.68 B-parameter bf16 model
    python bench/bench_files.py --model lora -K 10    # K=10 LoRA adapters (256 small tensors)
    python bench/bench_files.py --tiny                # seconds: a smoke test of the script
    python bench/bench_files.py --save                # also merge into bench/results/files-<device>.json

The clients are written once as safetensors files under --dir (deleted at the end unless
--keep) and read once before timing, so that every method reads them from the page cache.
Methods, timed in interleaved rounds (each round times every method once):

  plain read        read() of every client file into one reused buffer: the ceiling
  aggregate_files   fedkernels.aggregate_files(files, w, out=..., fsync=False)
  numpy memmap + op each tensor's chunks as zero-copy views of numpy memmaps of the files,
                    through the same op, written after (one thread, no writer thread)
  safe_open + op    row blocks read with safetensors' safe_open/get_slice, the same op
  load + loop       safetensors.torch.load_file of every client, a per-tensor Python loop
                    sum(w_k * x_k), save_file: what FL code writes
  load + aggregate  load_file of every client, fedkernels.aggregate, save_file

"% of read" is the plain read's time over the method's (both read the same input bytes);
"x faster" is the load + loop time over the method's. Peak memory is measured in a fresh
process per method: the peak resident set beyond what the process held before the call
(VmHWM, through /proc/self/clear_refs), so file pages mapped by a memmap count, the page
cache that read() copies from does not. The load average is recorded before every round:
the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

import fedkernels
from fedkernels.checkpoint_files import open_checkpoint, safetensors_header
from fedkernels.ops import summation

from harness.cli import add_output_arguments, at_least, check_output_arguments, fail
from harness.machine import device_name, environment
from harness.results import RESULTS_DIR, _merge_into, write_results


def llama_shapes(d: int = 2048, ff: int = 5632, layers: int = 12,
                 vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    """A LLaMA-style decoder: 9 tensors a layer, embeddings and the final norm (0.68 B
    parameters with the defaults: 1.36 GB in bf16)."""
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{m}.weight"] = (d, d)
        shapes.update({p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff)})
    shapes["model.norm.weight"] = (d,)
    return shapes


def lora_shapes(d: int = 4096, rank: int = 16, layers: int = 32) -> dict[str, tuple[int, ...]]:
    """A LoRA adapter on the four attention projections of a 7B-class model: 256 tensors of
    64 Ki elements (16.8 M parameters)."""
    shapes = {}
    for i in range(layers):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}."
            shapes[p + "lora_A.weight"] = (rank, d)
            shapes[p + "lora_B.weight"] = (d, rank)
    return shapes


MODELS = {"llama-0.7b": llama_shapes, "lora": lora_shapes,
          "tiny": lambda: {"a": (1000, 37), "b": (13,), "c": (70001,)}}


def write_client(path: str, shapes: dict, dtype: torch.dtype, seed: int) -> None:
    """One client's safetensors file, written tensor by tensor (no whole model in memory)."""
    gen = torch.Generator().manual_seed(seed)
    header = safetensors_header([(n, dtype, s) for n, s in shapes.items()], {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for shape in shapes.values():
            f.write(torch.randn(shape, generator=gen).to(dtype).view(torch.uint8).numpy().tobytes())


# ---------------------------------------------------------------- the methods


def plain_read(paths: list[str], buffer: bytearray) -> None:
    view = memoryview(buffer)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def _write_chunked(paths, weights, out, chunk_bytes, chunks) -> None:
    """Sums the chunks that ``chunks(entries)`` yields, (entry, K client tensors) in file
    order, with the op and writes them after one header (one thread)."""
    checkpoints = [open_checkpoint(p, f"client {k}") for k, p in enumerate(paths)]
    entries = list(checkpoints[0].entries.values())
    header = safetensors_header([(e.name, e.dtype, e.shape) for e in entries], {"format": "pt"})
    w = torch.tensor(weights, dtype=torch.float64)
    with open(out, "wb") as f:
        f.write(header)
        for e, views in chunks(checkpoints, entries):
            result = torch.empty(views[0].numel(), dtype=e.dtype)
            summation.weighted_sum_out(views, w, [], 1.0, False, [result])
            f.write(result.view(torch.uint8).numpy().tobytes())


def memmap_and_op(paths: list[str], weights: list[float], out: str, chunk_bytes: int) -> None:
    """The op on zero-copy views of numpy memmaps of the files' byte ranges."""
    maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in paths]

    def chunks(checkpoints, entries):
        for e in entries:
            step = max(1, chunk_bytes // e.dtype.itemsize)
            for start in range(0, e.numel, step):
                count = min(step, e.numel - start)
                views = []
                for c, m in zip(checkpoints, maps):
                    at = c.entries[e.name].offset + start * e.dtype.itemsize
                    views.append(torch.from_numpy(m[at:at + count * e.dtype.itemsize]).view(e.dtype))
                yield e, views

    with warnings.catch_warnings():  # read-only arrays: the op only reads them
        warnings.simplefilter("ignore", UserWarning)
        _write_chunked(paths, weights, out, chunk_bytes, chunks)


def safe_open_and_op(paths: list[str], weights: list[float], out: str, chunk_bytes: int) -> None:
    """The op on row blocks read with safetensors' own reader (``safe_open``, ``get_slice``)."""
    from safetensors import safe_open

    files = [safe_open(p, framework="pt") for p in paths]

    def chunks(checkpoints, entries):
        for e in entries:
            slices = [f.get_slice(e.name) for f in files]
            if len(e.shape) == 0 or e.numel == 0:
                yield e, [f.get_tensor(e.name).reshape(-1) for f in files]
                continue
            row = max(1, e.numel // e.shape[0])
            rows = max(1, chunk_bytes // (row * e.dtype.itemsize))
            for r in range(0, e.shape[0], rows):
                yield e, [s[r:r + rows].reshape(-1) for s in slices]

    _write_chunked(paths, weights, out, chunk_bytes, chunks)


def load_and_loop(paths: list[str], weights: list[float], out: str) -> None:
    from safetensors.torch import load_file, save_file

    sds = [load_file(p) for p in paths]
    result = {n: sum(w * sd[n] for w, sd in zip(weights, sds)) for n in sds[0]}
    save_file(result, out)


def load_and_aggregate(paths: list[str], weights: list[float], out: str) -> None:
    from safetensors.torch import load_file, save_file

    sds = [load_file(p) for p in paths]
    save_file(fedkernels.aggregate(sds, weights), out)


def methods(paths, weights, out, chunk_bytes, buffer, skip):
    fns = {
        "plain read": lambda: plain_read(paths, buffer),
        "aggregate_files": lambda: fedkernels.aggregate_files(
            paths, weights, out=out, chunk_bytes=chunk_bytes, fsync=False, overwrite=True),
        "numpy memmap + op": lambda: memmap_and_op(paths, weights, out, chunk_bytes),
        "safe_open + op": lambda: safe_open_and_op(paths, weights, out, chunk_bytes),
        "load + loop": lambda: load_and_loop(paths, weights, out),
        "load + aggregate": lambda: load_and_aggregate(paths, weights, out),
    }
    return {k: v for k, v in fns.items() if k not in skip}


METHODS = ("plain read", "aggregate_files", "numpy memmap + op", "safe_open + op",
           "load + loop", "load + aggregate")


# ---------------------------------------------------------------- memory, in a child


def peak_rss_of(fn) -> int:
    """Bytes of resident memory at the peak of ``fn()`` beyond what was resident before."""
    def field(name: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(name)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = field("VmRSS")
    fn()
    return field("VmHWM") - before


def child_memory(args) -> None:
    paths = json.loads(args.child_memory[1])
    weights = [1.0 / len(paths)] * len(paths)
    out = os.path.join(args.dir, "memory-out.safetensors")
    buffer = bytearray(args.chunk_bytes)
    fn = methods(paths, weights, out, args.chunk_bytes, buffer, ())[args.child_memory[0]]
    peak = peak_rss_of(fn)
    if os.path.exists(out):
        os.remove(out)
    print(peak)


def memory_in_child(method: str, paths: list[str], args) -> int | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--chunk-bytes",
           str(args.chunk_bytes), "--child-memory", method, json.dumps(paths)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"# memory child of {method!r} failed: {proc.stderr[-500:]}", file=sys.stderr)
        return None
    return int(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the run


def run(args, argv) -> dict:
    shapes = MODELS[args.model]()
    dtype = getattr(torch, args.dtype)
    params = sum(math.prod(s) for s in shapes.values())
    folder = tempfile.mkdtemp(prefix="bench_files-", dir=args.dir)
    args.dir = folder
    try:
        paths = [os.path.join(folder, f"client{k}.safetensors") for k in range(args.clients)]
        t0 = time.perf_counter()
        for k, p in enumerate(paths):
            write_client(p, shapes, dtype, seed=k)
        in_bytes = sum(os.path.getsize(p) for p in paths)
        print(f"# {args.clients} clients x {params / 1e6:.1f} M parameters ({args.dtype}): "
              f"{in_bytes / 1e9:.2f} GB of files in {folder} (written in "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        weights = [1.0 / args.clients] * args.clients
        out = os.path.join(folder, "out.safetensors")
        buffer = bytearray(args.chunk_bytes)
        plain_read(paths, buffer)  # into the page cache
        fns = methods(paths, weights, out, args.chunk_bytes, buffer, args.skip)
        times: dict[str, list[float]] = {name: [] for name in fns}
        loads = []
        names = list(fns)
        for r in range(args.repeats):
            loads.append(os.getloadavg()[0])
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
                if os.path.exists(out):
                    os.remove(out)
            print(f"# round {r + 1}/{args.repeats} (load {loads[-1]:.1f}): "
                  + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names), flush=True)
        # the output once, checked against aggregate on the loaded state_dicts
        fedkernels.aggregate_files(paths, weights, out=out, chunk_bytes=args.chunk_bytes,
                                   fsync=False)
        fsync_start = time.perf_counter()
        fedkernels.aggregate_files(paths, weights, out=out, chunk_bytes=args.chunk_bytes,
                                   overwrite=True)
        fsync_s = time.perf_counter() - fsync_start
        memory = {} if args.no_memory else {n: memory_in_child(n, paths, args) for n in names}
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    medians = {n: statistics.median(t) for n, t in times.items()}
    read_s = medians.get("plain read")
    loop_s = medians.get("load + loop")
    rows = []
    header = f"{'method':<26}{'median s':>10}{'GB/s in':>9}{'% of read':>10}{'x faster':>9}{'peak MB':>9}"
    print(header + "\n" + "-" * len(header))
    for name, t in medians.items():
        row = {"method": name, "median_s": t, "seconds": times[name],
               "input_GBps": in_bytes / t / 1e9,
               "fraction_of_plain_read": read_s / t if read_s else None,
               "speedup_over_load_loop": loop_s / t if loop_s else None,
               "peak_extra_MB": None if memory.get(name) is None else memory[name] / 1e6}
        rows.append(row)
        frac = "" if row["fraction_of_plain_read"] is None else f"{100 * row['fraction_of_plain_read']:.0f}"
        speed = "" if row["speedup_over_load_loop"] is None else f"{row['speedup_over_load_loop']:.2f}"
        mem = "" if row["peak_extra_MB"] is None else f"{row['peak_extra_MB']:.0f}"
        print(f"{name:<26}{t:>10.2f}{row['input_GBps']:>9.2f}{frac:>10}{speed:>9}{mem:>9}")
    print(f"# aggregate_files with fsync=True (flushed to the disk): {fsync_s:.2f} s once")
    env = environment(torch.device("cpu"))
    env["load_average_per_round"] = loads
    payload = {
        "environment": env, "model": args.model, "dtype": args.dtype, "K": args.clients,
        "params": params, "tensors": len(shapes), "input_bytes": in_bytes,
        "chunk_bytes": args.chunk_bytes, "rows": rows, "fsync_once_s": fsync_s,
        "command": "python bench/bench_files.py " + " ".join(argv),
    }
    name = f"{args.model}-K{args.clients}-{args.dtype}"
    device = torch.device("cpu")
    path = write_results(f"files-{name}", device, payload, out=args.out)
    if args.save:  # a file of its own, beside the op benchmarks' <device>.json
        path += " and " + os.path.join(RESULTS_DIR, f"files-{device_name(device)}.json")
        _merge_into(path.rsplit(" and ", 1)[1], name, payload)
    print(f"# wrote {path}")
    return payload


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="llama-0.7b")
    parser.add_argument("-K", "--clients", type=at_least(1), default=4)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--chunk-bytes", type=at_least(4096), default=1 << 20)
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the client files are written (and deleted after)")
    parser.add_argument("--skip", nargs="*", default=[], choices=METHODS, help="methods to leave out")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--keep", action="store_true", help="keep the client files")
    parser.add_argument("--tiny", action="store_true", help="tiny files, K=2, one round")
    parser.add_argument("--child-memory", nargs=2, help=argparse.SUPPRESS)
    add_output_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.child_memory:
        child_memory(args)
        return
    check_output_arguments(args)
    if not os.path.isdir(args.dir):
        fail(f"--dir {args.dir} is not a folder")
    if args.tiny:
        args.model, args.clients, args.repeats = "tiny", 2, 1
    run(args, argv)


if __name__ == "__main__":
    main()
