#!/usr/bin/env bash
# Builds fedkernels' C++ libraries (the op schemas, and the CPU kernels for the instruction set
# this CPU loads) under AddressSanitizer and UndefinedBehaviorSanitizer in a separate folder, and
# runs the tests of the C++ kernels against that build. Any sanitizer report fails the run. The
# libraries of the source tree are never touched. See docs/guide/sanitizers.md.
#
#   bash .ci/sanitize.sh [PYTEST ARGS...]   (default: the op test files below, -m "not slow")
#
#   PYTHON           python with torch and the test packages (default: the first of
#                    .venv-ci/bin/python, .venv/bin/python, python3 that imports torch)
#   FK_SANITIZE_DIR  build folder (default: a new temporary folder, removed at the end); a folder
#                    given here is kept, and a rerun recompiles only the sources that changed
#   MAX_JOBS         parallel compile jobs (default: the number of cores)
#   FK_SANITIZE_BUILD_ONLY=1  build (into FK_SANITIZE_DIR) and check the instrumentation, then
#                    stop; a later run with the same FK_SANITIZE_DIR finds the build done
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if [[ -z "${PYTHON:-}" ]]; then
  for candidate in .venv-ci/bin/python .venv/bin/python python3; do
    if "$candidate" -c "import torch" >/dev/null 2>&1; then
      PYTHON=$candidate
      break
    fi
  done
  [[ -n "${PYTHON:-}" ]] || { echo "sanitize: no python that imports torch; set PYTHON=..." >&2; exit 1; }
fi
PYTHON=$(command -v "$PYTHON")
PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")

start=$SECONDS
step() { echo "--- $1 ($((SECONDS - start)) s)"; }

if [[ -n "${FK_SANITIZE_DIR:-}" ]]; then
  build=$FK_SANITIZE_DIR
  mkdir -p "$build"
else
  build=$(mktemp -d "${TMPDIR:-/tmp}/fedkernels-sanitize.XXXXXX")
  trap 'rm -rf "$build"' EXIT
fi
build=$(cd "$build" && pwd)

# The CPU build the loader picks on this machine, by fedkernels/ops/native.py's own rule (read
# from the file: importing the package would need a built library).
capability=$("$PYTHON" - "$repo/fedkernels/ops/native.py" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("native_rules", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module._supported_capabilities()[0])
PY
)

step "copy of the sources into $build (CPU build: $capability)"
tar -C "$repo" --exclude='*.so' --exclude=__pycache__ -cf - \
  setup.py pyproject.toml csrc fedkernels python_tests | tar -C "$build" -xf -

step "build with -fsanitize=address,undefined"
# The compiler's log goes to a file (GCC warns about its own AVX-512 intrinsics by the thousand
# in this build); the end of it is shown when the build fails.
if ! (cd "$build" && FEDKERNELS_SANITIZE=address,undefined FEDKERNELS_CPU_ISAS="$capability" \
  FEDKERNELS_CUDA=0 MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "$PYTHON" setup.py build_ext --inplace >"$build/build.log" 2>&1); then
  grep -E 'error' "$build/build.log" | head -n 40 >&2 || true
  tail -n 20 "$build/build.log" >&2
  echo "sanitize: the build failed" >&2
  exit 1
fi
for lib in "$build"/fedkernels/_C.*so "$build/fedkernels/_cpu_$capability".*so; do
  # an uninstrumented library would pass every test below and check nothing
  imports=$(nm -D --undefined-only "$lib")
  if [[ $imports != *__asan_report* || $imports != *__ubsan_handle* ]]; then
    echo "sanitize: $lib is not instrumented" >&2
    exit 1
  fi
done
if [[ "${FK_SANITIZE_BUILD_ONLY:-0}" == 1 ]]; then
  step "built (FK_SANITIZE_BUILD_ONLY)"
  exit 0
fi

# Python is not built with the sanitizers, so their runtimes are preloaded: ASan must come
# first among the process's libraries to take over malloc and friends from the start.
asan=$("${CXX:-c++}" -print-file-name=libasan.so)
ubsan=$("${CXX:-c++}" -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
  [[ -e "$lib" ]] || { echo "sanitize: ${CXX:-c++} has no $(basename "$lib")" >&2; exit 1; }
done
export LD_PRELOAD="$asan:$ubsan"
# detect_leaks=0: CPython and torch keep interned objects, caches and registries until the
# process ends and never free them, which LeakSanitizer reports by the thousand at exit.
# abort_on_error=1: a report raises SIGABRT, so pytest's faulthandler prints the test it was in.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
export PYTHONPATH="$build"
# The tests compare CPU builds in subprocesses: only this one is built here.
export FEDKERNELS_CPU_CAPABILITY="$capability"
export FK_DRIVER_CXXFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g1"

step "self-check of the sanitizer runtime"
# A heap overflow that ASan must stop: without it a broken preload or option would pass
# silently. (The outer redirection keeps bash's "Aborted" line out of the log.)
if { "$PYTHON" -c '
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
ctypes.memset(libc.malloc(8), 0, 16)
' 2>"$build/canary.log"; } 2>/dev/null; then
  echo "sanitize: ASan did not catch a heap overflow; the preload does not work" >&2
  exit 1
fi
grep -q "heap-buffer-overflow" "$build/canary.log" || { cat "$build/canary.log" >&2; exit 1; }
echo "ASan stops a heap overflow: ok"

# The tests of the C++ kernels: the op families, the public APIs on top of them, and the
# drivers of the host-compiled headers.
tests=(
  python_tests/test_weighted_sum_op.py
  python_tests/test_aggregate.py
  python_tests/test_aggregate_errors.py
  python_tests/test_aggregate_properties.py
  python_tests/test_accumulator.py
  python_tests/test_robust_ops.py
  python_tests/test_robust_api.py
  python_tests/test_private_api.py
  python_tests/test_superfed_ops.py
  python_tests/test_sgld_ops.py
  python_tests/test_distill_ops.py
  python_tests/test_misaligned_inputs.py
  python_tests/test_op_properties.py
  python_tests/test_written_tensors.py
  python_tests/test_subnormals.py
  python_tests/test_multi_tensor_layout.py
  python_tests/test_sorted_keys.py
  python_tests/test_quantize_ops.py
  python_tests/test_sparse_ops.py
  python_tests/test_secagg_ops.py
)
step "tests under the sanitizers"
cd "$build"
# --capture=sys: pytest's default capture of file descriptor 2 would swallow the report, which
# the runtime writes there just before it aborts the process.
if (($#)); then
  "$PYTHON" -m pytest -q -p no:cacheprovider --capture=sys "$@"
else
  "$PYTHON" -m pytest -q -p no:cacheprovider --capture=sys -m "not slow" "${tests[@]}"
fi
step "done"
