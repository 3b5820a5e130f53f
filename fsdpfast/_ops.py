"""The thin Python face of the compiled ops (torch.ops.fsdpfast.*), and whether they loaded."""
from __future__ import annotations

import torch

try:
    from . import _C  # noqa: F401  (loading the library registers the ops)

    LOAD_ERROR: str | None = None
except ImportError as exc:  # not built, or built against another torch
    LOAD_ERROR = str(exc)

# Element codes of csrc/convert.h: equal codes mean a plain byte copy.
CODES = {"float32": 1, "bfloat16": 2, "float16": 3}


def native_cpu() -> bool:
    return LOAD_ERROR is None


def native_cuda_built() -> bool:
    return LOAD_ERROR is None and hasattr(torch.ops.fsdpfast, "gather_convert_staged")


def native_cuda() -> bool:
    """CUDA ops built and a GPU visible."""
    return native_cuda_built() and torch.cuda.is_available()


def code(dtype: str) -> int:
    return CODES.get(dtype, 0)


def gather_convert(sources: list[torch.Tensor], destinations: list[torch.Tensor], plan: torch.Tensor) -> None:
    torch.ops.fsdpfast.gather_convert(sources, destinations, plan)


def gather_convert_staged(sources, destinations, plan, pinned_in, pinned_out, device_in, device_out) -> None:
    torch.ops.fsdpfast.gather_convert_staged(sources, destinations, plan, pinned_in, pinned_out, device_in, device_out)


def convert_scalar(source: torch.Tensor, source_code: int, target_code: int) -> torch.Tensor:
    return torch.ops.fsdpfast.convert_scalar(source, source_code, target_code)
