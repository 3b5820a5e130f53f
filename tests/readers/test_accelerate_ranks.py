"""accelerate-ranks (`pytorch_model_fsdp_{i}_rank{r}.bin`, accelerate's save_fsdp_model without DCP), written
by accelerate itself on gloo ranks (FSDP2 and FSDP1), merged bit for bit; a missing last rank is named."""

from __future__ import annotations

import os
import shutil

import pytest
from framework_checkpoints import needs_accelerate
from helpers import assert_bit_exact, read_merged
from refusals import cli_refuses

import fsdpfast

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@needs_accelerate
@pytest.mark.parametrize("name", ["acc-ranks", "acc-ranks-fsdp1"])
def test_accelerate_rank_files_without_dcp(frameworks, tmp_path, name):
    spec, folder = frameworks.get(name)
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out)
    assert report.layout == "accelerate-ranks"
    reference, tied = frameworks.reference(name)
    assert_bit_exact(read_merged(out), reference, tied=tied)
    kind = "FSDP2 DTensors" if spec.fsdp_version == 2 else "FSDP1 ShardedTensors"
    assert report.notes[0].startswith(f"accelerate SHARDED_STATE_DICT rank files of model 0 ({kind}")
    assert any("optimizer_0_rank0.bin" in note for note in report.notes)
    assert fsdpfast.verify(out, against=folder).ok
    # a missing last rank is named: the world size comes from the files' own records
    damaged = shutil.copytree(folder, tmp_path / "damaged")
    last = max(
        int(f.split("rank")[1].split(".")[0]) for f in os.listdir(damaged) if f.startswith("pytorch_model_fsdp_0_rank")
    )
    (damaged / f"pytorch_model_fsdp_0_rank{last}.bin").unlink()
    cli_refuses(damaged, tmp_path / "out", mentions=[f"pytorch_model_fsdp_0_rank{last}.bin is missing"])
