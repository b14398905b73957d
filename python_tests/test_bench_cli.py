"""The benchmark scripts' command lines: a device this machine cannot run is a one-line error
(exit 2, no traceback), and a run writes a new file under bench/results/runs/ instead of the
committed bench/results/<device>.json unless --save is given.

The scripts are copied into a temporary folder, so their results land there and the
repository's bench/results/ is never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import copy_bench
from script_modules import load_script

from harness.machine import device_name

BENCH = Path(__file__).resolve().parent.parent / "bench"
DEVICE_SCRIPTS = [
    "bench_aggregate.py", "bench_distill.py", "bench_distill_kl.py", "bench_energy.py",
    "bench_sgld.py", "bench_superfed.py",
]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(script: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=script.parent)


def _cpu_name() -> str:
    return device_name(torch.device("cpu"))


@pytest.fixture
def bench_copy(tmp_path) -> Path:
    """bench/*.py in a fresh folder, with a committed results file holding a sentinel."""
    folder = copy_bench(tmp_path)
    committed = folder / "results" / f"{_cpu_name()}.json"
    committed.write_text(json.dumps({"aggregate": "committed table", "other": [1, 2]}) + "\n")
    return folder


def _runs(folder: Path) -> list[Path]:
    runs = folder / "results" / "runs"
    return sorted(runs.glob("*.json")) if runs.exists() else []


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("script", DEVICE_SCRIPTS)
def test_cuda_without_a_gpu_is_one_line_exit_2(script):
    proc = _run(BENCH / script, "--device", "cuda", timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "AssertionError" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}: error: --device cuda but no CUDA GPU is visible")
    assert proc.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("script", DEVICE_SCRIPTS)
def test_unknown_device_is_one_line_exit_2(script):
    proc = _run(BENCH / script, "--device", "tpu0", timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "tpu0" in proc.stderr


@pytest.mark.slow
def test_cpu_only_benchmark_refuses_a_gpu_in_one_line():
    # subnormals cost assists on CPUs only: a GPU run would time nothing the name promises
    proc = _run(BENCH / "bench_subnormals.py", "--device", "cuda", "--tiny", timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "invalid choice: 'cuda'" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_aggregate_runs_go_to_new_files_and_save_merges(bench_copy):
    committed = bench_copy / "results" / f"{_cpu_name()}.json"
    before = committed.read_text()
    for _ in range(2):
        proc = _run(bench_copy / "bench_aggregate.py", "--tiny")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = _runs(bench_copy)
    assert len(runs) == 2 and runs[0] != runs[1]
    assert committed.read_text() == before  # the committed table is untouched
    for path in runs:
        data = json.loads(path.read_text())
        assert {r["model"] for r in data["aggregate"]["rows"]} == {"tiny"}
        assert path.name.endswith(f"-{_cpu_name()}-aggregate.json")

    proc = _run(bench_copy / "bench_aggregate.py", "--tiny", "--save")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = json.loads(committed.read_text())
    assert merged["other"] == [1, 2]  # other benchmarks' entries are kept
    assert merged["aggregate"]["rows"][0]["model"] == "tiny"
    assert len(_runs(bench_copy)) == 3


@pytest.mark.slow
def test_out_writes_exactly_there(bench_copy, tmp_path):
    out = tmp_path / "elsewhere" / "agg.json"
    proc = _run(bench_copy / "bench_aggregate.py", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "aggregate" in json.loads(out.read_text())
    assert _runs(bench_copy) == []
    proc = _run(bench_copy / "bench_aggregate.py", "--tiny", "--out", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script,key", [("bench_distill.py", "ensemble_pseudo_labels"),
                                        ("bench_distill_kl.py", "distill_kl"),
                                        ("bench_energy.py", "energy_from_logits"),
                                        ("bench_sgld.py", "sgld_compose_step"),
                                        ("bench_small_calls.py", "small_calls"),
                                        ("bench_subnormals.py", "subnormals"),
                                        ("bench_quantized.py", "quantized"),
                                        ("bench_sparse.py", "sparse"),
                                        ("bench_secagg.py", "secagg")])
def test_other_benchmarks_write_runs_not_the_committed_file(bench_copy, script, key):
    committed = bench_copy / "results" / f"{_cpu_name()}.json"
    before = committed.read_text()
    proc = _run(bench_copy / script, "--tiny")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = _runs(bench_copy)
    assert json.loads(run.read_text())[key]["rows"]
    assert committed.read_text() == before


@pytest.mark.slow
def test_small_calls_busy_phase_times_every_case_and_stops_its_spinners(bench_copy):
    proc = _run(bench_copy / "bench_small_calls.py", "--tiny", "--busy", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = _runs(bench_copy)
    rows = json.loads(run.read_text())["small_calls"]["rows"]
    # 29 ops and torch.add, then 6 steps with a gradient, each with its PyTorch step
    assert len(rows) == 30 + 2 * 6 and all({"quiet", "busy"} <= set(r) for r in rows)
    assert all(r[p]["median_us"] > 0 for r in rows for p in ("quiet", "busy"))
    steps = [r for r in rows if r["case"].startswith("with grad: ")]
    assert len(steps) == 6 and all(r[p]["torch_over_fused"] > 0 for r in steps
                                   for p in ("quiet", "busy"))
    assert not _spinners(), "a spinning process outlived the benchmark"


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [(["--repeats", "0"], "--repeats must be at least 1"),
                                          (["--busy", "-1"], "--busy must be 0 or more")])
def test_small_calls_refuses_bad_counts(args, message):
    proc = _run(BENCH / "bench_small_calls.py", *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# A bad count, size, name or tolerance: argparse's one-line error and exit status 2 before
# any work, not a traceback minutes later (a ZeroDivisionError from a 0-byte probe, an empty
# median from 0 repeats, a ValueError from a negative tolerance once the run is over), nor an
# empty run that --save would merge over the committed results (an unknown model or case).
BAD_ARGUMENTS = [
    ("bench_aggregate.py", ["--dtypes", "int8"], "argument --dtypes: invalid choice: 'int8'"),
    ("bench_aggregate.py", ["--clients", "0"], "argument --clients: must be at least 1, got 0"),
    ("bench_aggregate.py", ["--repeats", "0"], "argument --repeats: must be at least 1"),
    ("bench_aggregate.py", ["--probe-bytes", "0"], "argument --probe-bytes: must be at least"),
    ("bench_aggregate.py", ["--skip", "fused"], "argument --skip: invalid choice: 'fused'"),
    ("bench_aggregate.py", ["--skip", "lop"], "argument --skip: invalid choice: 'lop'"),
    ("bench_aggregate.py", ["--check", "--tolerance", "-1"],
     "argument --tolerance: must be a finite number >= 0"),
    ("bench_energy.py", ["--tiny", "--probe-bytes", "0"], "argument --probe-bytes"),
    ("bench_energy.py", ["--check", "--tolerance", "nan"], "argument --tolerance"),
    ("bench_distill.py", ["--repeats", "0"], "argument --repeats: must be at least 1"),
    ("bench_cost_curve.py", ["--sizes", "0"], "argument --sizes: must be at least 2"),
    ("bench_cost_curve.py", ["--clients", "0"], "argument --clients: must be at least 1"),
    ("bench_cost_curve.py", ["--worlds", "0"], "argument --worlds: must be at least 1"),
    ("bench_cost_curve.py", ["--tiny", "--repeats", "0"], "argument --repeats"),
    ("bench_cost_curve.py", ["--max-input-gib", "0"], "argument --max-input-gib"),
    ("bench_superfed.py", ["--models", "resnet"], "argument --models: invalid choice"),
    ("bench_superfed.py", ["--batch", "0"], "argument --batch: must be at least 1"),
    ("bench_robust_ops.py", ["--ks", "0"], "argument --ks: must be at least 3"),
    ("bench_robust_ops.py", ["--cases", "medain"], "argument --cases: unknown case 'medain'"),
    ("bench_robust_ops.py", ["--repeats", "0"], "argument --repeats: must be at least 1"),
    ("bench_vmap.py", ["--threads", "0"], "argument --threads: must be at least 1"),
    ("bench_vmap.py", ["--hidden", "0"], "argument --hidden: must be at least 1"),
    ("bench_personalized_eval.py", ["--clients", "0"], "argument --clients: must be at least 1"),
    ("bench_personalized_eval.py", ["--max-rows", "0"], "argument --max-rows: must be at least 1"),
    ("bench_serial_threshold.py", ["--max-mib", "0"], "argument --max-mib: must be at least 1"),
    ("bench_sgld.py", ["--max-elements", "0"], "argument --max-elements: must be at least 1"),
    ("compare_strategies.py", ["--seeds", "0,x"], "argument --seeds: expected comma-separated"),
    ("compare_strategies.py", ["--threads", "0"], "argument --threads: must be at least 1"),
    ("bench_fedlab.py", ["--repeats", "0"], "argument --repeats: must be at least 1"),
    ("bench_nvflare.py", ["--threads", "0"], "argument --threads: must be at least 1"),
    ("bench_fedml.py", ["--repeats", "0"], "argument --repeats: must be at least 1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,args,message", BAD_ARGUMENTS,
                         ids=[f"{s}{' '.join(a)}" for s, a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_exit_2_before_any_work(tmp_path, script, args, message):
    proc = _run(BENCH / script, *args, "--out", str(tmp_path / "out.json"), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_aggregate.py", "bench_cost_curve.py",
                                    "bench_energy.py", "bench_subnormals.py"])
def test_check_without_committed_results_is_refused_before_the_run(tmp_path, script):
    """The comparison's missing file found first, not after the minutes of a full run."""
    folder = copy_bench(tmp_path)  # results/ is empty
    proc = _run(folder / script, "--check", "--out", str(tmp_path / "out.json"), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: --check: no committed")
    assert "run once with --save" in lines[0] and proc.stdout == ""
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_framework_comparisons_write_to_out_instead_of_the_committed_file(tmp_path):
    """bench_flower.py and bench_robust.py merged every run into bench/results/, with no
    way to send a trial run elsewhere."""
    pytest.importorskip("flwr")
    folder = copy_bench(tmp_path)
    out = tmp_path / "flower.json"
    proc = _run(folder / "bench_flower.py", "--quick", "--no-memory", "--strategies", "FedAvg",
                "--cases", "resnet18:10", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["strategy"] for r in json.loads(out.read_text())["rows"]] == ["FedAvg"]
    assert list((folder / "results").iterdir()) == []
    for script in ("bench_flower.py", "bench_robust.py", "bench_fedlab.py", "bench_nvflare.py",
                   "bench_fedml.py"):
        proc = _run(folder / script, "--out", str(tmp_path), timeout=120)
        assert proc.returncode == 2 and "is a directory" in proc.stderr, proc.stderr
    proc = _run(folder / "bench_robust.py", "--memory-only", "--out", str(tmp_path / "no.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_fedml_benchmark_without_fedmls_files_is_one_line_exit_2(tmp_path):
    """bench_fedml.py times FedML's own code: without the wheel's files (here a fedml package
    that shadows the installed one and lacks them) it says so, before any work."""
    fake = tmp_path / "site" / "fedml"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake.parent),
                                                      env.get("PYTHONPATH", "")]))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_fedml.py"), "--quick", "--out",
                           str(out)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=BENCH)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_fedml.py: error: FedML's"), proc.stderr
    assert "pip install --no-deps fedml==0.9.6" in lines[0]
    assert proc.stdout == "" and not out.exists()


@pytest.mark.slow
def test_small_calls_spinners_stop_when_the_benchmark_is_killed(tmp_path):
    """SIGTERM or SIGKILL skips the finally that stops the spinners; they stop by themselves
    when their parent is gone, instead of holding every core for an hour."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        before = set(_spinners())
        proc = subprocess.Popen([sys.executable, str(BENCH / "bench_small_calls.py"), "--busy",
                                 "1", "--repeats", "2000", "--out", str(tmp_path / "o.json")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
        try:
            deadline = time.monotonic() + 120
            while set(_spinners()) <= before and time.monotonic() < deadline:
                assert proc.poll() is None, "the benchmark ended before its busy phase"
                time.sleep(0.05)
            assert set(_spinners()) - before, "no spinner started"
        finally:
            proc.send_signal(sig)
            proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while set(_spinners()) - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not set(_spinners()) - before, f"a spinner outlived the benchmark ({sig.name})"


def _spinners() -> list[str]:
    """``pid: command line`` of running processes that look like bench_small_calls' spinners
    (with the pid: two spinners have the same command line)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "while time.time() - t < 3600" in cmdline:
            found.append(f"{entry.parent.name}: {cmdline}")
    return found


# ---------------------------------------------------------------- bench/gpu_validate.sh

GPU_VALIDATE = BENCH / "gpu_validate.sh"


def _validate(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = _env()
    env["PYTHON"] = python
    return subprocess.run(["bash", str(GPU_VALIDATE), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=BENCH.parent)


needs_no_gpu = pytest.mark.skipif(
    torch.cuda.is_available() and torch.version.cuda is not None,
    reason="the refusal path needs a machine without a GPU")


@pytest.mark.slow
@needs_no_gpu
def test_gpu_validate_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "validation"
    proc = _validate(str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_validate: refused: "), proc.stderr
    assert ("CPU-only build" in lines[0]) == (torch.version.cuda is None)
    assert not out.exists()


@pytest.mark.slow
def test_gpu_validate_refuses_without_a_python_that_imports_torch(tmp_path):
    proc = _validate(str(tmp_path / "v"), python="/bin/false")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_validate: refused: /bin/false cannot import torch"
    proc = _validate("--bogus")
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr


@pytest.mark.slow
@needs_no_gpu
def test_gpu_validate_dry_run_shows_every_step(tmp_path):
    out = tmp_path / "validation"
    proc = _validate(str(out), "--dry-run")
    plan = proc.stdout
    assert f"FEDKERNELS_CUDA=1 MAX_JOBS=16 {sys.executable} setup.py build_ext --inplace" in plan
    assert f"-m fedkernels.cli check --json {out}/check.json" in plan
    assert "-m pytest python_tests -m cuda" in plan
    # every benchmark with a --device flag runs on the GPU, into the output folder, except the
    # ones that time something only CPUs have
    for script in sorted(BENCH.glob("bench_*.py")):
        text = script.read_text()
        cpu_only = "cpu_only=True" in text
        if ('"--device"' in text or "add_case_arguments(" in text) and not cpu_only:
            lines = [ln for ln in plan.splitlines() if f"bench/{script.name} --device cuda" in ln]
            assert lines and f"--out {out}/" in lines[0], script.name
    assert f"bench/gpu_profile.py --out {out}" in plan  # one ncu profile of every kernel
    assert "--tool memcheck" in plan and "check --quick --device cuda" in plan
    assert "python_tests/test_weighted_sum_op.py" in plan and '-m not cuda' in plan
    assert proc.returncode == 2 and "refused" in proc.stderr  # then this machine is refused
    assert not out.exists()


def test_tests_needing_flwr_or_expecttest_skip_without_them():
    """The GPU machines lack flwr and expecttest: a test file that imports either at module
    level must importorskip it first, or the whole CUDA test run fails to collect."""
    import ast

    for path in sorted((BENCH.parent / "python_tests").glob("test_*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for top in {n.split(".")[0] for n in names} & {"flwr", "expecttest"}:
                assert f'importorskip("{top}")' in text, f"{path.name} imports {top} directly"


def _gpu_profile():
    return load_script(BENCH / "gpu_profile.py")


def test_gpu_profile_reads_ncu_raw_csv():
    """The summary of `ncu --csv --page raw --print-units base --nvtx`: the log lines before the
    table and the units row are skipped, kernel names lose their namespaces and arguments, each
    launch keeps the NVTX case it ran in, thousands separators are read."""
    gp = _gpu_profile()
    metrics = list(gp.METRICS)
    header = ["ID", "Process ID", "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:"
              "Msg_Type:Msg", "Kernel Name", *metrics]
    units = ["", "", "", "", *(["nsecond"] + ["byte"] * 2 + ["%"] * 3 + ["register/thread", "", ""])]
    row = ["0", "1429", '1429  "<default domain>:weighted_sum fp32 K=10:none:none"',
           "void fedkernels::<unnamed>::weighted_sum_kernel<float, float, 0, 0>(Meta<float>)",
           "126,400", "500000000", "11000000", "84.1", "35.2", "37.5", "80", "5,744", "256"]
    text = "\n".join(["==PROF== Connected to process 1", "profiled 1 cases",
                      *(",".join('"' + c.replace('"', '""') + '"' for c in line)
                        for line in (header, units, row))])
    (got,) = gp.summarize(text)
    assert got["kernel"] == "weighted_sum_kernel<float, float, 0, 0>"
    assert got["case"] == "weighted_sum fp32 K=10"
    assert got["duration"] == 126400 and got["grid"] == 5744 and got["registers"] == 80
    table = gp.markdown([got])
    assert "| weighted_sum fp32 K=10 | weighted_sum_kernel<float, float, 0, 0> | 126.4 | 511.0 | 84 |" \
        in table


@pytest.mark.slow
def test_gpu_validate_names_the_test_a_crash_happened_in(tmp_path):
    """After a fatal signal in `pytest -m cuda`, gpu_validate.sh runs the suite again without
    the test faulthandler's traceback points at; an ordinary failure names none."""
    script = (BENCH / "gpu_validate.sh").read_text()
    start = script.index("crashed_test() {")
    function = script[start:script.index("\n}\n", start) + 3]
    crash = tmp_path / "crash.log"
    crash.write_text(
        "....Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "/x/torch/_ops.py", line 865 in __call__\n'
        '  File "/x/python_tests/test_aggregate_errors.py", line 189 in _raise\n'
        '  File "/x/python_tests/test_aggregate_errors.py", line 478 in test_cuda_mismatch\n')
    failure = tmp_path / "failure.log"
    failure.write_text('Traceback:\n  File "/x/python_tests/test_a.py", line 3, in test_b\n'
                       "python_tests/test_a.py:3: AssertionError\n1 failed\n")
    for log, want in ((crash, "test_cuda_mismatch"), (failure, "")):
        proc = subprocess.run(["bash", "-c", f'{function}\ncrashed_test "$1"', "-", str(log)],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and proc.stdout.strip() == want, proc


def test_gpu_validate_leaves_out_only_test_files_missing_an_installed_package(tmp_path):
    """The suite's own modules (python_tests/, and bench/ with its package harness, which pytest
    puts on the path) are not missing packages: only a test file importing a package that is
    not installed, without importorskip, is left out of the CUDA run."""
    script = (BENCH / "gpu_validate.sh").read_text()
    start = script.index("ignored_test_files() {")
    function = script[start:script.index("\n}\n", start) + 3]
    tests, bench = tmp_path / "python_tests", tmp_path / "bench"
    (bench / "harness").mkdir(parents=True)
    tests.mkdir()
    (bench / "harness" / "__init__.py").write_text("")
    (bench / "bench_shapes.py").write_text("")
    (tests / "conftest.py").write_text("")
    (tests / "test_own.py").write_text(
        "import json\nimport bench_shapes\nfrom conftest import x\nfrom harness import timing\n")
    (tests / "test_missing.py").write_text("import no_such_package_here.sub\n")
    (tests / "test_skips.py").write_text(
        'import pytest\npytest.importorskip("no_such_package_here")\nimport no_such_package_here\n')
    proc = subprocess.run(["bash", "-c", f'PY="$2"\n{function}\nignored_test_files', "-",
                           str(tmp_path), sys.executable],
                          capture_output=True, text=True, timeout=60,
                          env=dict(_env(), REPO=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["python_tests/test_missing.py\tno_such_package_here"]
