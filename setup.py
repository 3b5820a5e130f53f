"""Build the package and its native code.

- fsdpfast._native: the CPU kernels and file writer as a plain pybind11 module; it does not link
  torch, so the native CPU engine works with any torch, or none.
- fsdpfast._C: the same kernels as torch ops (csrc/ops.cpp + csrc/kernels.cpp; csrc/lora_merge.cpp for
  --merge-lora), a torch
  CppExtension tied to the torch it is built against; with the CUDA implementations
  (csrc/cuda/) when the CUDA toolchain is usable.

FSDPFAST_CUDA=auto (the default) builds the CUDA ops only when a quick probe finds the whole
toolchain usable (a CUDA build of torch, nvcc of the same CUDA major version, torch's CUDA
headers and every header they include found and accepted by that nvcc, a kernel compiled for
the target archs); otherwise, or when their compile fails, it
builds the CPU ops and says why in one line. FSDPFAST_CUDA=1 makes either an error,
FSDPFAST_CUDA=0 skips the CUDA ops. FSDPFAST_NATIVE=0 skips all native code (the pure-torch
engine still works).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdpfast")
CPU_SOURCES = [
    "csrc/ops.cpp",
    "csrc/kernels.cpp",
    "csrc/lora_merge.cpp",
    "csrc/transpose.cpp",
    "csrc/transpose_ops.cpp",
    "csrc/fp8_block.cpp",
]
CXX_FLAGS = ["-O3", "-fopenmp"]
PROBE_TIMEOUT_S = 120  # each probe step; a working nvcc takes a few seconds


def say(line: str) -> None:
    """One line in the build log (pip shows it with -v, or when the build fails)."""
    print(f"fsdpfast: {line}", file=sys.stderr, flush=True)


def cuda_setting(value):
    """FSDPFAST_CUDA: None (unset) and 'auto' -> 'auto'; '1'/'true'/'yes'/'on' -> 'on'; '0'/'false'/'no'/'off'/'' -> 'off'."""
    if value is None or value.strip().lower() == "auto":
        return "auto"
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return "on"
    if value.strip().lower() in ("0", "false", "no", "off", ""):
        return "off"
    raise SystemExit(f"fsdpfast: FSDPFAST_CUDA={value!r}: use auto (the default), 1 or 0")


def cuda_decision(setting: str, probe):
    """(build the CUDA ops?, why not or ''); `probe()` returns None when the toolchain is usable, else why not."""
    if setting == "off":
        return False, "FSDPFAST_CUDA=0"
    why = probe()
    if why is None:
        return True, ""
    if setting == "on":
        raise SystemExit(f"fsdpfast: FSDPFAST_CUDA=1 but the CUDA ops cannot be built: {why}")
    return False, why


def point_cuda_home_at_toolkit() -> None:
    # torch guesses CUDA_HOME from the nvcc on PATH; a wrapper there (/usr/local/bin/nvcc) would
    # make it /usr/local, which has no lib64/libcudart. Prefer a folder that holds the runtime.
    if "CUDA_HOME" in os.environ or "CUDA_PATH" in os.environ:
        return
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    for home in candidates + ["/usr/local/cuda"]:
        if glob.glob(os.path.join(home, "lib64", "libcudart.so*")):
            os.environ["CUDA_HOME"] = home
            return


def pip_cuda_includes() -> list:
    """Include folders of the pip CUDA wheels (nvidia/*/include: cusparse.h, cublas_v2.h ...), which
    torch's CUDA headers include. Searched on sys.path, since under pip's build isolation they lie
    in the build environment, not in this interpreter's site-packages."""
    roots = dict.fromkeys([p for p in sys.path if p and os.path.isdir(p)] + [sysconfig.get_paths()["purelib"]])
    found = [d for root in roots for d in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include")))]
    return list(dict.fromkeys(found))  # sys.path's order: the environment's own copy first


def nvcc_release(nvcc: str):
    """'13.0' from `nvcc --version`, or None."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    found = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return f"{found.group(1)}.{found.group(2)}" if out.returncode == 0 and found else None


def probe_cuda(torch_cuda, nvcc, include_dirs, arch_flags=()):
    """None when the CUDA ops can be built, else one phrase saying why not. Quick (seconds): it
    compiles one trivial kernel for the archs asked (nvcc, its host compiler, the archs) and
    preprocesses torch's CUDA headers with `include_dirs` in the build's order (every header they
    include is found, and the CUDA headers found agree with this nvcc), nothing more."""
    if torch_cuda is None:
        return "torch is a CPU build"
    if not nvcc or not os.path.isfile(nvcc):
        return "nvcc was not found (put it on PATH or set CUDA_HOME)"
    try:
        release = nvcc_release(nvcc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{nvcc} --version failed ({exc})"
    if release is None:
        return f"{nvcc} --version did not say its CUDA release"
    if release.split(".")[0] != str(torch_cuda).split(".")[0]:
        return f"nvcc is CUDA {release} but torch was built with CUDA {torch_cuda}"
    includes = [f"-I{d}" for d in include_dirs]
    with tempfile.TemporaryDirectory(prefix="fsdpfast-cuda-probe-") as tmp:
        headers, kernel = os.path.join(tmp, "headers.cu"), os.path.join(tmp, "kernel.cu")
        with open(headers, "w") as f:
            f.write("#include <ATen/cuda/CUDAContext.h>\n#include <c10/cuda/CUDAGuard.h>\n")
        with open(kernel, "w") as f:
            f.write("__global__ void probe(float* x) { x[threadIdx.x] = 1.0f; }\n")
        steps = [
            (
                "compiling a CUDA kernel",
                [nvcc, "-c", "-std=c++17", *arch_flags, kernel, "-o", os.path.join(tmp, "kernel.o")],
            ),
            ("preprocessing torch's CUDA headers", [nvcc, "-E", "-std=c++17", *includes, headers, "-o", os.devnull]),
        ]
        for what, command in steps:
            try:
                out = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                return f"nvcc failed {what} ({exc})"
            if out.returncode != 0:
                return f"nvcc failed {what}: {first_error(out.stdout + out.stderr)}"
    return None


def first_error(log: str) -> str:
    """The line of a compiler log that says what went wrong (a missing header, an unsupported compiler)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line[:300]
    return (lines[0] if lines else "no output")[:300]


def probe_this_torch():
    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    try:
        includes = cpp_extension.include_paths(device_type="cuda")
    except TypeError:  # torch before 2.7 spells it cuda=True
        includes = cpp_extension.include_paths(cuda=True)
    try:
        arch_flags = cpp_extension._get_cuda_arch_flags()  # what the build will ask nvcc for
    except Exception:  # a private helper: without it, the probe compiles for nvcc's default arch
        arch_flags = []
    # In the build's order: the pip CUDA headers (include_dirs of the extension) before torch's and
    # CUDA_HOME's, so that a toolkit of another version there is found as the compile would find it.
    why = probe_cuda(torch.version.cuda, nvcc, pip_cuda_includes() + includes, arch_flags)
    return None if why is None else f"{why} (torch {torch.__version__}, CUDA_HOME {home})"


def write_build_config(folder: str, values: dict) -> None:
    # Lets the package know, without importing torch, what was built and against which torch.
    with open(os.path.join(folder, "_build_config.py"), "w") as f:
        f.write("# written by setup.py\n" + "".join(f"{key} = {value!r}\n" for key, value in values.items()))


def build_command(base, setting: str, probe, cuda_ops, cpu_ops, record):
    """The build_ext command: `base` (torch's BuildExtension) with the CUDA decision made when the
    extensions are built, so that pip's metadata steps, which run this file too, probe nothing.
    `cuda_ops()` / `cpu_ops()` make the ops extension (same name); `record(command, facts)` is
    told what was built. Under FSDPFAST_CUDA=auto a failed CUDA compile falls back to the CPU ops."""

    class Build(base):
        def build_extensions(self):
            import torch

            if setting != "off":
                os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")  # A100, H100/H200, and PTX onwards
            cuda, why = cuda_decision(setting, probe)
            facts = {"CUDA_OPS": cuda, "CUDA_SKIPPED": why or None, "TORCH_VERSION": torch.__version__}
            if cuda:
                say(f"building the CUDA ops (torch {torch.__version__}, CUDA {torch.version.cuda})")
            else:
                say(f"building the CPU engine only, no CUDA ops: {why}")
            try:
                if cuda:
                    self._use(cuda_ops())
                super().build_extensions()
            except Exception as exc:  # a compiler or linker error, torch's CUDA checks, no CUDA_HOME
                if not (cuda and setting == "auto"):
                    raise
                detail = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
                why = f"the CUDA compile failed ({detail[:200]}; the compiler's messages are in the build log: pip install -v)"
                say(f"building the CPU engine only, no CUDA ops: {why}; FSDPFAST_CUDA=1 makes this an error")
                facts.update(CUDA_OPS=False, CUDA_SKIPPED=why)
                self._use(cpu_ops())
                super().build_extensions()
            record(self, facts)

        def _use(self, ops):
            old = next(e for e in self.extensions if e.name == ops.name)
            for attr, value in vars(old).items():  # what setuptools' finalize_options set on the one it saw
                if attr.startswith("_") and not hasattr(ops, attr):
                    setattr(ops, attr, value)
            self.extensions = [ops if e is old else e for e in self.extensions]
            self.ext_map = {key: ops if e is old else e for key, e in getattr(self, "ext_map", {}).items()}

    return Build


def torch_extensions(cuda_setting_value: str):
    """The two extension modules and the build command; what _C holds is written to _build_config."""
    setting = cuda_setting(cuda_setting_value)
    point_cuda_home_at_toolkit()  # before torch.utils.cpp_extension reads it
    from pybind11.setup_helpers import Pybind11Extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    native = Pybind11Extension(
        "fsdpfast._native",
        ["csrc/bindings.cpp", "csrc/kernels.cpp", "csrc/transpose.cpp"],
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
        cxx_std=17,
    )

    def cpu_ops():
        return CppExtension(
            "fsdpfast._C", list(CPU_SOURCES), extra_compile_args=list(CXX_FLAGS), extra_link_args=["-fopenmp"]
        )

    def cuda_ops():
        # -fopenmp for nvcc's host compiler too: ATen's parallel_for is a plain loop in a file compiled without it,
        # and the CUDA engine's host copies into and out of the pinned buffers would all run on one thread.
        return CUDAExtension(
            "fsdpfast._C",
            CPU_SOURCES + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=pip_cuda_includes(),
            extra_compile_args={"cxx": list(CXX_FLAGS), "nvcc": ["-O3", "-Xcompiler", "-fopenmp"]},
            extra_link_args=["-fopenmp"],
        )

    def record(command, facts):
        # In the source tree (editable installs, in-place builds) and where the modules were built:
        # build_py copied the package into the wheel's tree before this decision was made.
        write_build_config(PACKAGE_DIR, facts)
        built = os.path.dirname(command.get_ext_fullpath("fsdpfast._C"))
        if os.path.isdir(built) and os.path.realpath(built) != os.path.realpath(PACKAGE_DIR):
            write_build_config(built, facts)

    build = build_command(BuildExtension, setting, probe_this_torch, cuda_ops, cpu_ops, record)
    return [native, cpu_ops()], {"build_ext": build}


if __name__ == "__main__":  # setuptools runs this file as __main__; the tests import its functions
    from setuptools import setup

    if os.environ.get("FSDPFAST_NATIVE") in ("0", "", "false", "no", "off"):
        write_build_config(PACKAGE_DIR, {"CUDA_OPS": False, "CUDA_SKIPPED": "FSDPFAST_NATIVE=0", "TORCH_VERSION": None})
        setup()
    else:
        ext_modules, cmdclass = torch_extensions(os.environ.get("FSDPFAST_CUDA"))
        setup(ext_modules=ext_modules, cmdclass=cmdclass)
