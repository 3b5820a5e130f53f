"""Engines execute a plan's extents into destination bytes; all of them are byte-identical.

torch: torch copy_ between zero-copy views (the reference, always there).
cpu:   the native multithreaded kernels (when the extension is built).
cuda:  conversions through pinned buffers and the GPU (CUDA build and a visible GPU).
auto:  cuda, else cpu, else torch.

torch and the compiled ops are imported only when an engine is chosen, so reading and
checking a checkpoint stays quick.
"""
from __future__ import annotations

import sys

from ..errors import BadInput, option

ENGINES = ("auto", "cpu", "cuda", "torch")
_said_missing = False


def check_engine_name(name: str) -> None:
    if name not in ENGINES:
        raise BadInput(f"{option('engine', name)} is not one of {', '.join(ENGINES)}")


def available_engines() -> list[str]:
    """Usable engines, fastest first."""
    from .. import _ops

    names = ["torch"]
    if _ops.native_cpu():
        names.insert(0, "cpu")
    if _ops.native_cuda():
        names.insert(0, "cuda")
    return names


def select_engine(name: str = "auto", threads_share: int = 1):
    """The engine `name` names; `threads_share`: how many merge processes share this machine's cores."""
    from .. import _ops

    check_engine_name(name)
    if name == "auto":
        name = available_engines()[0]
        _say_if_missing(_ops)
    if name == "cuda":
        if not _ops.native_cuda():
            raise BadInput(f"{option('engine', 'cuda')}: {_ops.cuda_unavailable()}; use {option('engine', 'cpu')} or auto")
        from .cuda import CudaEngine

        return CudaEngine()
    if name == "cpu":
        if not _ops.native_cpu():
            raise BadInput(f"{option('engine', 'cpu')}: the native extension is not available ({_ops.NATIVE_ERROR}); use {option('engine', 'torch')}")
        from .native import NativeCpuEngine

        return NativeCpuEngine(threads=max(1, _ops.cpu_threads() // threads_share))
    from .torch_ref import TorchEngine

    return TorchEngine()


def _say_if_missing(ops) -> None:
    """`auto` tells, once, when a faster engine was built but cannot run (a GPU with CUDA ops that do not load)."""
    global _said_missing
    if _said_missing:
        return
    if not ops.native_cpu():
        print(f"fsdpfast: note: native extension not available ({ops.NATIVE_ERROR}); using the pure-torch engine", file=sys.stderr)
        _said_missing = True
    elif ops.CUDA_OPS and ops.gpu_device_present() and not ops.native_cuda_built():
        print(f"fsdpfast: note: the cuda engine cannot run ({ops.torch_ops_error()}); using the cpu engine", file=sys.stderr)
        _said_missing = True
