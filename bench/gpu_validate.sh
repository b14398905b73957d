#!/usr/bin/env bash
# One command to validate fedkernels on a GPU machine: build the CUDA kernels in place against
# the installed torch, run the self-check, the CUDA tests, the GPU benchmarks and a memory check
# of every op, and put every log, every results JSON and a summary.md into one folder, in under
# 10 minutes.
#
#   bash bench/gpu_validate.sh [OUTDIR] [--no-build] [--dry-run]
#
#   OUTDIR      where everything goes (default: bench/results/runs/gpu-validate-<UTC time>)
#   --no-build  use the libraries already built in the source tree
#   --dry-run   print the plan and check the machine, run nothing, write nothing
#
# Needs a visible NVIDIA GPU, nvcc, and a CUDA build of torch in $PYTHON (default: the first
# of python3, python that imports torch); no network. Without them it refuses with one line
# and exit status 2, before writing anything. Exit status 1 when a step fails or runs out of
# its time box, 0 when every step passes.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOTAL_BUDGET_S=${GPU_VALIDATE_BUDGET_S:-570}  # the whole run, builds included
START=$(date +%s)
DEADLINE=$((START + TOTAL_BUDGET_S))

OUTDIR=""
DRY_RUN=0
BUILD=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_validate: error: unknown option $arg (see --help)" >&2; exit 2 ;;
    *)
      if [[ -n "$OUTDIR" ]]; then
        echo "gpu_validate: error: one OUTDIR only (got $OUTDIR and $arg)" >&2; exit 2
      fi
      OUTDIR="$arg" ;;
  esac
done
if [[ -z "$OUTDIR" ]]; then
  OUTDIR="$REPO/bench/results/runs/gpu-validate-$(date -u +%Y%m%dT%H%M%SZ)"
fi

refuse() {
  echo "gpu_validate: refused: $*" >&2
  exit 2
}

# ---------------------------------------------------------------- the machine

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
      PY="$(command -v "$candidate")"
      break
    fi
  done
fi

NVCC="$(command -v nvcc 2>/dev/null || true)"
if [[ -z "$NVCC" && -n "${CUDA_HOME:-}" && -x "${CUDA_HOME}/bin/nvcc" ]]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi

# ---------------------------------------------------------------- steps

STEPS=()      # summary rows
IGNORED=()    # test files left out of the pytest run
CRASHED=""    # the test a crashed pytest run was in
FAILED=0

step() {  # step NAME BOX_SECONDS LOG_FILE COMMAND...: one time-boxed step, logged
  local name="$1" box="$2" log="$3"
  shift 3
  if [[ $DRY_RUN == 1 ]]; then
    printf '  %-22s time box %4ss  %s\n' "$name" "$box" "$*"
    return 0
  fi
  local left=$((DEADLINE - $(date +%s) - 10))
  local limit=$((box < left ? box : left))
  if ((limit < 15)); then
    STEPS+=("| $name | skipped: out of time | 0 | |")
    FAILED=1
    return 1
  fi
  echo "[$(($(date +%s) - START)) s] $name (time box ${limit} s): $*" | tee -a "$OUTDIR/steps.log"
  local t0=$(date +%s)
  (cd "$REPO" && timeout --kill-after=10 "$limit" "$@") >"$OUTDIR/$log" 2>&1
  local rc=$?
  local took=$(($(date +%s) - t0))
  local status="ok"
  if ((rc == 124 || rc == 137)); then
    status="TIMEOUT after ${limit} s"
  elif ((rc != 0)); then
    status="FAILED (exit $rc)"
  fi
  [[ $status == ok ]] || FAILED=1
  echo "  -> $status in ${took} s (log: $log)" | tee -a "$OUTDIR/steps.log"
  STEPS+=("| $name | $status | $took | [$log]($log) |")
  return $rc
}

skip() {  # skip NAME WHY
  STEPS+=("| $1 | skipped: $2 | 0 | |")
  FAILED=1
}

