"""Output files: Hugging Face's split rule, size parsing, safetensors headers."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fsdpfast.errors import BadInput
from fsdpfast.plan.layout import parse_size, plan_files, split_into_files
from fsdpfast.plan.model import Extent, MergePlan, TensorPlan


@pytest.mark.parametrize(
    "text,value",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5kb", 1500),
        ("123", 123),
        (4096, 4096),
        (" 10 MB ", 10**7),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "5 GBs", "-1", "0", "lots", "5XB"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(BadInput):
        parse_size(text)


def _tensor(name: str, numel: int, dtype: str = "float32") -> TensorPlan:
    return TensorPlan(name, (numel,), dtype, dtype, [Extent(0, 0, numel, 0)] if numel else [])


def test_split_matches_huggingface_hub():
    from huggingface_hub import split_torch_state_dict_into_shards

    # Non-empty tensors only: the hub groups all empty tensors as one shared storage.
    rng = random.Random(1)
    for _ in range(200):
        sizes = [rng.choice([1, 3, 10, 40, 90, 250]) for _ in range(rng.randint(1, 12))]
        limit = rng.choice([40, 100, 200, 1000])
        plans = [_tensor(f"t{i}", n) for i, n in enumerate(sizes)]
        state = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
        hub = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        hub_groups = sorted(sorted(names) for names in hub.filename_to_tensors.values())
        ours = sorted(sorted(t.name for t in group) for group in split_into_files(plans, limit) if group)
        assert ours == hub_groups, (sizes, limit)


def test_headers_are_valid_safetensors_and_aligned():
    plan = MergePlan(
        "test",
        1,
        [],
        [_tensor("a.bias", 3, "bfloat16"), _tensor("b", 5, "float32"), _tensor("c", 1, "int64"), _tensor("e", 0)],
    )
    (planned,) = plan_files(plan, "5GB")
    header_len = int.from_bytes(planned.header[:8], "little")
    assert (8 + header_len) % 8 == 0 and len(planned.header) == 8 + header_len
    header = json.loads(planned.header[8:])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["c"]["dtype"] == "I64" and header["a.bias"]["dtype"] == "BF16"
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gaps
    sizes = {"bfloat16": 2, "float32": 4, "int64": 8}
    for placed in planned.tensors:
        assert placed.offset % sizes[placed.tensor.target_dtype] == 0, placed
    assert planned.size == 8 + header_len + spans[-1][1]
