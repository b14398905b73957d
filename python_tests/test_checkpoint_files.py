"""fedkernels.aggregate_files: checkpoint files summed in chunks give fedkernels.aggregate's
result on the loaded state_dicts, and every bad input is refused before an output exists.

Equality is bitwise for every dtype: the op computes each element from the same K values in
the same order whether a tensor arrives whole or in chunks (fp32 accumulation for fp16/bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fedkernels
from fedkernels import checkpoint_files
from fedkernels.checkpoint_files import CheckpointError, aggregate_files

SMALL_CHUNK = 4096  # the smallest chunk: most test tensors span several steps


def make_state_dicts(num_clients: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Mixed dtypes, a tensor spanning several chunks (3001 x 7 fp32), small and odd-sized
    ones, a 0-d and an empty tensor, and an integer counter."""
    gen = torch.Generator().manual_seed(seed)
    sds = []
    for k in range(num_clients):
        sds.append({
            "big.weight": torch.randn(3001, 7, generator=gen),
            "odd.bias": torch.randn(13, generator=gen),
            "half.weight": torch.randn(257, 9, generator=gen).half(),
            "bf16.weight": torch.randn(4099, generator=gen).bfloat16(),
            "double": torch.randn(33, generator=gen).double(),
            "scalar": torch.randn((), generator=gen),
            "empty": torch.empty(0, 5),
            "bn.num_batches_tracked": torch.tensor(100 + 7 * k),
            "mask": torch.tensor([k % 2 == 0, True, False]),
        })
    return sds


def write_clients(folder: Path, sds, suffix: str = ".safetensors") -> list[str]:
    paths = []
    for k, sd in enumerate(sds):
        path = folder / f"client{k}{suffix}"
        if suffix == ".safetensors":
            save_file(sd, path, metadata={"format": "pt"})
        else:
            torch.save(sd, path)
        paths.append(str(path))
    return paths


