"""Build of the fedkernels native libraries.

`pip install --no-build-isolation -e .` compiles against the torch already installed:

* `fedkernels._C`: the op schemas (always);
* `fedkernels._cpu_{default,avx2,avx512}`: the CPU kernels, once per instruction set; the
  package loads the best one the running CPU supports (see fedkernels/ops/native.py);
* `fedkernels._cuda`: the CUDA kernels, when FEDKERNELS_CUDA=1, or when FEDKERNELS_CUDA=auto
  (the default) and torch is a CUDA build and nvcc is found. TORCH_CUDA_ARCH_LIST is honoured;
  without it the kernels are built for the visible GPUs, and with no GPU visible auto builds
  none (FEDKERNELS_CUDA=1 then asks for TORCH_CUDA_ARCH_LIST).

DEBUG=1 builds without optimisation and with debug symbols. FEDKERNELS_CPU_ISAS=avx2,default
builds only the listed CPU variants (a faster developer build); a variant whose flags the
compiler refuses is skipped with a note. FEDKERNELS_SANITIZE=address,undefined builds the C++
CPU libraries under those compiler sanitizers, for tests only (.ci/sanitize.sh; no CUDA library,
and the list of CPU variants may omit default; see docs/guide/sanitizers.md). Libraries build
side by side (one thread each) when the machine has the cores for it: FEDKERNELS_BUILD_PARALLEL=N
overrides the count. FEDKERNELS_BUILD_ONLY=_cuda (a comma-separated list of library names)
compiles only those libraries and leaves the others in place, e.g. the CUDA library beside CPU
libraries built from the same sources against the same torch version.
"""

import glob
import os
import subprocess
import sys
import threading

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"
SANITIZE = os.environ.get("FEDKERNELS_SANITIZE", "").strip()

# The instruction sets a CPU-kernel library is built for: name -> compiler flags. The macros
# select at::vec's implementation and give its types a namespace of their own.
CPU_CAPABILITIES = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512": [
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
        "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
    ],
}