# Test files that import an optional package at module level which is missing here, without
# pytest.importorskip: left out of the pytest run (and listed in the summary) instead of
# failing the whole collection. The suite's own modules (python_tests/ and bench/, which
# pytest puts on the path) are not packages to install.
ignored_test_files() {
  "$PY" - "$REPO/python_tests" <<'EOF'
import ast, importlib.util, pathlib, sys
folder = pathlib.Path(sys.argv[1])
own = {p.stem for d in (folder, folder.parent / "bench") if d.is_dir() for p in d.iterdir()
       if p.suffix == ".py" or (p / "__init__.py").is_file()}
for path in sorted(folder.glob("test_*.py")):
    text = path.read_text()
    missing = set()
    for node in ast.parse(text).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if (top not in own and importlib.util.find_spec(top) is None
                    and f'importorskip("{top}")' not in text):
                missing.add(top)
    if missing:
        print(f"{path.relative_to(folder.parent)}\t{', '.join(sorted(missing))}")
EOF
}

# The test a crashed pytest run was in: the innermost test function of the Python traceback
# that faulthandler prints on a fatal signal (empty when the run did not crash).
crashed_test() {
  grep -oE 'python_tests/test_[A-Za-z0-9_]+\.py", line [0-9]+ in test_[A-Za-z0-9_]+' "$1" 2>/dev/null \
    | head -n 1 | sed -E 's/.* in //'
}

# ---------------------------------------------------------------- CUDA sanitizers (racecheck, initcheck)
# GPU_VALIDATE_SANITIZERS=1 adds two runs of the CUDA op tests under compute-sanitizer, after
# the memcheck run of the self-check in plan(): racecheck (shared-memory hazards between the
# threads of a block) and initcheck (reads of device memory nothing wrote). They are slow, so they are
# opt-in and get a time budget of their own, GPU_VALIDATE_SANITIZER_BUDGET_S (default 480 s),
# on top of the run's. Only fedkernels' kernels are checked (--kernel-name kns=fedkernels: every
# kernel of csrc/cuda/ lives in that namespace), so torch's own kernels neither slow the run nor
# report. Exit status 86 of a step means a sanitizer report; see docs/guide/sanitizers.md.
SANITIZERS="${GPU_VALIDATE_SANITIZERS:-0}"
if [[ $SANITIZERS == 1 ]]; then
  DEADLINE=$((DEADLINE + ${GPU_VALIDATE_SANITIZER_BUDGET_S:-480}))
fi
SANITIZER_TESTS=(python_tests/test_weighted_sum_op.py python_tests/test_aggregate.py
  python_tests/test_robust_ops.py python_tests/test_private_api.py python_tests/test_superfed_ops.py
  python_tests/test_sgld_ops.py python_tests/test_distill_ops.py python_tests/test_misaligned_inputs.py
  python_tests/test_written_tensors.py)

sanitizer_plan() {
  [[ $SANITIZERS == 1 ]] || return 0
  local pyname="${PY:-python}" sanitizer
  sanitizer="$(command -v compute-sanitizer 2>/dev/null || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  if [[ $DRY_RUN == 0 && ! -x "$sanitizer" ]]; then
    skip "racecheck" "compute-sanitizer not found"
    skip "initcheck" "compute-sanitizer not found"
    return 0
  fi
  # torch.compile tests are left out: compiling under the sanitizer costs minutes and checks
  # no kernel of ours that the eager tests do not.
  local common=(--error-exitcode 86 --print-limit 30 --kernel-name kns=fedkernels)
  local tests=("$pyname" -m pytest "${SANITIZER_TESTS[@]}" -m cuda -q -p no:cacheprovider
    -k "not compile")
  # racecheck: every shared-memory access pair of a block (hazards, and the analysis of each)
  step "racecheck" 240 sanitizer_racecheck.log "$sanitizer" --tool racecheck --racecheck-report all \
    "${common[@]}" "${tests[@]}"
  # initcheck: without torch's caching allocator every tensor is a fresh cudaMalloc, so a read of
  # memory that a freed tensor once wrote is not mistaken for an initialized one
  step "initcheck" 240 sanitizer_initcheck.log env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" \
    --tool initcheck "${common[@]}" "${tests[@]}"
}

