"""DTensors on a DeviceMesh that does not list its ranks in increasing order, and DTensors that
contradict themselves.

FSDP2 on `DeviceMesh("cpu", [3, 2, 1, 0])` holds piece r on rank r (its rank in the mesh dim's
process group: torch builds every group from its ranks sorted) while each DTensor records mesh
coordinate 3 - r. The rank files hold the rank map and the saving rank, so the group rank is known:
the merge places each piece there and equals the model `full_tensor()` gathers, with even sizes
(where placing by the coordinate would permute every tensor and go unnoticed) and uneven ones; HSDP
on a reversed 2-D mesh too. Files altered with torch so that a coordinate contradicts the rank map,
the rank the file is named for, or a DTensor's own size contradicts its spec, are refused in one
line (exit 2, nothing written, sources unchanged). Look-alikes: the same meshes in increasing order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import CheckpointsByWorld, assert_bit_exact, load_reference, rank_file, read_merged
from refusals import api_refuses, cli_refuses, run_cli

import fsdpfast
from fsdpfast._testing.fsdp2_writer import CheckpointSpec, write_checkpoints
from fsdpfast.readers.rank_files import UNORDERED_MESH_NOTE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EMBED = "model.embed_tokens.weight"  # (100, 64) or (101, 64): even or uneven over 4 ranks
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # (64, 64)

SPECS = {
    spec.name: (4, spec)
    for spec in [
        CheckpointSpec("reversed-even", mesh_ranks=(3, 2, 1, 0), sizes={"vocab_size": 100}, seed=61),
        CheckpointSpec("reversed-uneven", mesh_ranks=(3, 2, 1, 0), seed=62),
        CheckpointSpec("reversed-guide", layout="guide-ranks", mesh_ranks=(3, 2, 1, 0), seed=63),
        CheckpointSpec("hsdp-reversed", hsdp=True, mesh_ranks=((3, 2), (1, 0)), sizes={"vocab_size": 100}, seed=64),
        # look-alikes: increasing meshes built the same way (one not row-major, but increasing along each dim)
        CheckpointSpec("increasing", mesh_ranks=(0, 1, 2, 3), sizes={"vocab_size": 100}, seed=65),
        CheckpointSpec("hsdp-increasing", hsdp=True, mesh_ranks=((0, 1), (2, 3)), seed=66),
        CheckpointSpec("hsdp-columns", hsdp=True, mesh_ranks=((0, 2), (1, 3)), seed=67),
    ]
}
REVERSED = ["reversed-even", "reversed-uneven", "reversed-guide", "hsdp-reversed"]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> CheckpointsByWorld:
    return CheckpointsByWorld(
        str(tmp_path_factory.mktemp("meshes")), SPECS, write_checkpoints, lambda spec, root: Path(spec.folder(root))
    )


def reference(meshes, name: str):
    spec, _ = meshes.get(name)
    return load_reference(spec.reference_path(meshes.root))


def private_copy(meshes, name: str, tmp_path: Path) -> Path:
    import shutil

    _, folder = meshes.get(name)
    return Path(shutil.copytree(folder, tmp_path / "ckpt"))


def edit_with_torch(path: Path, edit) -> None:
    """Load a rank file with torch (DTensors and their meshes as objects), change it, save it back."""
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


@pytest.mark.parametrize("name", list(SPECS))
def test_merge_is_the_gathered_model(meshes, tmp_path, name):
    _, folder = meshes.get(name)
    want, tied = reference(meshes, name)
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert_bit_exact(read_merged(tmp_path / "merged"), want, tied=tied)
    assert (UNORDERED_MESH_NOTE in report.notes) == (name in REVERSED), report.notes


def test_the_files_record_the_mirrored_coordinate_and_hold_the_group_ranks_piece(meshes):
    # The premise, read with torch itself: rank r's DTensor says coordinate 3 - r, its piece is rows of piece r.
    _, folder = meshes.get("reversed-even")
    want, _ = reference(meshes, "reversed-even")
    for rank in range(4):
        value = torch.load(rank_file(folder, rank), weights_only=False)[EMBED]
        assert value.device_mesh.get_coordinate() == (3 - rank,)
        assert torch.equal(value.to_local(), want[EMBED][25 * rank : 25 * (rank + 1)])
        assert not torch.equal(value.to_local(), want[EMBED][25 * (3 - rank) : 25 * (4 - rank)])


def test_the_command_line_merges_and_verifies_a_reversed_mesh(meshes, tmp_path):
    _, folder = meshes.get("reversed-even")
    want, tied = reference(meshes, "reversed-even")
    merged = run_cli("merge", folder, "--out", tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    assert_bit_exact(read_merged(tmp_path / "merged"), want, tied=tied)
    verified = run_cli("verify", tmp_path / "merged", "--against", folder)
    assert verified.returncode == 0, verified.stderr


def _coordinate(value) -> None:
    value.device_mesh._coordinate_on_dim = (1,)  # rank 1 of an increasing mesh; this mesh puts it at (2,)


def _rank_map(value) -> None:
    mesh = value.device_mesh  # an increasing rank map under the reversed mesh's coordinate (2,)
    mesh._rank_map = torch.arange(4, dtype=torch.int)
    mesh._flatten_rank_map = (0, 1, 2, 3)


def _saving_rank(value) -> None:
    value.device_mesh._rank = 2  # rank 2's coordinate is (1,); the file records (2,)


CONTRADICTIONS = {
    # edit of every DTensor's mesh in rank 1's file (one mesh object) -> what the one line names
    "coordinate": (_coordinate, ["rank 1", "(2,)", "(1,)", "[3, 2, 1, 0]"]),
    "rank map": (_rank_map, ["rank 1", "(1,)", "(2,)", "[0, 1, 2, 3]"]),
    "saving rank": (_saving_rank, ["rank 2", "(1,)", "(2,)"]),
}


@pytest.mark.parametrize("face", ["cli", "api"])
@pytest.mark.parametrize("what", list(CONTRADICTIONS))
def test_a_coordinate_that_contradicts_the_rank_map_is_refused(meshes, tmp_path, what, face):
    folder = private_copy(meshes, "reversed-even", tmp_path)
    edit, mentions = CONTRADICTIONS[what]
    edit_with_torch(rank_file(folder, 1), lambda state: edit(state[Q_PROJ]))
    mentions = [rank_file(folder, 1), *mentions]
    if face == "cli":
        line = cli_refuses(folder, tmp_path / "out", mentions=mentions)
    else:
        line = api_refuses(folder, tmp_path / "out", mentions=mentions)
    assert "records coordinate" in line, line


def test_a_file_whose_mesh_names_another_rank_than_its_name_is_refused(meshes, tmp_path):
    # Rank 1's file made consistent with rank 2's place (rank and coordinate): its name still says rank 1.
    folder = private_copy(meshes, "reversed-even", tmp_path)

    def claim_rank_2(state):
        mesh = state[Q_PROJ].device_mesh
        mesh._rank, mesh._coordinate_on_dim = 2, (1,)

    edit_with_torch(rank_file(folder, 1), claim_rank_2)
    cli_refuses(folder, tmp_path / "out", mentions=[rank_file(folder, 1), "rank 2 saved it, not rank 1"])


def _spec_meta(shape, stride):
    """An edit giving Q_PROJ's DTensor a spec whose tensor_meta says `shape` / `stride` (its own size stays)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    def edit(state):
        value = state[Q_PROJ]
        spec = value._spec
        meta = TensorMeta(torch.Size(shape), stride, spec.tensor_meta.dtype)
        value._spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)

    return edit


