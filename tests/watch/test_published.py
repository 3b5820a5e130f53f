"""A published output counts only when merged as asked: its dtype, and FP8 or not (an FP8 merge
records bfloat16, the dtype of what it leaves unquantized), so changing --dtype redoes the step."""

from __future__ import annotations

import pytest

import fsdpfast
from fsdpfast.watch.published import published

pytestmark = pytest.mark.slow  # two merges, each with its model check


def test_an_output_is_published_only_for_the_dtype_and_fp8_it_was_merged_with(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    fsdpfast.merge(folder, bf16, dtype="bf16")
    fsdpfast.merge(folder, fp8, dtype="fp8")
    assert published(str(bf16), str(folder), "bfloat16")
    assert not published(str(bf16), str(folder), "bfloat16", fp8_skip=())
    assert published(str(fp8), str(folder), "bfloat16", fp8_skip=())
    assert not published(str(fp8), str(folder), "bfloat16")
    assert not published(str(fp8), str(folder), "bfloat16", fp8_skip=("*.q_proj.weight",))