sanitizer_summary() {
  local log
  for log in racecheck initcheck; do
    if [[ -f "$OUTDIR/sanitizer_$log.log" ]]; then
      echo
      echo "## compute-sanitizer ($log) over the CUDA op tests"
      echo
      echo '```'
      grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^(FAILED|ERROR) ' "$OUTDIR/sanitizer_$log.log" | head -n 20
      tail -n 1 "$OUTDIR/sanitizer_$log.log"
      echo '```'
    fi
  done
}
# ---------------------------------------------------------------- end of the CUDA sanitizers

plan() {
  # Order: build, the self-check (every op on the GPU against the reference: the correctness
  # gate), the headline benchmark, the CUDA tests, the other benchmarks. A step that would
  # start past the overall deadline is skipped and reported.
  local pyname="${PY:-python}"
  local jobs="${MAX_JOBS:-16}"
  if [[ $BUILD == 1 ]]; then
    if ! step "build" 330 build.log env FEDKERNELS_CUDA=1 MAX_JOBS="$jobs" "$pyname" setup.py build_ext --inplace; then
      skip "the rest" "the build failed"
      return
    fi
  fi
  if [[ $DRY_RUN == 0 ]] && ! compgen -G "$REPO/fedkernels/_cuda*.so" >/dev/null; then
    STEPS+=("| CUDA library | FAILED: no fedkernels/_cuda*.so in the source tree | 0 | |")
    FAILED=1
  fi
  step "fedkernels check" 90 check.log "$pyname" -m fedkernels.cli check --json "$OUTDIR/check.json"
  step "bench_aggregate" 180 bench_aggregate.log "$pyname" bench/bench_aggregate.py --device cuda \
    --models resnet18 lora transformer --out "$OUTDIR/bench_aggregate.json" \
    || step "bench_aggregate --quick" 60 bench_aggregate_quick.log "$pyname" bench/bench_aggregate.py \
      --device cuda --quick --out "$OUTDIR/bench_aggregate_quick.json"
  local ignores=()
  if [[ $DRY_RUN == 1 ]]; then
    echo "  (test files importing a missing optional package without importorskip are left out)"
  else
    while IFS=$'\t' read -r file mods; do
      [[ -n "$file" ]] || continue
      ignores+=("--ignore=$file")
      IGNORED+=("$file (needs $mods)")
    done < <(ignored_test_files)
  fi
  if ! step "pytest -m cuda" 200 pytest_cuda.log "$pyname" -m pytest python_tests -m cuda -q -rs \
    -p no:cacheprovider --junitxml="$OUTDIR/pytest_cuda.xml" ${ignores[@]+"${ignores[@]}"}; then
    # A crash (segmentation fault, abort) ends the whole run at one test: run the others
    # without it, so that one crash does not hide the rest of the suite.
    local crashed
    crashed="$(crashed_test "$OUTDIR/pytest_cuda.log")"
    if [[ -n "$crashed" ]]; then
      CRASHED="$crashed"
      step "pytest -m cuda, not $crashed" 150 pytest_cuda_rest.log "$pyname" -m pytest python_tests \
        -m cuda -q -rs -p no:cacheprovider -k "not $crashed" ${ignores[@]+"${ignores[@]}"}
    fi
  fi
  # The GPU hosts are the AVX-512 machines this project gets: the CPU op tests there run the
  # AVX-512 build (the best for the host) and compare every CPU build's bits.
  step "CPU op tests" 150 pytest_cpu_ops.log "$pyname" -m pytest python_tests/test_weighted_sum_op.py \
    python_tests/test_sgld_ops.py python_tests/test_distill_ops.py python_tests/test_robust_ops.py \
    python_tests/test_misaligned_inputs.py -m "not cuda" -q -rs -p no:cacheprovider
  step "bench_distill" 60 bench_distill.log "$pyname" bench/bench_distill.py --device cuda \
    --out "$OUTDIR/bench_distill.json"
  step "bench_energy" 30 bench_energy.log "$pyname" bench/bench_energy.py --device cuda \
    --out "$OUTDIR/bench_energy.json"
  step "bench_distill_kl" 30 bench_distill_kl.log "$pyname" bench/bench_distill_kl.py \
    --device cuda --out "$OUTDIR/bench_distill_kl.json"
  step "bench_sgld" 45 bench_sgld.log "$pyname" bench/bench_sgld.py --device cuda \
    --out "$OUTDIR/bench_sgld.json"
  step "bench_superfed" 60 bench_superfed.log "$pyname" bench/bench_superfed.py --device cuda \
    --out "$OUTDIR/bench_superfed.json"
  step "bench_robust_ops" 45 bench_robust_ops.log "$pyname" bench/bench_robust_ops.py \
    --device cuda --out "$OUTDIR/bench_robust_ops.json"
  step "bench_quantized" 30 bench_quantized.log "$pyname" bench/bench_quantized.py \
    --device cuda --out "$OUTDIR/bench_quantized.json"
  step "bench_sparse" 30 bench_sparse.log "$pyname" bench/bench_sparse.py \
    --device cuda --out "$OUTDIR/bench_sparse.json"
  # Out-of-bounds and misaligned device accesses: every op on small inputs of every dtype
  # (the self-check's CUDA half) under compute-sanitizer's memcheck.
  local sanitizer
  sanitizer="$(command -v compute-sanitizer 2>/dev/null || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  if [[ $DRY_RUN == 1 || -x "$sanitizer" ]]; then
    step "compute-sanitizer" 120 sanitizer.log "$sanitizer" --tool memcheck --error-exitcode 1 \
      --print-limit 30 "$pyname" -m fedkernels.cli check --quick --device cuda
  else
    skip "compute-sanitizer" "compute-sanitizer not found"
  fi
  if [[ $DRY_RUN == 1 ]] || command -v ncu >/dev/null 2>&1 || [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/ncu" ]]; then
    step "ncu profile" 90 ncu.log env PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin" "$pyname" bench/gpu_profile.py \
      --out "$OUTDIR"
  else
    skip "ncu profile" "ncu (Nsight Compute) not found"
  fi
  sanitizer_plan
}

if [[ $DRY_RUN == 1 ]]; then
  echo "gpu_validate: plan (dry run; nothing is run or written), into $OUTDIR:"
  plan
fi

# ---------------------------------------------------------------- refuse early, write nothing

[[ -n "$PY" ]] || refuse "no python that imports torch (tried python3, python; set PYTHON=...)"
INFO="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none", int(torch.cuda.is_available()))' 2>/dev/null)" \
  || refuse "$PY cannot import torch"
