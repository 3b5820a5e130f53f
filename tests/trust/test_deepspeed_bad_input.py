"""Damaged DeepSpeed ZeRO checkpoints: one line, exit 2, nothing written, the checkpoint untouched.

Each case damages a private copy of a real checkpoint written by DeepSpeed (the session fixture):
files removed or cut, `latest` rewritten, model states edited with real torch, pickles tampered with.
"""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_exact, copy_checkpoint, read_merged
from refusals import api_refuses, cli_refuses
from test_unsafe_pickles import payload_bytes, rewrite_data_pkl

import fsdpfast
from fsdpfast.errors import UnsafeCheckpoint

# Minutes of Python-only checks: CI runs them with the CPU torch, not again with the CUDA one (docs/development.md)
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

Z2 = "ds-w2-z2-bf16-frozen-tags"  # root: latest -> global_step2, and an older tag `first`
Z3 = "ds-w2-z3-fp32-tied-frozen"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"  # frozen in both
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def tag_dir(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def optim_file(root: Path, rank: int) -> Path:
    (path,) = tag_dir(root).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return path


def model_states(root: Path, rank: int = 0) -> Path:
    (path,) = [
        p
        for p in tag_dir(root).glob("*model_states.pt")
        if p.name in ("mp_rank_00_model_states.pt", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    ]
    return path


def edit_model_states(path: Path, edit: Callable[[dict], None]) -> None:
    """Model-states files pickle only torch types: real torch loads, edits and saves them."""
    whole = torch.load(path, weights_only=True)
    edit(whole)
    torch.save(whole, path)


def edit_optim_states(path: Path, edit: Callable[[dict], None]) -> None:
    """Optimizer files pickle DeepSpeed classes: torch loads them with deepspeed importable (the tests' extra)."""
    whole = torch.load(path, weights_only=False)
    edit(whole["optimizer_state_dict"])
    torch.save(whole, path)


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# Each damage changes the copy and returns what the error must mention.


def remove_optim_rank_1(root: Path, others) -> list:
    victim = optim_file(root, 1)
    victim.unlink()
    return [victim, "missing"]


def remove_optim_rank_0(root: Path, others) -> list:
    victim = optim_file(root, 0)
    victim.unlink()
    return [victim, "missing"]


def remove_stage3_model_states_rank_1(root: Path, others) -> list:
    victim = model_states(root, 1)
    victim.unlink()
    return [victim, "missing"]


def remove_model_states(root: Path, others) -> list:
    victim = model_states(root)
    victim.unlink()
    return [victim, "missing"]


def latest_names_a_missing_tag(root: Path, others) -> list:
    (root / "latest").write_text("global_step9")
    return ["latest", "global_step9", "is missing", "tags present: first, global_step2", "--tag"]


def no_latest_and_two_tags(root: Path, others) -> list:
    (root / "latest").unlink()
    return ["no `latest` file", "first, global_step2", "--tag"]


def truncate_optim_rank_1(root: Path, others) -> list:
    victim = optim_file(root, 1)
    cut_in_half(victim)
    return [victim, "truncated"]


def truncate_model_states(root: Path, others) -> list:
    victim = model_states(root)
    cut_in_half(victim)
    return [victim, "truncated"]


def resize_q_proj_in_param_shapes(rows: int):
    def damage(root: Path, others) -> list:
        def edit(whole):
            group = next(g for g in whole["param_shapes"] if Q_PROJ in g)
            group[Q_PROJ] = torch.Size([rows, 64])

        victim = model_states(root)
        edit_model_states(victim, edit)
        return [victim, "param_shapes disagrees with the partitions"]

    return damage


def shrink_a_stage3_frozen_piece(root: Path, others) -> list:
    victim = model_states(root, 1)
    edit_model_states(
        victim,
        lambda whole: whole["frozen_param_fragments"].update(
            {UP_PROJ: whole["frozen_param_fragments"][UP_PROJ][:-1].clone()}
        ),
    )
    return [victim, UP_PROJ, "partition sizes disagree"]


def optim_file_of_another_stage(root: Path, others) -> list:
    other_root = Path(others.get(Z3)[1])
    victim = optim_file(root, 1)
    victim.unlink()
    shutil.copy(optim_file(other_root, 1), victim)
    return [victim, "stage 3", "stage 2", "different runs"]


def model_states_as_optim_file(root: Path, others) -> list:
    victim = optim_file(root, 1)
    shutil.copy(model_states(root), victim)
    return [victim, "not a DeepSpeed ZeRO optimizer file"]


def model_states_field(field: str, value):
    """A model-states entry of another type than DeepSpeed writes (a corrupt or foreign file)."""

    def damage(root: Path, others) -> list:
        victim = model_states(root)
        edit_model_states(victim, lambda whole: whole.update({field: value}))
        return [victim, field, "the file is corrupt"]

    return damage


def optim_states_field(field: str, value):
    def damage(root: Path, others) -> list:
        victim = optim_file(root, 0)
        edit_optim_states(victim, lambda state: state.update({field: value}))
        return [victim, field, "the file is corrupt"]

    return damage


# --- files of two saves of one run (latest -> global_step2, the older save in first/) --------


def from_the_save_before(root: Path, victim: Path) -> str:
    """Replace a file of the latest save by its namesake from the save before (a crash part way, a stray copy)."""
    shutil.copy(root / "first" / victim.name, victim)
    return victim.name


def older_optim_rank_1(root: Path, others) -> list:
    rank_1, rank_0 = from_the_save_before(root, optim_file(root, 1)), optim_file(root, 0).name
    return [tag_dir(root), f"{rank_1} is from optimizer step 1", f"{rank_0} from optimizer step 2", "mixes two saves"]


def older_model_states(root: Path, others) -> list:
    """Stage 1/2's one model-states file: only the optimizer files' step can tell (they cannot be ahead of it)."""
    older = from_the_save_before(root, model_states(root))
    return [f"{optim_file(root, 0).name} is from optimizer step 2", f"{older} from global_steps 1", "mixes two saves"]


def older_stage3_files(rank: int, *kinds: str):
    def damage(root: Path, others) -> list:
        for kind in kinds:
            from_the_save_before(root, tag_dir(root) / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
        kind, counter = ("optim", "optimizer step") if "optim" in kinds else ("model", "global_steps")
        steps = {rank: 1, 1 - rank: 2}
        return [
            f"zero_pp_rank_1_mp_rank_00_{kind}_states.pt is from {counter} {steps[1]}",
            f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt from {counter} {steps[0]}",
            "point fsdpfast at one save's folder",
        ]

    return damage


def reshape_on_rank_1(field: str, name: str, shape: list[int]):
    """Stage 3: one rank's copy of the shapes edited (the merge lays out every rank by rank 0's)."""

    def damage(root: Path, others) -> list:
        victim = model_states(root, 1)
        edit_model_states(victim, lambda whole: _set_shape(whole[field], name, torch.Size(shape)))
        return [victim.name, f"records {field} {name} {shape}", "zero_pp_rank_0_mp_rank_00_model_states.pt", name]

    return damage


def _set_shape(shapes, name: str, shape) -> None:
    groups = shapes if isinstance(shapes, list) else [shapes]
    next(g for g in groups if name in g)[name] = shape


def reorder_param_shapes_on_rank_1(root: Path, others) -> list:
    victim = model_states(root, 1)

    def edit(whole):
        group = whole["param_shapes"][0]
        first = next(iter(group))
        group[first] = group.pop(first)  # the same shapes, the first parameter moved last

    edit_model_states(victim, edit)
    return [victim.name, "param_shapes", "at position 0"]


def alignment_paddings_on_rank_1(root: Path, others) -> list:
    victim = optim_file(root, 1)
    edit_optim_states(victim, lambda state: state["param_alignment_paddings"][0].__setitem__(0, 2))
    return [victim.name, "param_alignment_paddings", "two runs or saves"]


def dp_world_size_of_another_run(root: Path, others) -> list:
    edit_model_states(model_states(root), lambda whole: whole.update(dp_world_size=4))
    return ["mp_rank_00_model_states.pt records dp_world_size 4", "over 2 ranks (partition_count)"]


def model_states_of_a_stage_1_run(root: Path, others) -> list:
    edit_model_states(model_states(root), lambda whole: whole["ds_config"]["zero_optimization"].update(stage=1))
    return ["mp_rank_00_model_states.pt records the ZeRO stage 1", "the optimizer files are of ZeRO stage 2"]


def ds_version_on_rank_1(root: Path, others) -> list:
    victim = optim_file(root, 1)
    whole = torch.load(victim, weights_only=False)
    whole["ds_version"] = "0.18.0"
    torch.save(whole, victim)
    return [f"{victim.name} is from ds_version 0.18.0", "from ds_version 0.19.8"]


def add_dcp_files(root: Path, others) -> list:
    (root / ".metadata").write_bytes(b"")
    (root / "__0_0.distcp").write_bytes(b"")
    return ["several layouts", "deepspeed-zero", "dcp", "--layout"]


@dataclass(frozen=True)
class Damage:
    checkpoint: str
    damage: Callable[[Path, object], list]


DAMAGES = {
    "missing optimizer rank": Damage(Z2, remove_optim_rank_1),
    "missing optimizer rank 0": Damage(Z2, remove_optim_rank_0),
    "missing stage 3 model states rank": Damage(Z3, remove_stage3_model_states_rank_1),
    "missing model states": Damage(Z2, remove_model_states),
    "latest names a missing folder": Damage(Z2, latest_names_a_missing_tag),
    "no latest, two tags": Damage(Z2, no_latest_and_two_tags),
    "truncated optimizer file": Damage(Z2, truncate_optim_rank_1),
    "truncated model states": Damage(Z3, truncate_model_states),
    "stage 1/2 partitions shorter than param_shapes": Damage(Z2, resize_q_proj_in_param_shapes(65)),
    "stage 1/2 partitions longer than param_shapes": Damage(Z2, resize_q_proj_in_param_shapes(63)),
    "stage 3 partitions shorter than param_shapes": Damage(Z3, resize_q_proj_in_param_shapes(65)),
    "stage 3 partitions longer than param_shapes": Damage(Z3, resize_q_proj_in_param_shapes(63)),
    "stage 3 frozen piece of the wrong size": Damage(Z3, shrink_a_stage3_frozen_piece),
    "optimizer file of another run": Damage(Z2, optim_file_of_another_stage),
    "not an optimizer file": Damage(Z2, model_states_as_optim_file),
    "two layouts in one folder": Damage(Z2, add_dcp_files),
    "shared_params not a map": Damage(Z2, model_states_field("shared_params", 5)),
    "stage 3 shared_params a list": Damage(Z3, model_states_field("shared_params", ["lm_head.weight"])),
    "buffer_names not a list": Damage(Z2, model_states_field("buffer_names", 3)),
    "alignment paddings for fewer groups": Damage(Z2, optim_states_field("param_alignment_paddings", [])),
    "alignment paddings not whole numbers": Damage(Z2, optim_states_field("param_alignment_paddings", [["4"]])),
    "partition_count of lists": Damage(Z2, optim_states_field("partition_count", [[2]])),
    "stage 2: rank 1's optimizer file of the save before": Damage(Z2, older_optim_rank_1),
    "stage 2: model states of the save before": Damage(Z2, older_model_states),
    "stage 3: rank 1's optimizer file of the save before": Damage(Z3, older_optim_rank_1),
    "stage 3: rank 0's model states of the save before": Damage(Z3, older_stage3_files(0, "model")),
    "stage 3: rank 1's model states of the save before": Damage(Z3, older_stage3_files(1, "model")),
    "stage 3: both of rank 1's files of the save before": Damage(Z3, older_stage3_files(1, "model", "optim")),
    "stage 3: param_shapes differ on rank 1": Damage(Z3, reshape_on_rank_1("param_shapes", Q_PROJ, [65, 64])),
    "stage 3: param_shapes order differs on rank 1": Damage(Z3, reorder_param_shapes_on_rank_1),
    "stage 3: frozen_param_shapes differ on rank 1": Damage(
        Z3, reshape_on_rank_1("frozen_param_shapes", UP_PROJ, [64, 88])
    ),
    "stage 2: param_alignment_paddings differ on rank 1": Damage(Z2, alignment_paddings_on_rank_1),
    "stage 2: dp_world_size of another run": Damage(Z2, dp_world_size_of_another_run),
    "stage 2: model states of a stage 1 run": Damage(Z2, model_states_of_a_stage_1_run),
    "stage 2: ds_version differs on rank 1": Damage(Z2, ds_version_on_rank_1),
}


def damaged_copy(deepspeed_checkpoints, tmp_path: Path, case: str) -> tuple[Path, list]:
    _, root = deepspeed_checkpoints.get(DAMAGES[case].checkpoint)
    copy = Path(shutil.copytree(root, tmp_path / "ckpt"))
    return copy, DAMAGES[case].damage(copy, deepspeed_checkpoints)


@pytest.mark.parametrize("refuses", [cli_refuses, api_refuses], ids=["cli", "api"])
@pytest.mark.parametrize("case", DAMAGES)
def test_damaged_checkpoint_is_refused(deepspeed_checkpoints, tmp_path, case, refuses):
    root, mentions = damaged_copy(deepspeed_checkpoints, tmp_path, case)
    refuses(root, tmp_path / "out", mentions=mentions)


def test_two_layouts_merge_with_layout_chosen(deepspeed_checkpoints, tmp_path):
    root, _ = damaged_copy(deepspeed_checkpoints, tmp_path, "two layouts in one folder")
    spec, _ = deepspeed_checkpoints.get(Z2)
    fsdpfast.merge(root, tmp_path / "out", layout="deepspeed-zero")
    reference = torch.load(spec.reference_path(deepspeed_checkpoints.root), weights_only=True)
    assert_bit_exact(read_merged(str(tmp_path / "out")), reference["state_dict"])


def test_wrong_tag(deepspeed_checkpoints, tmp_path):
    _, root = deepspeed_checkpoints.get(Z2)
    mentions = ["--tag 'global_step7'", "no such checkpoint", "tags present: first, global_step2"]
    cli_refuses(root, tmp_path / "out", "--tag", "global_step7", mentions=mentions)
    api_refuses(root, tmp_path / "out", mentions=mentions, tag="global_step7")


def test_tag_that_disagrees_with_the_tag_folder_given(deepspeed_checkpoints, tmp_path):
    _, root = deepspeed_checkpoints.get(Z2)
    cli_refuses(f"{root}/first", tmp_path / "out", "--tag", "global_step2", mentions=["tag 'first'", "checkpoint root"])


def test_tag_on_another_layout(tmp_path):
    folder = tmp_path / "fsdp"
    folder.mkdir()
    for rank in range(2):
        (folder / f"model_world_size_2_rank_{rank}.pt").write_bytes(b"")
    cli_refuses(
        folder, tmp_path / "out", "--tag", "global_step1", mentions=["--tag applies to deepspeed-zero", "fsdp-ranks"]
    )


# --- tampered pickles: DeepSpeed's classes are allow-listed by exact name, nothing else runs ----


@pytest.mark.parametrize(
    "replacement",
    ["os\nsystem", "deepspeed.runtime.engine\nDeepSpeedEngine", "deepspeed.runtime.fp16.loss_scaler\nLossScalerBase"],
)
def test_tampered_class_in_an_optimizer_file_is_refused(deepspeed_checkpoints, tmp_path, replacement):
    _, root = deepspeed_checkpoints.get(Z2)
    copy = Path(shutil.copytree(root, tmp_path / "ckpt"))
    victim = optim_file(copy, 1)
    with zipfile.ZipFile(victim) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        pickled = archive.read(name)
    original = b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n"
    assert original in pickled  # torch.save's protocol 2 names the class with a GLOBAL opcode
    rewrite_data_pkl(victim, pickled.replace(original, f"c{replacement}\n".encode()))
    qualname = replacement.replace("\n", ".")
    line = cli_refuses(copy, tmp_path / "out", mentions=["refusing to unpickle", victim])
    assert qualname in line or (qualname == "os.system" and "posix.system" in line)
    with pytest.raises(UnsafeCheckpoint):
        fsdpfast.merge(copy, tmp_path / "out")


def test_live_payload_in_an_optimizer_file_never_runs(deepspeed_checkpoints, tmp_path):
    _, root = deepspeed_checkpoints.get(Z3)
    copy = Path(shutil.copytree(root, tmp_path / "ckpt"))
    marker = tmp_path / "MARKER"
    victim = optim_file(copy, 1)
    rewrite_data_pkl(victim, payload_bytes("os.system", marker))
    cli_refuses(copy, tmp_path / "out", mentions=["refusing to unpickle", victim])
    assert not marker.exists()


def test_a_latest_file_alone_is_not_a_deepspeed_checkpoint(checkpoints, tmp_path):
    """Other tools write a `latest` file too: only a folder of DeepSpeed files makes a DeepSpeed checkpoint."""
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    (folder / "latest").write_text("global_step1")
    assert fsdpfast.merge(folder, tmp_path / "out").layout == "fsdp-ranks"


# --- look-alikes of two saves: one save, whichever tag or route, merges bit-exact ------------


@pytest.mark.parametrize("name", [Z2, Z3])
@pytest.mark.parametrize("tag", ["first", None], ids=["older-tag", "latest"])
def test_each_save_of_a_run_merges_bit_exact(deepspeed_checkpoints, tmp_path, name, tag):
    spec, root = deepspeed_checkpoints.get(name)
    report = fsdpfast.merge(root, tmp_path / "out", tag=tag)
    reference = torch.load(spec.reference_path(deepspeed_checkpoints.root, tag), weights_only=True)
    assert_bit_exact(read_merged(str(tmp_path / "out")), reference["state_dict"], tied=reference["tied"])
    step = 1 if tag else 2
    files = 3 if name == Z2 else 4
    assert f"one save: {files} rank files agree on global_steps {step} and optimizer step {step}" in report.notes


@pytest.mark.parametrize("name", [Z2, Z3])
def test_an_optimizer_behind_the_engine_merges(deepspeed_checkpoints, tmp_path, name):
    """A run resumed without its optimizer states counts engine steps on while Adam's `step` restarts,
    and fp16 overflows count skipped steps the optimizer never took: only an optimizer ahead is refused."""
    spec, root = deepspeed_checkpoints.get(name)
    copy = Path(shutil.copytree(root, tmp_path / "ckpt"))
    for path in tag_dir(copy).glob("*model_states.pt"):
        edit_model_states(path, lambda whole: whole.update(global_steps=9, skipped_steps=7))  # 2 unskipped
    fsdpfast.merge(copy, tmp_path / "out")
    reference = torch.load(spec.reference_path(deepspeed_checkpoints.root), weights_only=True)
    assert_bit_exact(read_merged(str(tmp_path / "out")), reference["state_dict"], tied=reference["tied"])
    for path in tag_dir(copy).glob("*model_states.pt"):
        edit_model_states(path, lambda whole: whole.update(skipped_steps=8))  # 1 unskipped: Adam's 2 is ahead
    cli_refuses(copy, tmp_path / "out2", mentions=["is from optimizer step 2", "from global_steps 9 (8 skipped)"])


@pytest.mark.parametrize("name", [Z2, Z3])
def test_two_saves_are_refused_by_every_route_to_the_tag(deepspeed_checkpoints, tmp_path, name):
    """`latest`, `--tag` and the tag folder given itself all read the files through the same check."""
    _, root = deepspeed_checkpoints.get(name)
    copy = Path(shutil.copytree(root, tmp_path / "ckpt"))
    latest = tag_dir(copy)
    (stray,) = latest.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    shutil.copy(stray, copy / "first" / stray.name)  # the newer save's rank 1 in the older tag folder
    mentions = [f"{stray.name} is from optimizer step 2", "from optimizer step 1", "mixes two saves"]
    cli_refuses(copy, tmp_path / "out", "--tag", "first", mentions=[copy / "first", *mentions])
    api_refuses(copy / "first", tmp_path / "out", mentions=[copy / "first", *mentions])
    fsdpfast.merge(latest, tmp_path / "latest")  # the other tag of the same root is still one save
