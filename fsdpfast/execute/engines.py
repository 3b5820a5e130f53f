"""Engines execute a plan's extents into destination bytes; all of them are byte-identical.

torch: torch copy_ between zero-copy views (the reference, always there).
cpu:   the native multithreaded kernels (when the extension is built).
cuda:  conversions through pinned buffers and the GPU (CUDA build and a visible GPU).
auto:  the engine measured fastest on this machine for the job's kind of conversion
       (measurements.py; benchmarks/gpu_check.sh records it), else cpu, else torch. A visible GPU
       alone does not make it cuda: for an offline merge every byte would go disk -> pinned ->
       GPU -> pinned -> file for a cast that costs the CPU about one instruction per byte.

torch and the compiled ops are imported only when an engine is chosen, so reading and
checking a checkpoint stays quick; auto without a record naming cuda never imports torch.
"""

from __future__ import annotations

import sys

from ..errors import BadInput, option

ENGINES = ("auto", "cpu", "cuda", "torch")
_said_missing = False


def check_engine_name(name: str) -> None:
    if name not in ENGINES:
        raise BadInput(f"{option('engine', name)} is not one of {', '.join(ENGINES)}")


def compute_device(engine_name: str) -> str:
    """The device an engine computes tensors on (execute.computed: a fused LoRA weight): the cuda
    engine's GPU, else the CPU. verify --against recomputes them on the kind the merge used."""
    return "cuda" if engine_name == "cuda" else "cpu"


def available_engines() -> list[str]:
    """Usable engines, auto's choice without a measurement first: cpu, cuda, torch."""
    from .. import _ops

    names = ["torch"]
    if _ops.native_cuda():
        names.insert(0, "cuda")
    if _ops.native_cpu():
        names.insert(0, "cpu")
    return names


def auto_engine(kind: str | None = None) -> str:
    """The engine `auto` runs for a job of this kind (measurements.job_kind; None: not known)."""
    from .. import _ops
    from . import measurements

    measured = measurements.recorded_engine(kind)
    if measured == "cuda" and not _ops.native_cuda():
        _say_once(
            f"the cuda engine, measured fastest here for {kind}, cannot run ({_ops.cuda_unavailable()}); "
            f"using the {'cpu' if _ops.native_cpu() else 'torch'} engine"
        )
        measured = None
    if measured in ("cuda", "torch") or (measured == "cpu" and _ops.native_cpu()):
        return measured
    if _ops.native_cpu():
        return "cpu"
    _say_once(f"native extension not available ({_ops.NATIVE_ERROR}); using the pure-torch engine")
    return "torch"


def select_engine(name: str = "auto", kind: str | None = None, threads_share: int = 1):
    """The engine object for `name`; for auto, `kind` is the job's conversion (measurements.job_kind);
    `threads_share`: how many merge processes share this machine's cores."""
    from .. import _ops

    check_engine_name(name)
    if name == "auto":
        name = auto_engine(kind)
    if name == "cuda":
        if not _ops.native_cuda():
            raise BadInput(
                f"{option('engine', 'cuda')}: {_ops.cuda_unavailable()}; use {option('engine', 'cpu')} or auto"
            )
        from .cuda import CudaEngine

        return CudaEngine()
    if name == "cpu":
        if not _ops.native_cpu():
            raise BadInput(
                f"{option('engine', 'cpu')}: the native extension is not available ({_ops.NATIVE_ERROR}); use {option('engine', 'torch')}"
            )
        from .cpu import NativeCpuEngine

        return NativeCpuEngine(threads=max(1, _ops.cpu_threads() // threads_share))
    from .torch_engine import TorchEngine

    return TorchEngine()


def _say_once(note: str) -> None:
    """`auto` tells, once per process, when it cannot take the engine it would: the native extension
    missing, or the cuda engine measured fastest here but unable to run."""
    global _said_missing
    if not _said_missing:
        print(f"fsdpfast: note: {note}", file=sys.stderr)
        _said_missing = True
