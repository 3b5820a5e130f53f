"""fsdpfast.save_pretrained of a model held whole in one process, in the Hub layout of its family: what
transformers' save_pretrained writes (Mixtral's per-expert w1/w3/w2), Qwen3-VL-MoE's experts transposed,
`expert_layout="packed"` keeping transformers' packed tensors; a layout it does not know refused.
(Sharded models of every family, on 2 and 3 ranks: tests/families/test_hub_layout.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import read_merged

import fsdpfast
from fsdpfast._testing.family_writer import TEXT, FamilySpec, build_family_model
from fsdpfast.errors import BadInput

pytestmark = [pytest.mark.slow]

MIXTRAL = FamilySpec("mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2), seed=2)
QWEN3_VL_MOE = FamilySpec(
    "qwen3_vl_moe",
    "qwen3_vl_moe",
    dict(
        text_config=dict(TEXT, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32),
    ),
    seed=8,
    auto_class="AutoModelForImageTextToText",
)


def same_files(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@pytest.mark.parametrize("spec", [MIXTRAL, QWEN3_VL_MOE], ids=lambda s: s.name)
def test_hub_layout_and_packed(tmp_path, spec):
    model = build_family_model(spec)
    model.save_pretrained(tmp_path / "anchor")
    anchor = read_merged(tmp_path / "anchor")
    fsdpfast.save_pretrained(model, tmp_path / "hub")
    if spec is QWEN3_VL_MOE:  # transposed, as the Hub's checkpoints hold them (transformers 5.25 keeps them as held)
        anchor = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in anchor.items()}
    same_files(read_merged(tmp_path / "hub"), anchor)
    fsdpfast.save_pretrained(model, tmp_path / "packed", expert_layout="packed")
    same_files(read_merged(tmp_path / "packed"), {k: v.contiguous() for k, v in model.state_dict().items()})


def test_an_unknown_expert_layout_is_refused(tmp_path):
    with pytest.raises(BadInput, match="expert_layout='split'"):
        fsdpfast.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "out", expert_layout="split")


# families whose conversion renames more than the experts (transformers 5.25: exaone_moe's and ernie4_5_moe's
# router correction bias; minimax_m2's, which moves with block_sparse_moe)
RENAMING = [
    FamilySpec("exaone_moe", "exaone_moe", dict(moe_intermediate_size=16, num_experts=4, first_k_dense_replace=1)),
    FamilySpec("ernie4_5_moe", "ernie4_5_moe", dict(moe_intermediate_size=16, moe_num_experts=4, moe_k=2)),
    FamilySpec("minimax_m2", "minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2)),
]


@pytest.mark.parametrize("spec", RENAMING, ids=lambda s: s.name)
def test_families_that_rename_their_router_bias(tmp_path, spec):
    model = build_family_model(spec)
    model.save_pretrained(tmp_path / "anchor")
    anchor = read_merged(tmp_path / "anchor")
    assert any("e_score_correction_bias" in name for name in anchor)
    fsdpfast.save_pretrained(model, tmp_path / "live")
    same_files(read_merged(tmp_path / "live"), anchor)
    src = tmp_path / "ckpt"  # the same state dict as a one-rank checkpoint, merged offline
    model.config.save_pretrained(src / "huggingface")
    torch.save(model.state_dict(), src / "model_world_size_1_rank_0.pt")
    fsdpfast.merge(src, tmp_path / "merged")
    same_files(read_merged(tmp_path / "merged"), anchor)