def _placements(*placements):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    def edit(state):
        value = state[Q_PROJ]
        value._spec = DTensorSpec(value._spec.mesh, placements, tensor_meta=value._spec.tensor_meta)

    return edit


def _self_contradictions():
    from torch.distributed.tensor import Shard

    return {
        "size": (_spec_meta((64, 60), (60, 1)), [Q_PROJ, "size (64, 64)", "(64, 60)", "tensor_meta"]),
        "stride": (_spec_meta((64, 64), (1, 64)), [Q_PROJ, "stride (64, 1)", "(1, 64)", "tensor_meta"]),
        "placements for the mesh": (_placements(Shard(0), Shard(0)), [Q_PROJ, "2 placements for a 1-D mesh"]),
        "shard dim": (_placements(Shard(2)), [Q_PROJ, "shards dim 2 of a tensor of 2 dims"]),
    }


@pytest.mark.parametrize("what", ["size", "stride", "placements for the mesh", "shard dim"])
@pytest.mark.parametrize("rank", [0, 3])  # rank 0's file is read in full, later ones as its twins
def test_a_dtensor_that_contradicts_its_spec_is_refused(meshes, tmp_path, what, rank):
    folder = private_copy(meshes, "reversed-even", tmp_path)
    edit, mentions = _self_contradictions()[what]
    edit_with_torch(rank_file(folder, rank), edit)
    refuses = cli_refuses if rank == 0 else api_refuses
    refuses(folder, tmp_path / "out", mentions=[rank_file(folder, rank), *mentions])
