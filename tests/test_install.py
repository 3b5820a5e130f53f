"""How setup.py decides what to build, and what the package does with what was built.

- FSDPFAST_CUDA=auto builds the CUDA ops only when a quick probe finds the whole toolchain
  usable; the probe runs the machine's real nvcc (skipped where there is none) on torch's real
  CUDA headers.
- A CUDA compile that fails falls back to the CPU ops under auto, and fails the build under
  FSDPFAST_CUDA=1: a real build (torch's BuildExtension, ninja, nvcc, g++) of a tiny extension
  whose CUDA source includes a header that does not exist, as torch's headers did with cusparse.h.
- fsdpfast._C is tied to the torch it was built against: under another torch it is not loaded,
  the cpu engine (which does not link torch) still merges, and the cuda engine says why.

The whole install paths (pip with and without build isolation, a wheel on a machine without a
compiler and with another torch) are checked by .ci/install_check; they take minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_exact, load_reference, read_merged

import fsdpfast
from fsdpfast import _ops

ROOT = Path(__file__).resolve().parent.parent


def load_setup():
    """setup.py's functions (it calls setup() only when run as __main__, as setuptools runs it)."""
    spec = importlib.util.spec_from_file_location("fsdpfast_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_py = load_setup()
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")


# --- FSDPFAST_CUDA and the decision -----------------------------------------------------------


@pytest.mark.parametrize(
    "value, setting",
    [
        (None, "auto"),
        ("auto", "auto"),
        ("AUTO", "auto"),
        ("1", "on"),
        ("true", "on"),
        ("0", "off"),
        ("", "off"),
        ("no", "off"),
    ],
)
def test_fsdpfast_cuda_values(value, setting):
    assert setup_py.cuda_setting(value) == setting


def test_fsdpfast_cuda_refuses_other_values():
    with pytest.raises(SystemExit, match="FSDPFAST_CUDA='maybe': use auto"):
        setup_py.cuda_setting("maybe")


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")
def test_cpu_torch_builds_the_cpu_engine_under_auto_and_refuses_under_1():
    why = setup_py.probe_this_torch()  # the real probe, on this environment's torch
    assert why == f"torch {torch.__version__} is a CPU build"
    assert setup_py.cuda_decision("auto", setup_py.probe_this_torch) == (False, why)
    with pytest.raises(SystemExit, match="FSDPFAST_CUDA=1 but the CUDA ops cannot be built: torch .* is a CPU build"):
        setup_py.cuda_decision("on", setup_py.probe_this_torch)
    probed = []
    assert setup_py.cuda_decision("off", lambda: probed.append(1)) == (False, "FSDPFAST_CUDA=0")
    assert not probed  # FSDPFAST_CUDA=0 probes nothing


def nvcc_release() -> str:
    return setup_py.nvcc_release(NVCC)


@pytest.mark.slow
@needs_nvcc
def test_probe_names_a_missing_header():
    """torch's CUDA headers include cusparse.h, which the pip CUDA wheels ship; without them the
    probe says so in seconds instead of a compile failing minutes later."""
    from torch.utils.cpp_extension import include_paths

    torch_includes = include_paths()  # torch's own headers (ATen/cuda/*.h ship with every build)
    cuda_include = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "include")
    if os.path.isfile(os.path.join(cuda_include, "cusparse.h")):
        pytest.skip("this CUDA toolkit has cusparse.h itself")
    why = setup_py.probe_cuda(nvcc_release(), NVCC, torch_includes + [cuda_include])
    assert (
        why is not None and why.startswith("nvcc failed preprocessing torch's CUDA headers") and "cusparse.h" in why
    ), why


@needs_nvcc
def test_probe_refuses_nvcc_of_another_cuda_major():
    release = nvcc_release()
    other = f"{int(release.split('.')[0]) - 1}.8"
    assert setup_py.probe_cuda(other, NVCC, []) == f"nvcc is CUDA {release} but torch was built with CUDA {other}"


def test_probe_without_nvcc(tmp_path):
    assert setup_py.probe_cuda("13.0", None, []) == "nvcc was not found (put it on PATH or set CUDA_HOME)"
    assert setup_py.probe_cuda("13.0", str(tmp_path / "bin" / "nvcc"), []).startswith("nvcc was not found")
    assert setup_py.probe_cuda(None, NVCC, []) == "torch is a CPU build"


@pytest.mark.slow
@needs_nvcc
def test_probe_compiles_a_kernel_for_the_archs_asked():
    release = nvcc_release()
    # a supported arch gets past the kernel, to torch's headers (not given here)
    why = setup_py.probe_cuda(release, NVCC, [], ["-gencode=arch=compute_90,code=sm_90"])
    assert why.startswith("nvcc failed preprocessing torch's CUDA headers") and "ATen/cuda/CUDAContext.h" in why, why
    why = setup_py.probe_cuda(release, NVCC, [], ["-gencode=arch=compute_1,code=sm_1"])
    assert why.startswith("nvcc failed compiling a CUDA kernel"), why


def test_pip_cuda_headers_are_found_on_sys_path(tmp_path, monkeypatch):
    """Under pip's build isolation the CUDA wheels lie in the build environment, on sys.path but not
    in this interpreter's site-packages: that is where cusparse.h was missed."""
    include = tmp_path / "overlay" / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "overlay"))
    assert str(include) in setup_py.pip_cuda_includes()


# --- a failed CUDA compile --------------------------------------------------------------------

