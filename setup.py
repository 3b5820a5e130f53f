"""Build the package and its native code.

- fsdpfast._C: the torch ops (csrc/ops.cpp + csrc/kernels.cpp; csrc/lora_merge.cpp for --merge-lora), a torch
  CppExtension; their CUDA implementations (csrc/cuda/) join them when torch has CUDA and nvcc is found.
- fsdpfast._native: the same CPU kernels as a plain pybind11 module, so the native CPU engine
  runs without importing torch.

FSDPFAST_CUDA=0|1 forces the CUDA part either way; FSDPFAST_NATIVE=0 skips all native code
(the pure-torch engine still works).
"""
import glob
import os
import shutil
import sysconfig

from setuptools import setup


def _flag(name):
    value = os.environ.get(name)
    return None if value is None else value not in ("0", "", "false", "no")


def _point_cuda_home_at_toolkit():
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


def _cuda_wanted():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    forced = _flag("FSDPFAST_CUDA")
    found = torch.version.cuda is not None and CUDA_HOME is not None and (
        shutil.which("nvcc") or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    if forced and not found:
        raise SystemExit("FSDPFAST_CUDA=1 but torch has no CUDA or nvcc was not found")
    return found if forced is None else forced


def _pip_cuda_includes():
    # torch's CUDA headers include cusparse.h, cublas_v2.h ...: the pip CUDA wheels ship them.
    site = sysconfig.get_paths()["purelib"]
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))


def _extensions():
    if _flag("FSDPFAST_NATIVE") is False:
        _write_build_config(False)
        return [], {}
    _point_cuda_home_at_toolkit()
    from pybind11.setup_helpers import Pybind11Extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cxx = ["-O3", "-fopenmp"]
    sources = ["csrc/ops.cpp", "csrc/kernels.cpp", "csrc/lora_merge.cpp"]
    plain = Pybind11Extension("fsdpfast._native", ["csrc/bindings.cpp", "csrc/kernels.cpp"],
                              extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"], cxx_std=17)
    cuda = _cuda_wanted()
    _write_build_config(cuda)
    if cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")  # A100, H100/H200, and PTX onwards
        extension = CUDAExtension(
            "fsdpfast._C", sources + glob.glob("csrc/cuda/*.cu"),
            include_dirs=_pip_cuda_includes(),
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        extension = CppExtension("fsdpfast._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])
    return [plain, extension], {"build_ext": BuildExtension}


def _write_build_config(cuda: bool) -> None:
    # Lets the package know, without importing torch, whether the CUDA ops were built.
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdpfast", "_build_config.py"), "w") as f:
        f.write(f"# written by setup.py\nCUDA_OPS = {cuda!r}\n")


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
