"""The thin Python face of the compiled code, and whether it loaded.

- fsdpfast._native: the CPU kernels as a plain module; the native CPU engine uses it, so a
  merge never has to import torch.
- fsdpfast._C: the same kernels as torch ops (torch.ops.fsdpfast.*), with CUDA implementations
  when built with CUDA; loaded only when asked for, since it needs torch imported first. It is
  tied to the torch it was built against (torch has no stable C++ ABI): under another torch
  version it is not loaded, and torch_ops_error() says why; only the cuda engine needs it.
"""

from __future__ import annotations

import glob
import os

try:
    from . import _build_config  # written by setup.py
except ImportError:  # a source tree that was never built
    _build_config = None
CUDA_OPS = bool(getattr(_build_config, "CUDA_OPS", False))
CUDA_SKIPPED: str | None = getattr(_build_config, "CUDA_SKIPPED", None)  # why the build left the CUDA ops out
TORCH_BUILT: str | None = getattr(_build_config, "TORCH_VERSION", None)  # the torch _C was built against

# Element codes of csrc/convert.h: equal codes mean a plain byte copy.
CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
COLUMNS = 12  # plan row width, csrc/plan_rows.h

_native = None
NATIVE_ERROR: str | None = None
try:
    from . import _native  # noqa: F811
except ImportError as exc:  # not built
    NATIVE_ERROR = str(exc)

_torch_ops_error: str | None = None
_torch_ops_loaded = False


def code(dtype: str) -> int:
    return CODES.get(dtype, 0)


def native_cpu() -> bool:
    return _native is not None


def native():
    """The torch-free kernel module (check native_cpu() first)."""
    return _native


def torch_ops() -> bool:
    """Load the torch ops (imports torch); False, with torch_ops_error() saying why, if they are missing."""
    global _torch_ops_loaded, _torch_ops_error
    if not _torch_ops_loaded and _torch_ops_error is None:
        try:
            import torch  # the ops library links against it
        except ImportError as exc:
            _torch_ops_error = f"torch is not installed ({exc})"
            return False
        _torch_ops_error = torch_mismatch(torch.__version__)
        if _torch_ops_error is None:
            try:
                from . import _C  # noqa: F401  (loading the library registers the ops)
            except Exception as exc:  # ImportError, OSError: missing libraries, undefined symbols
                _torch_ops_error = (
                    f"fsdpfast._C did not load ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                )
            else:
                _register_fakes(torch)
                _torch_ops_loaded = True
    return _torch_ops_loaded


def _register_fakes(torch) -> None:
    """What the ops return, computed without data (FakeTensor: torch.compile, torch.library.opcheck).
    The gather ops need none: they return nothing and their schemas declare what they write, from
    which torch makes their fakes; lora_merge's ATen-only implementation serves fake tensors itself."""

    @torch.library.register_fake("fsdpfast::convert_scalar")
    def _(source, source_code: int, target_code: int):
        width = lambda code: 4 if code == CODES["float32"] else 2  # as csrc/ops.cpp sizes them
        return source.new_empty(source.numel() // width(source_code) * width(target_code))

    @torch.library.register_fake("fsdpfast::transposed")
    def _(source, dtype=None):
        torch._check(source.dim() >= 2, lambda: "transposed: the source needs two dimensions at least")
        return source.new_empty((*source.shape[:-2], source.shape[-1], source.shape[-2]), dtype=dtype or source.dtype)

    def fp8_block_outputs(weight, block_rows: int, block_cols: int):
        grid = [*weight.shape[:-2], -(-weight.shape[-2] // block_rows), -(-weight.shape[-1] // block_cols)]
        return weight.new_empty(weight.shape, dtype=torch.float8_e4m3fn), weight.new_empty(grid, dtype=torch.float32)

    # the scalar CPU kernel, kept to measure beside the vectorised one (csrc/fp8_block.cpp)
    for name in ("fp8_block_quantize", "fp8_block_quantize_scalar"):
        torch.library.register_fake(f"fsdpfast::{name}")(fp8_block_outputs)


def _release(version: str) -> str:
    return version.split("+")[0]  # 2.14.1+cu130 -> 2.14.1: CPU and CUDA builds of one release share the ABI


def torch_mismatch(installed: str, built: str | None = None) -> str | None:
    """Why fsdpfast._C, built against torch `built` (default: this install's), cannot be used with torch `installed`, or None."""
    built = built or TORCH_BUILT
    if built is None or _release(built) == _release(installed):
        return None
    return (
        f"fsdpfast's torch ops (_C) were built against torch {built}, this is torch {installed}; the cpu "
        "engine does not use them; for the cuda engine, reinstall fsdpfast from source against this torch "
        "(pip install --no-build-isolation --no-deps --force-reinstall SOURCE)"
    )


def torch_ops_error() -> str | None:
    torch_ops()
    return _torch_ops_error


def native_cuda_built() -> bool:
    return bool(CUDA_OPS) and torch_ops()


def cuda_unavailable() -> str:
    """Why the cuda engine cannot run here (call when native_cuda() is False)."""
    if not CUDA_OPS:
        return f"the CUDA ops were not built ({CUDA_SKIPPED or 'no CUDA toolchain when fsdpfast was built'})"
    if not torch_ops():
        return torch_ops_error() or "the CUDA ops did not load"
    return "no GPU is visible"


def gpu_device_present() -> bool:
    """A cheap look for an NVIDIA device node, so CPU-only machines never import torch to ask."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def native_cuda() -> bool:
    """CUDA ops built and a GPU visible."""
    if not (CUDA_OPS and gpu_device_present() and native_cuda_built()):
        return False
    import torch

    return torch.cuda.is_available()


def crc32c(data, crc: int = 0) -> int | None:
    """CRC-32C of a buffer continuing from `crc` (the manifest's checksum); None without the native module."""
    return _native.crc32c(data, crc) if _native is not None else None


def crc32c_combine(crc_a: int | None, crc_b: int | None, length_b: int) -> int | None:
    """CRC-32C of A followed by B from their CRCs (None if either is None): a tensor written in
    byte ranges by several processes gets the checksum of its whole bytes."""
    if crc_a is None or crc_b is None:
        return None
    return _native.crc32c_combine(crc_a, crc_b, length_b)  # CRCs come from _native, so it is loaded


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def gather_convert(sources, destinations, plan) -> None:
    import torch

    torch_ops()
    torch.ops.fsdpfast.gather_convert(sources, destinations, plan)


def gather_convert_staged(sources, destinations, plan, pinned_in, pinned_out, device_in, device_out) -> None:
    import torch

    torch.ops.fsdpfast.gather_convert_staged(sources, destinations, plan, pinned_in, pinned_out, device_in, device_out)


def fp8_block_quantize(weight, block_rows: int = 128, block_cols: int = 128):
    """(float8_e4m3fn weight, float32 scale_inv per block): csrc/fp8_block.h's rule."""
    import torch

    torch_ops()
    return torch.ops.fsdpfast.fp8_block_quantize(weight, block_rows, block_cols)


def convert_scalar(source, source_code: int, target_code: int):
    import torch

    torch_ops()
    return torch.ops.fsdpfast.convert_scalar(source, source_code, target_code)
