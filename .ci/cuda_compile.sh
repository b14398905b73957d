#!/usr/bin/env bash
# Compiles fedkernels' CUDA kernels against the registry's CUDA build of torch 2.13.0, so that a
# CUDA compile error fails CI on a machine without a GPU, then checks that the CUDA library loads
# and registers its kernels.
#
#   FK_CUDA_VENV          virtualenv with the CUDA torch (default /opt/fk-cuda-venv; created, or
#                         reused when it already has torch 2.13.0 built for CUDA)
#   CUDA_HOME             CUDA toolkit with nvcc (default /usr/local/cuda)
#   TORCH_CUDA_ARCH_LIST  architectures to compile for (default 9.0: there is no GPU to detect)
#   MAX_JOBS              parallel compile jobs (default 2)
#   FK_KEEP_BUILD=1       keep the temporary build folder
#   FK_CUDA_VENV_ONLY=1   only create (or check) the virtualenv, then stop
#   FK_CPU_LIBS_FROM      a folder with fedkernels' CPU libraries (_C and _cpu_default) built
#                         from this checkout against torch 2.13.0: they are reused and only the
#                         CUDA library is compiled (CI builds the CPU ones in its build stage;
#                         the import step below checks that they load beside the CUDA torch)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${FK_CUDA_VENV:-/opt/fk-cuda-venv}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-2}
export FEDKERNELS_CUDA=1
# the CPU kernels are built and tested in .ci/run already; one variant is enough to import
export FEDKERNELS_CPU_ISAS=${FEDKERNELS_CPU_ISAS:-default}
torch_version=2.13.0

start=$SECONDS
step_start=$SECONDS
step() {
  echo "--- $1"
  step_start=$SECONDS
}
step_done() {
  echo "    ($((SECONDS - step_start)) s; $((SECONDS - start)) s in all)"
}

step "toolkit"
if [[ ! -x "$CUDA_HOME/bin/nvcc" ]]; then
  echo "error: no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)" >&2
  exit 1
fi
"$CUDA_HOME/bin/nvcc" --version | tail -n 2
step_done

has_cuda_torch() {
  [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - "$torch_version" <<'EOF' 2>/dev/null
import sys
import torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] and torch.version.cuda else 1)
EOF
}

step "virtualenv $venv"
if has_cuda_torch; then
  echo "reusing it"
else
  if [[ ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  # The machine's pip configuration prefers a local CPU-only torch wheel; ignore it so that the
  # registry's CUDA build is installed.
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$venv/bin/python" -m pip install -q \
    "torch==$torch_version" numpy ninja setuptools
  if ! has_cuda_torch; then
    echo "error: $venv does not have a CUDA build of torch $torch_version after the install" >&2
    exit 1
  fi
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
step_done
if [[ "${FK_CUDA_VENV_ONLY:-0}" == 1 ]]; then
  exit 0
fi

step "copy of the repository"
build=$(mktemp -d "${TMPDIR:-/tmp}/fedkernels-cuda.XXXXXX")
cleanup() {
  if [[ "${FK_KEEP_BUILD:-0}" == 1 ]]; then
    echo "build kept in $build"
  else
    rm -rf "$build"
  fi
}
trap cleanup EXIT
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked files and untracked ones git does not ignore: no virtualenvs or build outputs.
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
    xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh |
    tar --null -T - -cf -) | tar -xf - -C "$build"
else
  tar -C "$repo" --exclude=./build --exclude='./.venv*' --exclude='*.so' -cf - . |
    tar -xf - -C "$build"
fi
echo "$build"
if [[ -n "${FK_CPU_LIBS_FROM:-}" ]]; then
  # Copied after the sources, so newer than them: setuptools skips them as up to date.
  for lib in _C _cpu_default; do
    cp "$FK_CPU_LIBS_FROM"/"$lib".*.so "$build/fedkernels/"
  done
  echo "reusing the CPU libraries of $FK_CPU_LIBS_FROM"
  export FEDKERNELS_BUILD_ONLY=_cuda
fi
step_done

step "build (FEDKERNELS_CUDA=1, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS, CPU: $FEDKERNELS_CPU_ISAS, only: ${FEDKERNELS_BUILD_ONLY:-all})"
log="$build/build.log"
if ! (cd "$build" && "$venv/bin/python" setup.py build_ext --inplace) >"$log" 2>&1; then
  echo "error: the build failed. Errors:" >&2
  grep -n -E "error|Error" "$log" | grep -v -E "^[0-9]+: *warning" | head -n 60 >&2 || true
  echo "... last lines of the log:" >&2
  tail -n 15 "$log" >&2
  exit 1
fi
echo "$(grep -c -E 'warning' "$log" || true) warning lines in the build log (FK_KEEP_BUILD=1 keeps it)"
ls -l "$build"/fedkernels/_cuda*.so
step_done

step "import with the CUDA library"
(cd "$build" && "$venv/bin/python" - "$build" <<'EOF')
import os
import sys

import torch

import fedkernels
from fedkernels.ops import native as _native

build = os.path.realpath(sys.argv[1])
assert os.path.realpath(fedkernels.__file__).startswith(build + os.sep), fedkernels.__file__
assert _native.cuda_available, "fedkernels._cuda was not loaded"
# Every op schema (each overload) must have a CUDA kernel, or one kernel for every backend
# (CompositeExplicitAutograd: the output pool's controls, which take no tensors).
ops = sorted({s.name + ("." + s.overload_name if s.overload_name else "")
              for s in torch._C._jit_get_all_schemas() if s.name.startswith("fedkernels::")})
missing = [op for op in ops
           if not any(torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
                      for key in ("CUDA", "CompositeExplicitAutograd"))]
assert ops and not missing, f"ops without a CUDA kernel: {missing}"
print(len(ops), "fedkernels ops, each with a CUDA kernel")
print("fedkernels", fedkernels.__version__, "CUDA kernels loaded; GPU visible:",
      torch.cuda.is_available())
EOF
step_done

echo "CUDA compile check passed in $((SECONDS - start)) s"
