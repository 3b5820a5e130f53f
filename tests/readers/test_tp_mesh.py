"""FSDP2 + tensor parallel on dp x tp meshes (and HSDP + TP on three), written by real
`parallelize_module` + `fully_shard` on gloo ranks (fsdpfast._testing.tp_examples), merged bit for bit.

Every checkpoint mixes placements on the 2-D (or 3-D) mesh — `(_StridedShard(0, split_factor=tp),
Shard(0))`, `(Shard(0), Shard(1))`, `(Shard(0), Replicate())` — with `(Shard(0),)` on the 1-D dp
sub-mesh (embeddings, norms), whose pieces every tp rank holds a copy of. Each merge equals the
unsharded model gathered with `full_tensor()` in the writing processes, and torch's own
`dcp_to_torch_save` of a DCP save of the same state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import CheckpointsByWorld, assert_bit_exact, bits, load_reference, read_merged
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdpfast
from fsdpfast._testing.tp_examples import TpSpec, write_tp_checkpoints
from fsdpfast.errors import BadInput

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HEADS_OVER_3 = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 45}
# name -> (world size, spec). Uneven on purpose: vocab 101 rows over tp and dp, 44 or 15 MLP rows
# per tp rank over 3 or 2 dp ranks, 64 rows over 3.
SPECS = {
    spec.name: (prod, spec)
    for prod, spec in [
        (4, TpSpec("tp-2x2", tp_lm_head=True, seed=41)),
        (4, TpSpec("tp-2x2-tied-bf16", model="llama-tied", dtype="bfloat16", seed=42)),
        (6, TpSpec("tp-2x3", mesh=(2, 3), tp_lm_head=True, sizes=HEADS_OVER_3, seed=43)),
        (6, TpSpec("tp-3x2", mesh=(3, 2), tp_lm_head=True, seed=44)),
        # 13 lm_head rows: tp gives 7 and 6, dp 3 + 3 + 1 and 2 + 2 + 2: torch's two readings of
        # _StridedShard differ here and DCP refuses to save it; FSDP2's pieces and full_tensor() agree
        (6, TpSpec("tp-3x2-13-rows", mesh=(3, 2), tp_lm_head=True, sizes={"vocab_size": 13}, dcp=False, seed=46)),
        (8, TpSpec("hsdp-tp-2x2x2", mesh=(2, 2, 2), tp_lm_head=True, seed=45)),
    ]
}
FORMS = ["ranks", "guide"]


class TpCheckpoints(CheckpointsByWorld):
    def __init__(self, root: str):
        super().__init__(root, SPECS, write_tp_checkpoints, lambda spec, root: spec.folder(root))

    def folder(self, name: str, form: str) -> Path:
        spec, _ = self.get(name)
        return Path({"ranks": spec.ranks_folder, "guide": spec.guide_folder, "dcp": spec.dcp_folder}[form](self.root))

    def reference(self, name: str):
        spec, _ = self.get(name)
        return load_reference(spec.reference_path(self.root))


@pytest.fixture(scope="module")
def tp(tmp_path_factory) -> TpCheckpoints:
    return TpCheckpoints(str(tmp_path_factory.mktemp("tp")))


def _placements(folder: Path) -> set[str]:
    """The placements found in rank 0's file, as fsdpfast reads them."""
    from fsdpfast._parsing.safe_load import DTensorRef, safe_unpickle
    from fsdpfast._parsing.torch_zip import TorchZip
    from fsdpfast.geometry.placements import read_layout

    (path,) = folder.glob("*_rank_0.pt")
    with TorchZip(str(path)) as archive:
        state = safe_unpickle(archive.pickle_bytes, str(path))
    state = state.get("state_dict", state)
    return {read_layout(v.spec, k).describe() for k, v in state.items() if isinstance(v, DTensorRef)}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", list(SPECS))
def test_merge_equals_full_tensor(tp, tmp_path, name, form):
    reference, tied = tp.reference(name)
    report = fsdpfast.merge(tp.folder(name, form), tmp_path / "merged")
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, tied=tied)
    assert report.world_size == SPECS[name][0]