read -r TORCH_VERSION TORCH_CUDA GPU_VISIBLE <<<"$INFO"
[[ "$TORCH_CUDA" != none ]] || refuse "torch $TORCH_VERSION ($PY) is a CPU-only build; this needs a CUDA build of torch, nvcc and a GPU"
[[ "$GPU_VISIBLE" == 1 ]] || refuse "no CUDA GPU is visible to torch $TORCH_VERSION (CUDA $TORCH_CUDA); run this on a GPU machine"
[[ -n "$NVCC" ]] || refuse "nvcc not found (not on PATH, not in \$CUDA_HOME/bin or /usr/local/cuda/bin); the CUDA kernels are built from source"

if [[ $DRY_RUN == 1 ]]; then
  echo "gpu_validate: this machine can run it (torch $TORCH_VERSION, CUDA $TORCH_CUDA, nvcc $NVCC)"
  exit 0
fi

# ---------------------------------------------------------------- run

if [[ -z "${CUDA_HOME:-}" ]]; then
  # the toolkit folder of this nvcc; torch's own guess (/usr/local for /usr/local/bin/nvcc) can
  # lack the headers and libraries, so prefer a folder that has them
  CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$NVCC")")")"
  if [[ ! -f "$CUDA_HOME/include/cuda_runtime.h" && -f /usr/local/cuda/include/cuda_runtime.h ]]; then
    CUDA_HOME=/usr/local/cuda
  fi