TINY_SETUP = """
import importlib.util, json, os
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

spec = importlib.util.spec_from_file_location("fsdpfast_setup", os.environ["FSDPFAST_SETUP_PY"])
fs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fs)

def cpu_ops():
    return CppExtension("tiny_ops", ["tiny_ops.cpp"])

def cuda_ops():
    return CUDAExtension("tiny_ops", ["tiny_ops.cpp", "tiny_kernel.cu"])

def record(command, facts):
    with open("facts.json", "w") as f:
        json.dump(facts, f)

# The probe passed (None): what is tested is the compile that fails after it.
build = fs.build_command(BuildExtension, fs.cuda_setting(os.environ.get("FSDPFAST_CUDA")), lambda: None, cuda_ops, cpu_ops, record)
setup(name="tiny_ops", ext_modules=[cpu_ops()], cmdclass={"build_ext": build}, script_args=["build_ext", "--inplace"])
"""
TINY_OPS = """
#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny_ops", "CPU ops", -1, nullptr};
PyMODINIT_FUNC PyInit_tiny_ops(void) { return PyModule_Create(&tiny); }
"""
TINY_KERNEL = """
#include <a_cuda_library_header_that_is_not_installed.h>
__global__ void kernel(float* x) { x[0] = 1.0f; }
"""


def build_tiny(tmp_path: Path, cuda: str) -> subprocess.CompletedProcess:
    for name, text in (("setup.py", TINY_SETUP), ("tiny_ops.cpp", TINY_OPS), ("tiny_kernel.cu", TINY_KERNEL)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "FSDPFAST_SETUP_PY": str(ROOT / "setup.py"), "FSDPFAST_CUDA": cuda, "MAX_JOBS": "1"}
    return subprocess.run(
        [sys.executable, "setup.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_failed_cuda_compile_falls_back_to_the_cpu_ops(tmp_path):
    result = build_tiny(tmp_path, "auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("fsdpfast: building the CPU engine only")]
    assert (
        len(said) == 1 and "the CUDA compile failed" in said[0] and "FSDPFAST_CUDA=1 makes this an error" in said[0]
    ), said
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["CUDA_OPS"] is False and facts["CUDA_SKIPPED"].startswith("the CUDA compile failed")
    assert facts["TORCH_VERSION"] == torch.__version__
    loaded = subprocess.run(
        [sys.executable, "-c", "import torch, tiny_ops; print(tiny_ops.__doc__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.stdout.strip() == "CPU ops", loaded.stderr


@pytest.mark.slow
def test_failed_cuda_compile_fails_the_build_under_fsdpfast_cuda_1(tmp_path):
    result = build_tiny(tmp_path, "1")
    assert result.returncode != 0
    assert not (tmp_path / "facts.json").exists()
    assert not list(tmp_path.glob("tiny_ops*.so"))


# --- the torch ops and the torch they were built against --------------------------------------


def test_torch_ops_refused_under_another_torch_release():
    assert (
        _ops.torch_mismatch("2.14.1+cu130", built="2.14.1") is None
    )  # CPU and CUDA builds of one release share the ABI
    assert _ops.torch_mismatch("2.13.0", built="2.13.0+cpu") is None
    for installed, built in (("2.14.1", "2.13.0+cpu"), ("2.13.1", "2.13.0")):
        why = _ops.torch_mismatch(installed, built=built)
        assert f"built against torch {built}, this is torch {installed}" in why and "--no-build-isolation" in why


OTHER_TORCH = """
import json, sys
from fsdpfast import _ops
from fsdpfast.cli import main
assert _ops.TORCH_BUILT == "1.0.0", _ops.TORCH_BUILT
print(json.dumps({"loaded": _ops.torch_ops(), "why": _ops.torch_ops_error()}))
sys.stdout.flush()
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _ops.native_cpu(), reason="the native extension is not built")
def test_a_build_for_another_torch_still_merges_with_the_cpu_engine(checkpoints, tmp_path):
    """A copy of the package whose build record names another torch, as a wheel built elsewhere would."""
    package = tmp_path / "site" / "fsdpfast"
    shutil.copytree(Path(fsdpfast.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_build_config.py").write_text("CUDA_OPS = True\nCUDA_SKIPPED = None\nTORCH_VERSION = '1.0.0'\n")
    spec, folder = checkpoints.get("w2-llama")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    merged = subprocess.run(
        [sys.executable, "-c", OTHER_TORCH, "merge", folder, "--out", str(tmp_path / "out"), "--quiet"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0, merged.stderr
    said = json.loads(merged.stdout.splitlines()[0])
    assert said["loaded"] is False and f"built against torch 1.0.0, this is torch {torch.__version__}" in said["why"]
    assert "with the cpu engine" in merged.stdout
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(str(tmp_path / "out")), reference, tied=tied)
    cuda = subprocess.run(
        [sys.executable, "-c", OTHER_TORCH, "merge", folder, "--out", str(tmp_path / "cuda"), "--engine", "cuda"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cuda.returncode == 2 and not (tmp_path / "cuda").exists()
    line = cuda.stderr.strip()
    assert (
        "\n" not in line
        and line.startswith("fsdpfast: error: --engine 'cuda': ")
        and "built against torch 1.0.0" in line
    ), line
    version = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "--version"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert re.fullmatch(
        r"fsdpfast \S+: native cpu engine built; CUDA ops built against torch 1\.0\.0\n", version.stdout
    ), version.stdout