@pytest.mark.parametrize("name", [n for n, (_, spec) in SPECS.items() if spec.dcp])
def test_merge_equals_torch_dcp_to_torch_save_and_fsdpfast_dcp(tp, tmp_path, name):
    dcp_to_torch_save(tp.folder(name, "dcp"), tmp_path / "oracle.pt")
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)
    fsdpfast.merge(tp.folder(name, "ranks"), tmp_path / "ranks")
    fsdpfast.merge(tp.folder(name, "dcp"), tmp_path / "dcp")
    from_ranks, from_dcp = read_merged(tmp_path / "ranks"), read_merged(tmp_path / "dcp")
    _, tied = tp.reference(name)
    assert set(from_ranks) == set(from_dcp) == set(oracle) - tied
    for key, got in from_ranks.items():
        assert got.dtype == oracle[key].dtype and torch.equal(bits(got), bits(oracle[key])), key
        assert torch.equal(bits(got), bits(from_dcp[key])), key


def test_the_checkpoints_hold_every_placement_of_fsdp2_with_tp(tp):
    found = _placements(tp.folder("tp-2x2", "ranks"))
    assert {
        "(_StridedShard(0, split_factor=2), Shard(0))",
        "(Shard(0), Shard(1))",
        "(Shard(0), Replicate())",
        "(Shard(0))",
    } <= found
    found = _placements(tp.folder("hsdp-tp-2x2x2", "ranks"))
    assert {"(Replicate(), _StridedShard(0, split_factor=2), Shard(0))", "(Replicate(), Shard(0))"} <= found


def test_bf16_cast_of_a_tp_checkpoint_equals_torch_to(tp, tmp_path):
    reference, tied = tp.reference("tp-3x2")
    fsdpfast.merge(tp.folder("tp-3x2", "ranks"), tmp_path / "merged", dtype="bf16")
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, dtype=torch.bfloat16, tied=tied)


# --- refused -----------------------------------------------------------------------------------


def _copy(tp, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tp.folder(name, "ranks"), tmp_path / "ckpt"))


def test_missing_tp_rank_is_named(tp, tmp_path):
    folder = _copy(tp, "tp-2x2", tmp_path)
    (folder / "model_world_size_4_rank_3.pt").unlink()
    with pytest.raises(BadInput, match="rank_3.pt is missing"):
        fsdpfast.merge(folder, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_a_tp_rank_copied_over_its_neighbour_is_refused(tp, tmp_path):
    # rank 1 holds the same dp sub-mesh pieces as rank 0, so only the recorded rank tells them apart
    folder = _copy(tp, "tp-2x2", tmp_path)
    shutil.copy(folder / "model_world_size_4_rank_0.pt", folder / "model_world_size_4_rank_1.pt")
    with pytest.raises(BadInput, match="says rank 0 saved it, not rank 1; are two files copies of one rank"):
        fsdpfast.merge(folder, tmp_path / "merged")


def test_files_of_a_smaller_world_are_refused(tp, tmp_path):
    # two files of a 4-rank checkpoint renamed as a whole 2-rank one
    folder = tmp_path / "ckpt"
    folder.mkdir()
    source = tp.folder("tp-2x2", "ranks")
    for rank in (0, 1):
        shutil.copy(source / f"model_world_size_4_rank_{rank}.pt", folder / f"model_world_size_2_rank_{rank}.pt")
    with pytest.raises(BadInput, match="belongs to a mesh of 4 ranks but the folder holds 2 rank files"):
        fsdpfast.merge(folder, tmp_path / "merged")


def test_a_piece_of_another_shape_is_refused(tp, tmp_path):
    folder = _copy(tp, "tp-3x2", tmp_path)
    victim = folder / "model_world_size_6_rank_5.pt"
    state = torch.load(victim, weights_only=False)
    name = "model.layers.0.mlp.gate_proj.weight"
    from torch.distributed.tensor import DTensor

    weight = state[name]  # one row fewer than its placements give coordinate (2, 1)
    state[name] = DTensor.from_local(
        weight.to_local()[1:].clone(),
        weight.device_mesh,
        weight.placements,
        shape=weight.shape,
        stride=weight.stride(),
        run_check=False,
    )
    torch.save(state, victim)
    with pytest.raises(
        BadInput,
        match=r"rank_5.pt: model.layers.0.mlp.gate_proj.weight: local shape \(13, 64\) but "
        r"\(_StridedShard\(0, split_factor=2\), Shard\(0\)\)",
    ):
        fsdpfast.merge(folder, tmp_path / "merged")
