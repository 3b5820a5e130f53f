"""`verify --reference HF_DIR`: the output compared tensor by tensor with another safetensors folder.

Exact (dtype, shape and bytes) by default; with rtol/atol, values within tolerance, in float64 (torch
is imported only then).
"""

from __future__ import annotations

from ..dtypes import itemsize
from ..execute.compare import SLICE_BYTES, first_difference
from ..io.safetensors_folder import MappedFiles, StoredTensor, read_folder
from .report import Mismatch, VerifyReport, compare_names


def check_reference(
    report: VerifyReport,
    stored: dict[str, StoredTensor],
    files: MappedFiles,
    reference: str,
    rtol: float | None,
    atol: float | None,
) -> None:
    tolerant = rtol is not None or atol is not None
    report.checks.append(
        f"reference {reference}" + (f" (rtol {rtol or 0}, atol {atol or 0})" if tolerant else " (exact)")
    )
    theirs = read_folder(reference)
    compare_names(report, set(theirs), set(stored), "in the reference", "the reference")
    with MappedFiles(theirs) as reference_files:
        for name in sorted(set(theirs) & set(stored)):
            have, want = stored[name], theirs[name]
            if have.shape != want.shape or (not tolerant and have.dtype != want.dtype):
                report.mismatches.append(
                    Mismatch(
                        name, f"{have.dtype} {list(have.shape)}, the reference has {want.dtype} {list(want.shape)}"
                    )
                )
                continue
            ours, expected = files.tensor(have.name), reference_files.tensor(want.name)
            report.count_checked(have)
            if tolerant:
                found = _first_not_close(ours, have.dtype, expected, want.dtype, rtol or 0.0, atol or 0.0)
                if found is not None:
                    element, detail = found
                    report.mismatches.append(
                        Mismatch(name, f"not within tolerance ({detail})", element * itemsize(have.dtype), element)
                    )
            else:
                first = first_difference(ours, expected)
                if first >= 0:
                    report.mismatches.append(
                        Mismatch(name, "bytes differ from the reference", first, first // itemsize(have.dtype))
                    )
            ours.release()
            expected.release()
            files.done(name)
            reference_files.done(name)


def _first_not_close(
    ours: memoryview, our_dtype: str, theirs: memoryview, their_dtype: str, rtol: float, atol: float
) -> tuple[int, str] | None:
    """First element where |ours - theirs| > atol + rtol * |theirs| (in float64; NaN equals NaN)."""
    import torch

    from ..dtypes import torch_dtype

    count = len(ours) // itemsize(our_dtype)
    step = max(1, SLICE_BYTES // 8)
    for start in range(0, count, step):
        end = min(count, start + step)
        a = _as_float64(torch, ours, torch_dtype(our_dtype), start, end)
        b = _as_float64(torch, theirs, torch_dtype(their_dtype), start, end)
        close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(close.all()):
            i = int((~close).nonzero()[0, 0])
            return (
                start + i,
                f"{float(a[i])!r} vs {float(b[i])!r}, max |difference| {float((a - b).abs().nan_to_num(0).max()):.3g} in this slice",
            )
    return None


def _as_float64(torch, view: memoryview, dtype, start: int, end: int):
    size = torch.empty(0, dtype=dtype).element_size()
    piece = bytearray(view[start * size : end * size])  # a private copy: frombuffer wants writable memory
    return torch.frombuffer(piece, dtype=dtype).to(torch.float64) if piece else torch.empty(0, dtype=torch.float64)