def write_sharded(folder: Path, sd: dict, name: str = "model") -> str:
    """A Hugging Face style sharded checkpoint: two shards and the index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(sd)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        shard = f"{name}-{i:05d}-of-00002.safetensors"
        save_file({n: sd[n] for n in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    index = folder / f"{name}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return str(index)


def read_result(paths: list[str]) -> dict[str, torch.Tensor]:
    """The written result, through its index when sharded."""
    if paths[0].endswith(".index.json"):
        index = json.loads(Path(paths[0]).read_text())
        out = {}
        for name, shard in index["weight_map"].items():
            with safe_open(os.path.join(os.path.dirname(paths[0]), shard), "pt") as f:
                out[name] = f.get_tensor(name)
        return out
    return load_file(paths[0])


def assert_same(result: dict, expected: dict) -> None:
    assert set(result) == set(expected)
    for name, t in expected.items():
        assert result[name].dtype == t.dtype, name
        assert result[name].shape == t.shape, name
        assert torch.equal(result[name], t), name


def folder_listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------- results


@pytest.mark.parametrize("chunk_bytes", [SMALL_CHUNK, 10_000, 1 << 20])
def test_equals_aggregate_on_the_loaded_state_dicts(tmp_path, chunk_bytes):
    sds = make_state_dicts()
    paths = write_clients(tmp_path, sds)
    weights = [0.2, 0.5, 0.3]
    written = aggregate_files(paths, weights, out=tmp_path / "avg.safetensors",
                              chunk_bytes=chunk_bytes, fsync=False)
    assert written == [str(tmp_path / "avg.safetensors")]
    assert_same(read_result(written), fedkernels.aggregate(sds, weights))


def test_delta_mode_normalize_and_a_float32_base_for_half_clients(tmp_path):
    sds = make_state_dicts()
    base = {n: (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t.clone())
            for n, t in make_state_dicts(1, seed=5)[0].items()}
    paths = write_clients(tmp_path, sds)
    save_file(base, tmp_path / "base.safetensors")
    written = aggregate_files(paths, [3, 1, 4], out=tmp_path / "new.safetensors",
                              base=tmp_path / "base.safetensors", scale=0.7, normalize=True,
                              chunk_bytes=SMALL_CHUNK)
    expected = fedkernels.aggregate(sds, [3, 1, 4], base=base, scale=0.7, normalize=True)
    result = read_result(written)
    assert result["half.weight"].dtype == torch.float32  # the base's dtype
    assert_same(result, expected)


@pytest.mark.parametrize("policy", ["max", "first", "skip"])
def test_int_policy(tmp_path, policy):
    sds = make_state_dicts()
    base = make_state_dicts(1, seed=9)[0]
    base["bn.num_batches_tracked"] = torch.tensor(1)
    paths = write_clients(tmp_path, sds)
    save_file(base, tmp_path / "base.safetensors")
    written = aggregate_files(paths, [1, 1, 1], out=tmp_path / "r.safetensors", int_policy=policy,
                              base=tmp_path / "base.safetensors")
    expected = fedkernels.aggregate(sds, [1, 1, 1], int_policy=policy, base=base)
    assert_same(read_result(written), expected)
    assert int(read_result(written)["bn.num_batches_tracked"]) == {"max": 114, "first": 100,
                                                                    "skip": 1}[policy]


def test_int_policy_error_refuses_before_writing(tmp_path):
    paths = write_clients(tmp_path, make_state_dicts())
    with pytest.raises(TypeError, match="'bn.num_batches_tracked'.*int_policy='error'"):
        aggregate_files(paths, [1, 1, 1], out=tmp_path / "r.safetensors", int_policy="error")
    assert not (tmp_path / "r.safetensors").exists()


def test_sharded_inputs_pt_files_and_folders_mix(tmp_path):
    sds = make_state_dicts()
    sharded = write_sharded(tmp_path / "c0", sds[0])
    folder = Path(write_sharded(tmp_path / "c1", sds[1])).parent  # the folder of an index
    pt = write_clients(tmp_path, sds[2:], suffix=".pt")[0]
    written = aggregate_files([sharded, folder, pt], [0.1, 0.6, 0.3],
                              out=tmp_path / "avg.safetensors", chunk_bytes=SMALL_CHUNK)
    assert_same(read_result(written), fedkernels.aggregate(sds, [0.1, 0.6, 0.3]))


def test_pt_inputs_with_a_non_contiguous_tensor(tmp_path):
    sds = make_state_dicts(2)
    for sd in sds:
        sd["transposed"] = torch.randn(40, 300).t()  # saved as a non-contiguous view
    paths = write_clients(tmp_path, sds, suffix=".pt")
    written = aggregate_files(paths, [0.5, 0.5], out=tmp_path / "avg.safetensors",
                              chunk_bytes=SMALL_CHUNK)
    assert_same(read_result(written), fedkernels.aggregate(sds, [0.5, 0.5]))


@pytest.mark.parametrize("out_name", ["avg.safetensors", "avg.safetensors.index.json"])
def test_sharded_output_like_hugging_face(tmp_path, out_name):
    sds = make_state_dicts()
    paths = write_clients(tmp_path, sds)
    written = aggregate_files(paths, [1, 2, 3], out=tmp_path / out_name, normalize=True,
                              max_shard_bytes=40_000, chunk_bytes=SMALL_CHUNK)
    index_path = tmp_path / "avg.safetensors.index.json"
    assert written[0] == str(index_path)
    shards = [Path(p).name for p in written[1:]]
    assert shards == [f"avg-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    assert len(shards) > 1
    index = json.loads(index_path.read_text())
    expected = fedkernels.aggregate(sds, [1, 2, 3], normalize=True)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                 for t in expected.values())
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # each shard stays under the limit unless one tensor exceeds it
        with safe_open(tmp_path / shard, "pt") as f:
            sizes = [f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    assert_same(read_result(written), expected)
    # a sharded result is itself an input
    again = aggregate_files([index_path], [1.0], out=tmp_path / "copy.safetensors")
    assert_same(read_result(again), expected)


def test_one_output_file_when_it_fits_a_shard(tmp_path):
    paths = write_clients(tmp_path, make_state_dicts(2))
    written = aggregate_files(paths, [1, 1], out=tmp_path / "avg.safetensors")
    assert written == [str(tmp_path / "avg.safetensors")]
    with safe_open(written[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_unaligned_safetensors_data_is_copied_not_misread(tmp_path):
    """The format does not require each tensor's bytes to be aligned for its dtype: a 3-byte
    tensor first puts the float32 tensor after it on an odd offset."""
    sds = [{"pad": torch.arange(3, dtype=torch.uint8) + k, "w": torch.randn(3001),
            "h": torch.randn(77).half()} for k in range(2)]
    paths = []
    for k, sd in enumerate(sds):
        path = tmp_path / f"odd{k}.safetensors"
        order = ["pad", "w", "h"]
        header = checkpoint_files.safetensors_header(
            [(n, sd[n].dtype, tuple(sd[n].shape)) for n in order], {"format": "pt"})
        path.write_bytes(header + b"".join(sd[n].view(torch.uint8).numpy().tobytes()
                                           for n in order))
        paths.append(str(path))
    entry = checkpoint_files.open_checkpoint(paths[0], "client 0").entries["w"]
    assert entry.offset % 4 != 0
    written = aggregate_files(paths, [0.25, 0.75], out=tmp_path / "avg.safetensors",
                              chunk_bytes=SMALL_CHUNK)
    assert_same(read_result(written), fedkernels.aggregate(sds, [0.25, 0.75]))


def test_chunk_plan_covers_every_element_once():
    shapes = {"a": (5000,), "b": (1,), "c": (1023,), "d": (), "e": (0,), "f": (4096,)}
    dtypes = {"a": torch.float32, "b": torch.float16, "c": torch.bfloat16, "d": torch.float64,
              "e": torch.float32, "f": torch.int8}
    names = sorted(shapes, key=lambda n: -dtypes[n].itemsize)
    shards, _ = checkpoint_files._plan_shards("x.safetensors", names, dtypes, shapes, None, {})
    steps = checkpoint_files._plan_steps(shards, dtypes, dtypes, shapes, SMALL_CHUNK)
    covered = {n: [] for n in shapes}
    offset = shards[0].data_start
    for step in steps:
        assert step.file_offset == offset
        assert step.in_bytes <= SMALL_CHUNK + 64
        for p in step.pieces:
            covered[p.name].append((p.start, p.count))
            assert p.buffer_offset % 64 == 0
            assert p.out_offset % dtypes[p.name].itemsize == 0
        offset += step.out_bytes
    for name, ranges in covered.items():
        numel = torch.Size(shapes[name]).numel()
        assert sum(c for _, c in ranges) == numel
        assert [s for s, _ in ranges] == sorted(s for s, _ in ranges)


# ---------------------------------------------------------------- refusals


@pytest.fixture
def three_clients(tmp_path):
    return write_clients(tmp_path, make_state_dicts())


def refuses(tmp_path, match, paths, weights=(1, 1, 1), error=ValueError, **kwargs):
    """Calls aggregate_files expecting ``error``; checks that no output (nor a staging folder)
    was left behind."""
    before = folder_listing(tmp_path)
    kwargs.setdefault("out", tmp_path / "out.safetensors")
    with pytest.raises(error, match=match) as info:
        aggregate_files(paths, list(weights), **kwargs)
    assert "\n" not in str(info.value)
    assert folder_listing(tmp_path) == before
    return str(info.value)


def test_truncated_file_names_the_file_and_tensor(tmp_path, three_clients):
    path = Path(three_clients[1])
    path.write_bytes(path.read_bytes()[:-100])
    message = refuses(tmp_path, "truncated", three_clients)
    assert "client 1" in message and str(path) in message and "tensor '" in message


def test_damaged_headers(tmp_path, three_clients):
    path = Path(three_clients[2])
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 8 + data[8:])
    refuses(tmp_path, r"client 2: .*not a safetensors file", three_clients)
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    refuses(tmp_path, r"client 2: .*damaged safetensors header", three_clients)
    path.write_bytes(b"")
    refuses(tmp_path, r"not a safetensors file", three_clients)
    path.write_bytes(data.replace(b'"F32"', b'"X32"', 1))
    refuses(tmp_path, r"unknown dtype 'X32'", three_clients)


def test_mismatched_shapes_dtypes_and_names(tmp_path):
    sds = make_state_dicts()
    sds[1]["odd.bias"] = torch.randn(14)
    refuses(tmp_path, r"client 1 \(.*client1.safetensors\), tensor 'odd.bias' is "
                      r"torch.float32 \(14,\), client 0 .* has torch.float32 \(13,\)",
            write_clients(tmp_path, sds))
    sds = make_state_dicts()
    sds[2]["big.weight"] = sds[2]["big.weight"].double()
    refuses(tmp_path, r"client 2 .*, tensor 'big.weight' is torch.float64", write_clients(tmp_path, sds))
    sds = make_state_dicts()
    del sds[1]["scalar"]
    sds[1]["extra"] = torch.zeros(2)
    refuses(tmp_path, r"client 1 .* different tensors .*missing \['scalar'\].*unexpected "
                      r"\['extra'\]", write_clients(tmp_path, sds))


def test_base_must_match(tmp_path, three_clients):
    base = make_state_dicts(1)[0]
    base["half.weight"] = base["half.weight"].bfloat16()
    save_file(base, tmp_path / "base.safetensors")
    refuses(tmp_path, r"base .* tensor 'half.weight'.*bfloat16.*or float32", three_clients,
            base=tmp_path / "base.safetensors")


def test_unsupported_float_dtype(tmp_path):
    sds = [{"w": torch.zeros(4).to(torch.float8_e4m3fn)} for _ in range(2)]
    refuses(tmp_path, r"tensor 'w' has unsupported dtype torch.float8_e4m3fn",
            write_clients(tmp_path, sds), weights=(1, 1), error=TypeError)


def test_sharded_checkpoint_faults(tmp_path):
    sds = make_state_dicts(2)
    index = Path(write_sharded(tmp_path / "c0", sds[0]))
    other = write_clients(tmp_path, sds[1:])
    shard = tmp_path / "c0" / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.unlink()
    refuses(tmp_path, r"client 0: shard .*model-00002-of-00002.safetensors is missing",
            [index, *other], weights=(1, 1))
    shard.write_bytes(data[:-10])
    refuses(tmp_path, r"client 0: .*model-00002-of-00002.safetensors, tensor .*truncated",
            [index, *other], weights=(1, 1))
    shard.write_bytes(data)
    weight_map = json.loads(index.read_text())["weight_map"]
    moved = next(n for n, s in weight_map.items() if s == shard.name)
    weight_map[moved] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    refuses(tmp_path, rf"shard .*00001-of-00002.safetensors lacks tensor '{moved}'",
            [index, *other], weights=(1, 1))
    index.write_text("{}")
    refuses(tmp_path, r"has no 'weight_map'", [index, *other], weights=(1, 1))


def test_damaged_pt_file(tmp_path):
    paths = write_clients(tmp_path, make_state_dicts(2), suffix=".pt")
    Path(paths[1]).write_bytes(Path(paths[1]).read_bytes()[:200])
    refuses(tmp_path, r"client 1: cannot load .*client1.pt", paths, weights=(1, 1))
    torch.save([torch.zeros(2)], paths[1])
    refuses(tmp_path, r"client 1: .*client1.pt holds a list, not a state_dict", paths,
            weights=(1, 1))


def test_missing_file_and_folder_without_a_checkpoint(tmp_path, three_clients):
    refuses(tmp_path, r"client 1: .*nothere.safetensors does not exist",
            [three_clients[0], str(tmp_path / "nothere.safetensors"), three_clients[2]])
    (tmp_path / "empty").mkdir()
    refuses(tmp_path, r"client 0: folder .*empty holds no \*.safetensors", [tmp_path / "empty"],
            weights=(1,))


def test_output_exists_unless_overwrite(tmp_path, three_clients):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    refuses(tmp_path, r"exists; pass overwrite=True \(--overwrite\)", three_clients, out=out)
    assert out.read_bytes() == b"old"
    aggregate_files(three_clients, [1, 1, 1], out=out, overwrite=True)
    assert_same(load_file(out), fedkernels.aggregate(make_state_dicts(), [1, 1, 1]))


def test_output_equal_to_an_input_is_refused_even_with_overwrite(tmp_path, three_clients):
    refuses(tmp_path, r"is an input file", three_clients, out=three_clients[1], overwrite=True)
    link = tmp_path / "link.safetensors"
    link.symlink_to(three_clients[0])
    refuses(tmp_path, r"is an input file", three_clients, out=link, overwrite=True)


def test_bad_arguments(tmp_path, three_clients):
    refuses(tmp_path, r"got 3 clients but weights of shape \(2,\)", three_clients, weights=(1, 1))
    refuses(tmp_path, r"weights must be real numbers", three_clients, weights=(1, True, 1),
            error=TypeError)
    refuses(tmp_path, r"weights sum to 0", three_clients, weights=(1, -1, 0), normalize=True)
    refuses(tmp_path, r"out must be a .safetensors", three_clients, out=tmp_path / "x.pt")
    refuses(tmp_path, r"chunk_bytes must be an integer of at least 4096", three_clients,
            chunk_bytes=100)
    refuses(tmp_path, r"max_shard_bytes must be a positive integer", three_clients,
            max_shard_bytes=0)
    refuses(tmp_path, r"int_policy must be one of", three_clients, int_policy="mean")
    refuses(tmp_path, r"scale must be finite", three_clients, scale=float("inf"))
    refuses(tmp_path, r"weight of client 1 is 1e\+39, beyond the float32 range", three_clients,
            weights=(1, 1e39, 1))
    refuses(tmp_path, r"output folder .* does not exist", three_clients,
            out=tmp_path / "no" / "out.safetensors")
    refuses(tmp_path, r"no client files", [], weights=())
    refuses(tmp_path, r"files must be a list", three_clients[0], weights=(1,), error=TypeError)


# ---------------------------------------------------------------- never half-written


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError("disk full")])
def test_a_failure_mid_write_leaves_no_partial_output(tmp_path, three_clients, monkeypatch, stop):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous result")
    real_pwrite = checkpoint_files._pwrite_all
    calls = []

    def failing_pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise stop
        real_pwrite(fd, data, offset)

    monkeypatch.setattr(checkpoint_files, "_pwrite_all", failing_pwrite)
    before = folder_listing(tmp_path)
    with pytest.raises(type(stop) if isinstance(stop, BaseException) else stop):
        aggregate_files(three_clients, [1, 1, 1], out=out, overwrite=True,
                        chunk_bytes=SMALL_CHUNK)
    assert len(calls) == 3
    assert out.read_bytes() == b"previous result"
    assert folder_listing(tmp_path) == before  # no staging folder left


def test_a_failure_in_the_op_leaves_no_partial_sharded_output(tmp_path, three_clients,
                                                             monkeypatch):
    steps = []

    def failing_op(*args, **kwargs):
        steps.append(1)
        raise RuntimeError("op failed")

    monkeypatch.setattr(checkpoint_files.summation, "weighted_sum_out", failing_op)
    before = folder_listing(tmp_path)
    with pytest.raises(RuntimeError, match="op failed"):
        aggregate_files(three_clients, [1, 1, 1], out=tmp_path / "out.safetensors",
                        max_shard_bytes=30_000, chunk_bytes=SMALL_CHUNK)
    assert steps
    assert folder_listing(tmp_path) == before


# ---------------------------------------------------------------- the command


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(fedkernels.__file__).parent.parent)
               + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fedkernels.cli", "aggregate", *args],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    sds = make_state_dicts()
    paths = write_clients(tmp_path, sds)
    base = make_state_dicts(1, seed=3)[0]
    save_file(base, tmp_path / "base.safetensors")
    out = tmp_path / "new.safetensors"
    proc = run_cli(*paths, "--weights", "30", "50", "20", "--normalize", "--out", str(out),
                   "--base", str(tmp_path / "base.safetensors"), "--scale", "0.5",
                   "--chunk-size", "4KiB", "--max-shard-size", "50KB")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "shards" in proc.stdout
    expected = fedkernels.aggregate(sds, [30, 50, 20], normalize=True, base=base, scale=0.5)
    assert_same(read_result([str(tmp_path / "new.safetensors.index.json")]), expected)
    # an existing output: one line, exit status 2; --overwrite replaces it
    proc = run_cli(*paths, "--weights", "1", "1", "1", "--out", str(out),
                   "--max-shard-size", "none")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(*paths, "--weights", "1", "1", "1", "--out", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("fedkernels aggregate: error: the output")
    proc = run_cli(*paths, "--weights", "1", "1", "1", "--out", str(out), "--overwrite",
                   "--no-fsync")
    assert proc.returncode == 0, proc.stderr
    assert_same(load_file(out), fedkernels.aggregate(sds, [1, 1, 1]))


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--weights", "1"], "3 files but 1 weights"),
    (["--weights", "1", "1", "x"], "argument --weights: expected a number, got 'x'"),
    (["--weights", "1", "1", "1", "--chunk-size", "lots"], "expected a size such as 5GB"),
    (["--weights", "1", "1", "1", "--int-policy", "mean"], "argument --int-policy: invalid choice"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    paths = write_clients(tmp_path, make_state_dicts())
    proc = run_cli(*paths, *args, "--out", str(tmp_path / "o.safetensors"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("fedkernels aggregate: error: ")
    assert message in proc.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_cli_main_in_process(tmp_path, capsys):
    from fedkernels.cli import main

    sds = make_state_dicts(2)
    paths = write_clients(tmp_path, sds)
    out = tmp_path / "avg.safetensors"
    assert main(["aggregate", *paths, "--weights", "1", "3", "--normalize", "--out", str(out),
                 "--no-fsync"]) == 0
    assert_same(load_file(out), fedkernels.aggregate(sds, [1, 3], normalize=True))
    assert main(["aggregate", *paths, "--weights", "1", "3", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("fedkernels aggregate: error: the output")


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)
