"""The pure-torch copy: copy_ between zero-copy views of the sources and the destination, the
reference every other engine must match byte for byte (the torch engine, and the fallback for
pieces no fast path handles)."""

from __future__ import annotations

from ..dtypes import torch_dtype
from ..io.sources import Source
from ..plan.model import TensorPlan


def torch_copy(jobs: list[tuple[TensorPlan, memoryview]], sources: Source) -> None:
    """Write each tensor's elements, converted to its target dtype, into its destination bytes."""
    import torch

    for tensor, destination in jobs:
        if tensor.numel == 0:
            continue
        dst = torch.frombuffer(destination, dtype=torch_dtype(tensor.target_dtype))
        views = {}
        for extent in tensor.extents:
            if extent.source not in views:
                views[extent.source] = torch.frombuffer(
                    sources.view(extent.source), dtype=torch_dtype(tensor.source_dtype)
                )
            src = views[extent.source]
            # copy_ converts dtypes with round-to-nearest-even, exactly like Tensor.to()
            runs, count = extent.runs, extent.count
            dst.as_strided((runs, count), (extent.dst_stride or count, 1), extent.dst_offset).copy_(
                src.as_strided((runs, count), (extent.src_stride or count, 1), extent.src_offset)
            )
        del views, dst