def compiler_accepts(flags):
    """Whether the C++ compiler builds a trivial file with these flags (an old compiler may
    not know the AVX-512 ones)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run(
            [compiler, "-x", "c++", "-c", "-", "-o", os.devnull, *flags],
            input="int main() { return 0; }\n", capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def cpu_capabilities():
    wanted = os.environ.get("FEDKERNELS_CPU_ISAS", ",".join(CPU_CAPABILITIES))
    names = [n.strip().lower() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in CPU_CAPABILITIES]
    # a sanitizer build is a test build for this machine: no fallback library needed
    if unknown or not names or ("default" not in names and not SANITIZE):
        sys.exit(f"FEDKERNELS_CPU_ISAS must list 'default' and any of {list(CPU_CAPABILITIES)}, "
                 f"got {wanted!r}")
    chosen = {}
    for name in names:
        flags = [f for f in CPU_CAPABILITIES[name] if not f.startswith("-D")]
        if name != "default" and not compiler_accepts(flags):
            print(f"fedkernels: the compiler refuses {' '.join(flags)}; skipping the {name} "
                  "CPU build", file=sys.stderr)
            continue
        chosen[name] = CPU_CAPABILITIES[name]
    return chosen


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def sanitizer_flags():
    """Compile and link flags of a FEDKERNELS_SANITIZE build: a report stops the process
    (UBSan would otherwise print and go on), and frames stay walkable for the reports."""
    if not SANITIZE:
        return []
    return [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def cxx_flags():
    if SANITIZE:
        # line tables are enough for the reports' traces, and with both sanitizers -Og -g1
        # compiles far faster than -O1 -g (the build is part of every CI run)
        opt = ["-Og", "-g1"]
    else:
        opt = ["-O0", "-g"] if DEBUG else ["-O3"]
    opt += sanitizer_flags()
    # Hidden symbols: each library keeps its own copy of shared inline code, so libraries
    # built for different instruction sets never lend each other a function.
    return opt + ["-std=c++20", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fopenmp"]


def want_cuda():
    mode = os.environ.get("FEDKERNELS_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        sys.exit(f"FEDKERNELS_CUDA must be auto, 0 or 1, not {mode!r}")
    import torch

    possible = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if mode == "1" and not possible:
        sys.exit(
            "FEDKERNELS_CUDA=1 but torch is not a CUDA build or nvcc was not found "
            f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={cpp_extension.CUDA_HOME})"
        )
    if mode == "0" or not possible:
        return False
    # With neither a GPU to build for nor TORCH_CUDA_ARCH_LIST, torch's extension builder
    # fails with an IndexError: PyPI's torch is a CUDA build, so a machine with nvcc and no
    # GPU (a container, a CI runner) would get there by default.
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        if mode == "1":
            sys.exit("FEDKERNELS_CUDA=1 but no GPU is visible to build for: set "
                     "TORCH_CUDA_ARCH_LIST to the GPUs' compute capabilities (e.g. 9.0)")
        print("fedkernels: torch is a CUDA build and nvcc was found, but no GPU is visible and "
              "TORCH_CUDA_ARCH_LIST is not set: building the CPU kernels only (FEDKERNELS_CUDA=1 "
              "with TORCH_CUDA_ARCH_LIST, e.g. 9.0, builds the CUDA kernels too)", file=sys.stderr)
        return False
    return True


def cuda_header_dirs():
    # The pip CUDA wheels ship headers (cuBLAS, cuSPARSE, ...) that torch's headers include
    # but a bare CUDA toolkit may lack.
    dirs = []
    for path in sys.path:
        dirs += glob.glob(os.path.join(path, "nvidia", "cu*", "include"))
        dirs += glob.glob(os.path.join(path, "nvidia", "*", "include"))
    return sorted(set(d for d in dirs if os.path.isdir(d)))


def extensions():
    exts = [
        cpp_extension.CppExtension(
            "fedkernels._C", rel("csrc/*.cpp"), extra_compile_args={"cxx": cxx_flags()},
            extra_link_args=sanitizer_flags(),
        )
    ]
    # No fused multiply-adds the source does not ask for: every CPU build rounds each operation
    # alike, which the bit-identical SGLD noise (csrc/normal_noise.h) relies on.
    for name, flags in cpu_capabilities().items():
        exts.append(
            cpp_extension.CppExtension(
                f"fedkernels._cpu_{name}",
                rel("csrc/cpu/*.cpp"),
                extra_compile_args={"cxx": cxx_flags() + flags + ["-ffp-contract=off"]},
                extra_link_args=["-fopenmp"] + sanitizer_flags(),
            )
        )
    # the CUDA kernels are checked by compute-sanitizer instead (bench/gpu_validate.sh)
    if not SANITIZE and want_cuda():
        nvcc = ["-O0", "-g", "-G"] if DEBUG else ["-O3", "-lineinfo"]
        exts.append(
            cpp_extension.CUDAExtension(
                "fedkernels._cuda",
                rel("csrc/cuda/*.cu"),
                include_dirs=cuda_header_dirs(),
                extra_compile_args={
                    "cxx": cxx_flags(),
                    "nvcc": nvcc + ["-std=c++20", "--expt-relaxed-constexpr"],
                },
            )
        )
    return only_requested(exts)


def only_requested(exts):
    wanted = os.environ.get("FEDKERNELS_BUILD_ONLY", "").strip()
    if not wanted:
        return exts
    names = {name.strip() for name in wanted.split(",") if name.strip()}
    known = {ext.name.split(".")[-1] for ext in exts}
    if not names <= known:
        sys.exit(f"FEDKERNELS_BUILD_ONLY lists {sorted(names - known)}, which this build would "
                 f"not compile; it would compile {sorted(known)}")
    return [ext for ext in exts if ext.name.split(".")[-1] in names]


def parallel_libraries(count):
    forced = os.environ.get("FEDKERNELS_BUILD_PARALLEL")
    if forced:
        return max(1, int(forced))
    # ninja already uses every core inside one library; building several at once only pays
    # where there are more cores than one library has sources.
    return max(1, min(count, (os.cpu_count() or 1) // 4))


class BuildPerExtension(cpp_extension.BuildExtension):
    """One temporary folder per library: the CPU kernels compile from the same sources with
    different flags, and must not share object files. The folder is kept per thread, so the
    libraries can build side by side."""

    _local = threading.local()

    @property
    def build_temp(self):
        return getattr(self._local, "build_temp", None) or self.__dict__.get("_build_temp")

    @build_temp.setter
    def build_temp(self, value):
        self.__dict__["_build_temp"] = value

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = parallel_libraries(len(self.extensions or ()))
        if self.parallel == 1:
            self.parallel = None

    def build_extension(self, ext):
        self._local.build_temp = os.path.join(self.__dict__["_build_temp"], ext.name)
        try:
            super().build_extension(ext)
        finally:
            self._local.build_temp = None


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildPerExtension.with_options(use_ninja=True)},
)
