"""Bad input: one line on stderr, exit 2, no output folder, no staging folder, sources untouched.

Every damaged checkpoint is a copy of a real FSDP2 checkpoint (the session fixture), damaged
with real torch (torch.load / torch.save) or by cutting and flipping bytes of its files.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (lets torch.load(weights_only=True) rebuild DTensors)
from helpers import copy_checkpoint, rank_file
from refusals import (
    K_PROJ,
    Q_PROJ,
    api_refuses,
    assert_mentions,
    cli_refuses,
    edit_state_dict,
    leftovers,
    load_state_dict,
    run_cli,
    the_error_line,
    tree_digest,
)
from torch.distributed.tensor import DTensor, Shard

import fsdpfast
from fsdpfast.errors import BadInput

# Minutes of Python-only checks: CI runs them with the CPU torch, not again with the CUDA one (docs/development.md)
pytestmark = pytest.mark.slow


# --- damaging a private copy of a real checkpoint ---------------------------------------------


def zip_member_span(path: Path, suffix: str) -> tuple[int, int]:
    """(byte offset, length) of the stored bytes of the zip member whose name ends with `suffix`."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def flip_bytes(path: Path, start: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# Each damage changes the copy and returns what the error line must mention.


def remove_rank_1(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    victim.unlink()
    return [victim, "missing"]


def add_a_rank_file_of_another_world_size(folder: Path, checkpoints) -> list:
    shutil.copy(rank_file(folder, 0), folder / "model_world_size_3_rank_0.pt")
    return [folder, "world sizes"]


def swap_in_a_tensor_of_another_shape(folder: Path, checkpoints) -> list:
    # k_proj is a real DTensor of the same mesh but global shape (32, 64) instead of (64, 64).
    victim = rank_file(folder, 1)
    edit_state_dict(victim, lambda state: state.update({Q_PROJ: state[K_PROJ]}))
    return [victim, Q_PROJ, "shape", "(32, 64)"]


def swap_in_a_bf16_tensor(folder: Path, checkpoints) -> list:
    # The same-named DTensor of a real bf16 checkpoint of the same model and world size.
    _, bf16_folder = checkpoints.get("w2-tied-bf16")
    bf16_q = load_state_dict(rank_file(Path(bf16_folder), 1))[Q_PROJ]
    victim = rank_file(folder, 1)
    edit_state_dict(victim, lambda state: state.update({Q_PROJ: bf16_q}))
    return [victim, Q_PROJ, "dtype", "bfloat16"]


def swap_in_a_shard_1_tensor(folder: Path, checkpoints) -> list:
    # No 2-rank example shards along dim 1, so torch's own DTensor.from_local builds one on the
    # DeviceMesh unpickled from this very rank file (run_check=False needs no process group).
    def reshard(state):
        q = state[Q_PROJ]
        state[Q_PROJ] = DTensor.from_local(q.to_local().reshape(64, 32), q.device_mesh, [Shard(1)], run_check=False)

    victim = rank_file(folder, 1)
    edit_state_dict(victim, reshard)
    return [victim, Q_PROJ, "placements", "Shard(1)"]


def drop_one_tensor(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    edit_state_dict(victim, lambda state: state.pop("model.norm.weight"))
    return [victim, "model.norm.weight"]


def copy_rank_0_over_rank_1(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    shutil.copy(rank_file(folder, 0), victim)
    return [victim, "copies of one rank"]


def cut_rank_1_in_half(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return [victim, "truncated"]


def corrupt_data_pkl(folder: Path, checkpoints) -> list:
    # Flipped bytes inside data.pkl: the zip stays readable, the member's CRC-32 fails.
    victim = rank_file(folder, 1)
    start, length = zip_member_span(victim, "/data.pkl")
    flip_bytes(victim, start + length // 2, 16)
    return [victim, "corrupt"]


def empty_rank_1(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    victim.write_bytes(b"")
    return [victim, "empty"]


def save_rank_1_in_the_legacy_format(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    torch.save(torch.load(victim, weights_only=True), victim, _use_new_zipfile_serialization=False)
    return [victim, "legacy"]


def replace_rank_1_with_a_zip_of_text(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    with zipfile.ZipFile(victim, "w") as archive:
        archive.writestr("README.md", "not a checkpoint")
    return [victim, "data.pkl"]


def save_a_list_as_rank_1(folder: Path, checkpoints) -> list:
    victim = rank_file(folder, 1)
    torch.save(list(load_state_dict(victim).values()), victim)
    return [victim, "not a state dict"]


def write_fsdp_config(world_size):
    def damage(folder: Path, checkpoints) -> list:
        config = folder / "fsdp_config.json"
        config.write_text(json.dumps({"world_size": world_size}))
        return [config, "world_size"]

    return damage


def write_unreadable_fsdp_config(folder: Path, checkpoints) -> list:
    config = folder / "fsdp_config.json"
    config.write_text('{"world_size": 2,')
    return [config, "unreadable"]


def add_guide_layout_files(folder: Path, checkpoints) -> list:
    _, guide = checkpoints.get("w2-guide")
    for path in Path(guide).glob("model_pt_rank_*.pt"):
        shutil.copy(path, folder / path.name)
    return [folder, "--layout", "fsdp-ranks", "guide-ranks"]


@dataclass(frozen=True)
class Damage:
    base: str  # the real checkpoint that is copied, then damaged
    apply: Callable[[Path, object], list]


DAMAGES = {
    "missing rank file": Damage("w2-llama", remove_rank_1),
    "two world sizes": Damage("w2-llama", add_a_rank_file_of_another_world_size),
    "shapes disagree": Damage("w2-llama", swap_in_a_tensor_of_another_shape),
    "dtypes disagree": Damage("w2-llama", swap_in_a_bf16_tensor),
    "placements disagree": Damage("w2-llama", swap_in_a_shard_1_tensor),
    "state dicts disagree": Damage("w2-llama", drop_one_tensor),
    "rank file duplicated": Damage("w2-llama", copy_rank_0_over_rank_1),
    "truncated rank file": Damage("w2-llama", cut_rank_1_in_half),
    "corrupt data.pkl": Damage("w2-llama", corrupt_data_pkl),
    "empty rank file": Damage("w2-llama", empty_rank_1),
    "legacy torch.save": Damage("w2-llama", save_rank_1_in_the_legacy_format),
    "zip without data.pkl": Damage("w2-llama", replace_rank_1_with_a_zip_of_text),
    "not a state dict": Damage("w2-llama", save_a_list_as_rank_1),
    "fsdp_config world_size disagrees": Damage("w2-llama", write_fsdp_config(4)),
    "fsdp_config world_size not a number": Damage("w2-llama", write_fsdp_config("two")),
    "fsdp_config world_size a list": Damage("w2-llama", write_fsdp_config([2])),
    "fsdp_config not JSON": Damage("w2-llama", write_unreadable_fsdp_config),
    "two layouts": Damage("w2-llama", add_guide_layout_files),
}
DAMAGE_CASES = [pytest.param(name, id=name) for name in DAMAGES]


def damaged_copy(checkpoints, tmp_path: Path, name: str) -> tuple[Path, list]:
    damage = DAMAGES[name]
    folder = copy_checkpoint(checkpoints, damage.base, tmp_path)
    return folder, damage.apply(folder, checkpoints)


# --- damaged checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("name", DAMAGE_CASES)
def test_damaged_checkpoint_is_refused_by_the_cli(checkpoints, tmp_path, name):
    folder, mentions = damaged_copy(checkpoints, tmp_path, name)
    cli_refuses(folder, tmp_path / "merged", mentions=mentions)


@pytest.mark.parametrize("name", DAMAGE_CASES)
def test_damaged_checkpoint_is_refused_by_the_api(checkpoints, tmp_path, name):
    folder, mentions = damaged_copy(checkpoints, tmp_path, name)
    api_refuses(folder, tmp_path / "merged", mentions=mentions)


def test_damaged_checkpoint_leaves_an_existing_output_alone_even_with_overwrite(checkpoints, tmp_path):
    folder, mentions = damaged_copy(checkpoints, tmp_path, "truncated rank file")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier merge")
    before = tree_digest(out)
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite"))
    assert_mentions(line, mentions)
    assert tree_digest(out) == before
    assert leftovers(out) == [out.name]  # the old folder only, no staging beside it


# --- folders that are not checkpoints ---------------------------------------------------------


def test_empty_folder(tmp_path):
    (tmp_path / "ckpt").mkdir()
    cli_refuses(tmp_path / "ckpt", tmp_path / "merged", mentions=[tmp_path / "ckpt", "empty"])


def test_folder_with_no_known_layout(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "README.md").write_text("# my model\n")
    cli_refuses(folder, tmp_path / "merged", mentions=[folder, "no known checkpoint layout", "model_world_size_"])


def test_nonexistent_folder_cli(tmp_path):
    cli_refuses(tmp_path / "nowhere", tmp_path / "merged", mentions=[tmp_path / "nowhere", "no such folder"])


def test_nonexistent_folder_api(tmp_path):
    api_refuses(tmp_path / "nowhere", tmp_path / "merged", mentions=[tmp_path / "nowhere", "no such folder"])


def test_path_that_is_a_file(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    single = rank_file(folder, 0)
    cli_refuses(single, tmp_path / "merged", mentions=[single, "not a folder"])


# --- the output folder ------------------------------------------------------------------------


def test_existing_output_folder_is_refused_and_left_untouched(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = tree_digest(out)
    source_before = tree_digest(folder)
    line = the_error_line(run_cli("merge", folder, "--out", out))
    assert_mentions(line, [out, "already exists", "--overwrite"])
    assert tree_digest(out) == before
    assert tree_digest(folder) == source_before
    assert leftovers(out) == [out.name]


@pytest.mark.parametrize("earlier", ["an earlier merge", "an empty folder"])
def test_existing_output_folder_is_replaced_with_overwrite(checkpoints, tmp_path, earlier):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    if earlier == "an earlier merge":  # files added to it are refused (tests/stages/test_output_folder.py)
        fsdpfast.merge(folder, out, dtype="bf16")
    else:
        out.mkdir()
    earlier_digest = tree_digest(out)
    source_before = tree_digest(folder)
    result = run_cli("merge", folder, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert tree_digest(out) != earlier_digest and (out / "model.safetensors").is_file()
    assert leftovers(out) == [out.name]  # no staging folder, no old copy
    assert tree_digest(folder) == source_before


@pytest.mark.parametrize("holding", ["a file of its own", "other models", "a folder named like the manifest"])
def test_overwrite_refuses_a_folder_fsdpfast_did_not_write(checkpoints, tmp_path, holding):
    # `--out ~/models --overwrite` must not delete every other model in ~/models.
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "models"
    out.mkdir()
    if holding == "a file of its own":
        (out / "notes.txt").write_text("keep me")
    elif holding == "other models":
        fsdpfast.merge(folder, out / "llama")  # a merged model one level down is still not OUT_DIR's own
    else:
        (out / "fsdpfast-manifest.json").mkdir()
    before = tree_digest(out)
    entries_before = sorted(p.relative_to(out) for p in out.rglob("*"))
    source_before = tree_digest(folder)
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite"))
    assert_mentions(line, [out, "fsdpfast did not write", "remove it yourself or choose another folder"])
    assert tree_digest(out) == before and sorted(p.relative_to(out) for p in out.rglob("*")) == entries_before
    assert leftovers(out) == [out.name]
    assert tree_digest(folder) == source_before
    with pytest.raises(BadInput, match="fsdpfast did not write"):
        fsdpfast.merge(folder, out, overwrite=True)
    assert tree_digest(out) == before
    dry = run_cli("merge", folder, "--out", out, "--dry-run")  # the plan says so before anything runs
    assert dry.returncode == 0 and "the merge will refuse it, even with --overwrite" in dry.stdout


def test_existing_output_file_is_not_replaced_even_with_overwrite(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    out.write_text("a file, not a folder")
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite"))
    assert_mentions(line, [out, "not a folder"])
    assert out.read_text() == "a file, not a folder"
    assert leftovers(out) == [out.name]


def test_output_parent_that_is_a_file(checkpoints, tmp_path):
    # missing parents are created (tests/stages/test_output_folder.py); a file in the way is not replaced
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    (tmp_path / "no").write_text("a file")
    out = tmp_path / "no" / "such" / "merged"
    cli_refuses(folder, out, mentions=[tmp_path / "no", "is not a folder"])
    assert (tmp_path / "no").read_text() == "a file"


@pytest.mark.parametrize(
    "spelling,overwrite",
    [
        ("same", ()),
        ("same", ("--overwrite",)),
        ("trailing slash", ("--overwrite",)),
        ("dot segments", ("--overwrite",)),
    ],
)
def test_output_equal_to_the_checkpoint_folder(checkpoints, tmp_path, spelling, overwrite):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = {"same": str(folder), "trailing slash": f"{folder}/", "dot segments": f"{folder}/../{folder.name}/."}[
        spelling
    ]
    before = tree_digest(folder)
    line = the_error_line(run_cli("merge", folder, "--out", out, *overwrite))
    assert_mentions(line, ["would replace or contain the checkpoint folder", folder])
    assert tree_digest(folder) == before
    assert leftovers(folder) == [folder.name]


def test_output_folder_that_contains_the_checkpoint_api(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    before = tree_digest(tmp_path)
    with pytest.raises(BadInput, match="would replace or contain the checkpoint folder"):
        fsdpfast.merge(folder, tmp_path, overwrite=True)
    assert tree_digest(tmp_path) == before


def test_output_equal_to_the_checkpoint_folder_through_a_symlink(checkpoints, tmp_path):
    (tmp_path / "real").mkdir()
    _, original = checkpoints.get("w2-llama")
    folder = Path(shutil.copytree(original, tmp_path / "real" / "ckpt"))
    (tmp_path / "alias").symlink_to("real")
    out = tmp_path / "alias" / "ckpt"  # the same folder, spelled through a symlinked parent
    before = tree_digest(folder)
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite"))
    assert_mentions(line, ["would replace or contain the checkpoint folder"])
    assert tree_digest(folder) == before


# --- options ----------------------------------------------------------------------------------


@pytest.fixture
def w2_copy(checkpoints, tmp_path) -> Path:
    return copy_checkpoint(checkpoints, "w2-llama", tmp_path)


@pytest.mark.parametrize("dtype", ["int8", ""])
def test_bad_dtype_cli(w2_copy, tmp_path, dtype):
    cli_refuses(w2_copy, tmp_path / "merged", "--dtype", dtype, mentions=["--dtype", repr(dtype)])


def test_bad_dtype_api(w2_copy, tmp_path):
    api_refuses(w2_copy, tmp_path / "merged", dtype="float8", mentions=["dtype='float8'"])


@pytest.mark.parametrize("size", ["5XB", "-1GB", "0.1B"])
def test_bad_max_shard_size_cli(w2_copy, tmp_path, size):
    # `=` form: argparse would take a separate "-1GB" for an option
    cli_refuses(w2_copy, tmp_path / "merged", f"--max-shard-size={size}", mentions=["--max-shard-size", repr(size)])


@pytest.mark.parametrize("size", [0, -5, "5 parsecs", "1e9", "0"])
def test_bad_max_shard_size_api(w2_copy, tmp_path, size):
    api_refuses(w2_copy, tmp_path / "merged", max_shard_size=size, mentions=[f"max_shard_size={size!r}"])


@pytest.mark.parametrize(
    "argv",
    [("merge", "{src}"), ("merge", "{src}", "--out", "{out}", "--max-shard-size", "-1GB")],
    ids=["no --out", "value looks like an option"],
)
def test_command_line_mistakes_are_one_line_too(w2_copy, tmp_path, argv):
    result = run_cli(*(arg.format(src=w2_copy, out=tmp_path / "merged") for arg in argv))
    the_error_line(result)
    assert not leftovers(tmp_path / "merged")


def test_one_line_even_without_the_native_extension(tmp_path):
    # As on a machine where the extension was not built: importing its modules fails.
    hide_extension = (
        "import sys; sys.modules['fsdpfast._C'] = sys.modules['fsdpfast._native'] = None; "
        "from fsdpfast.cli import main; sys.exit(main())"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_extension, "merge", str(tmp_path / "nowhere"), "--out", str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_mentions(the_error_line(result), ["no such folder"])


def test_unknown_layout(w2_copy, tmp_path):
    cli_refuses(
        w2_copy, tmp_path / "merged", "--layout", "deepspeed", mentions=["'deepspeed'", "fsdp-ranks", "guide-ranks"]
    )


def test_layout_with_no_files_in_the_folder(w2_copy, tmp_path):
    cli_refuses(
        w2_copy, tmp_path / "merged", "--layout", "guide-ranks", mentions=[w2_copy, "guide-ranks", "model_pt_rank_"]
    )


def test_unknown_engine(w2_copy, tmp_path):
    cli_refuses(w2_copy, tmp_path / "merged", "--engine", "warp-drive", mentions=["--engine", "'warp-drive'"])


def test_config_folder_without_config_json(w2_copy, tmp_path):
    elsewhere = tmp_path / "base-model"
    elsewhere.mkdir()
    cli_refuses(w2_copy, tmp_path / "merged", "--config", elsewhere, mentions=[elsewhere, "--config", "config.json"])


def test_config_json_that_is_not_json(w2_copy, tmp_path):
    config = w2_copy / "huggingface" / "config.json"
    config.write_text("{not json")
    cli_refuses(w2_copy, tmp_path / "merged", mentions=[config, "not valid JSON"])


def test_config_json_that_is_a_list_with_dtype(w2_copy, tmp_path):
    config = w2_copy / "huggingface" / "config.json"
    config.write_text("[]")
    cli_refuses(w2_copy, tmp_path / "merged", "--dtype", "bf16", mentions=[config])


@pytest.mark.parametrize("shape", [None, "4", (2, None), -1])
def test_a_device_mesh_layout_axis_of_no_size_is_refused(w2_copy, shape):
    # Found by the fuzz target `merge`: a DeviceMesh whose layout axis has no whole-number size.
    from fsdpfast._parsing.safe_load import safe_unpickle
    from fsdpfast._parsing.torch_zip import TorchZip
    from fsdpfast.geometry.placements import read_layout

    archive = TorchZip(str(rank_file(w2_copy, 0)))
    state = safe_unpickle(archive.pickle_bytes, "rank 0")
    spec = next(value.spec for value in state.values() if hasattr(value, "spec"))
    axes = spec.get("mesh").get("_layout").get("axes")
    assert read_layout(spec, "rank 0").mesh_shape == (2,)  # as torch wrote it
    axes[0].state["shape"] = shape
    with pytest.raises(BadInput, match="^rank 0: the DeviceMesh's layout is not one torch writes"):
        read_layout(spec, "rank 0")