fi
export CUDA_HOME
export PATH="$(dirname "$NVCC"):$PATH"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build
mkdir -p "$OUTDIR" || refuse "cannot create $OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
  echo "python: $PY ($("$PY" -c 'import platform; print(platform.python_version())'))"
  echo "torch: $TORCH_VERSION, CUDA $TORCH_CUDA"
  echo "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*' || true))"
  echo "CUDA_HOME: $CUDA_HOME"
  echo "TORCH_CUDA_ARCH_LIST: ${TORCH_CUDA_ARCH_LIST:-unset, so built for the visible GPU}"
  echo "cores: $(nproc)"
  nvidia-smi 2>/dev/null || echo "nvidia-smi: not available"
} >"$OUTDIR/environment.txt" 2>&1

echo "gpu_validate: torch $TORCH_VERSION, CUDA $TORCH_CUDA, nvcc $NVCC; writing to $OUTDIR"
plan

# ---------------------------------------------------------------- summary.md

{
  echo "# fedkernels GPU validation"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - START)) s in all."
  echo
  echo '```'
  head -n 8 "$OUTDIR/environment.txt"
  "$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu: {p.name}, sm {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB")' 2>/dev/null
  echo '```'
  echo
  echo "| step | status | seconds | log |"
  echo "|---|---|---|---|"
  printf '%s\n' ${STEPS[@]+"${STEPS[@]}"}
  if ((${#IGNORED[@]})); then
    echo
    echo "Test files left out (an optional package is missing and they do not importorskip it):"
    printf -- '- %s\n' ${IGNORED[@]+"${IGNORED[@]}"}
  fi
  if [[ -f "$OUTDIR/check.log" ]]; then
    echo
    echo "## fedkernels check"
    echo
    echo '```'
    cat "$OUTDIR/check.log"
    echo '```'
  fi
  for log in pytest_cuda pytest_cuda_rest pytest_cpu_ops; do
    if [[ -f "$OUTDIR/$log.log" ]]; then
      echo
      case $log in
        pytest_cuda) echo "## pytest -m cuda" ;;
        pytest_cuda_rest) echo "## pytest -m cuda, not $CRASHED (it crashed the run above)" ;;
        *) echo "## CPU op tests (this host's CPU builds)" ;;
      esac
      echo
      echo '```'
      grep -E '^(FAILED|ERROR|SKIPPED)|Fatal Python error' "$OUTDIR/$log.log" | head -n 40
      tail -n 1 "$OUTDIR/$log.log"
      echo '```'
    fi
  done
  for log in bench_aggregate bench_aggregate_quick; do
    if [[ -f "$OUTDIR/$log.log" ]] && grep -q '^| model' "$OUTDIR/$log.log"; then
      echo
      echo "## $log"
      echo
      grep -E '^# ' "$OUTDIR/$log.log" | head -n 2
      echo
      grep -E '^\|' "$OUTDIR/$log.log"
    fi
  done
  if [[ -f "$OUTDIR/ncu_summary.md" ]]; then
    echo
    echo "## ncu: one launch of every kernel"
    echo
    cat "$OUTDIR/ncu_summary.md"
  fi
  if [[ -f "$OUTDIR/sanitizer.log" ]]; then
    echo
    echo "## compute-sanitizer (memcheck) over the CUDA self-check"
    echo
    echo '```'
    grep -E 'ERROR SUMMARY|^result:' "$OUTDIR/sanitizer.log"
    echo '```'
  fi
  sanitizer_summary
  for log in bench_distill bench_distill_kl bench_energy bench_sgld bench_superfed bench_robust_ops \
      bench_quantized bench_sparse; do
    if [[ -f "$OUTDIR/$log.log" ]]; then
      echo
      echo "## $log (last lines of the log)"
      echo
      echo '```'
      tail -n 25 "$OUTDIR/$log.log"
      echo '```'
    fi
  done
} >"$OUTDIR/summary.md"

echo "gpu_validate: $( ((FAILED)) && echo 'SOME STEPS FAILED' || echo 'all steps passed' ) in $(($(date +%s) - START)) s; see $OUTDIR/summary.md"
exit $FAILED
