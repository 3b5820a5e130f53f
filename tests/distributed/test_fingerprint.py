"""The fingerprints the ranks of a torchrun merge compare (fsdpfast/io/fingerprint.py), one process:
a copy of a file has its fingerprint, a file saved again by torch with one element changed (the
same size) has another, and each kind of file is told by what it records."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from safetensors.torch import save_file

from fsdpfast.io.fingerprint import fingerprint, planned_from
from fsdpfast.rank_agreement import RankDisagrees, check_same_copy, content_of


def _copy_and_alter(path, alter):
    """(fingerprint of `path`, of an identical copy, of `path` once `alter` rewrote it)."""
    copy = shutil.copy2(path, path.with_name("copy-" + path.name))
    before, same = fingerprint(str(path)), fingerprint(copy)
    size = path.stat().st_size
    alter(path)
    assert path.stat().st_size == size  # what a check by size alone passes
    return before, same, fingerprint(str(path))


def test_torch_save_is_told_by_its_crc32s(tmp_path):
    path = tmp_path / "rank_0.pt"
    weights = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    torch.save(weights, path)
    weights["w"][100, 7] += 1
    before, same, after = _copy_and_alter(path, lambda p: torch.save(weights, p))
    assert before.startswith("zip-crc32:") and same == before and after != before


def test_torch_save_without_crc32s_is_sampled(tmp_path):
    path = tmp_path / "rank_0.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.zeros(256, 256)}, path)
        before, same, after = _copy_and_alter(path, lambda p: torch.save({"w": torch.ones(256, 256)}, p))
    finally:
        torch.serialization.set_crc32_options(True)
    assert before.startswith("sample:") and same == before and after != before


def test_a_distcp_file_is_told_by_every_chunks_crc32s(tmp_path):
    """Each tensor of a .distcp file is a torch.save archive of its own: the fingerprint walks them
    all, so a change to the first chunk, far from the file's tail, is seen."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.save({f"t{i}": torch.randn(128, 128) for i in range(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    storage = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    first = min(storage.values(), key=lambda info: info.offset)

    def save_first_chunk_again(path):
        with open(path, "r+b") as f:
            f.seek(first.offset)
            saved = io.BytesIO()
            torch.save(torch.load(io.BytesIO(f.read(first.length)), weights_only=True) + 1, saved)
            f.seek(first.offset)
            f.write(saved.getvalue())

    before, same, after = _copy_and_alter(tmp_path / first.relative_path, save_first_chunk_again)
    assert before.startswith("zip-crc32:") and same == before and after != before
    assert fingerprint(str(tmp_path / ".metadata")).startswith("bytes:")


def test_safetensors_is_told_by_its_header_and_a_sample(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(256, 256), "b": torch.zeros(256, 256)}, path)
    renamed = lambda p: save_file({"a": torch.zeros(256, 256), "c": torch.zeros(256, 256)}, p)  # noqa: E731
    before, same, after = _copy_and_alter(path, renamed)
    assert before.startswith("safetensors:") and same == before and after != before
    save_file({"a": torch.zeros(256, 256), "c": torch.ones(256, 256)}, path)
    assert fingerprint(str(path)) != after  # the same header, other bytes in the sample


@pytest.mark.parametrize("at", [10, 116_500, 1_000_000 - 1])
def test_other_files_are_sampled(tmp_path, at):
    """First and last 64 KiB and blocks between: a whole different copy differs in them."""
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(1_000_000))

    def flip(p):
        with open(p, "r+b") as f:
            f.seek(at)
            f.write(b"\x01")

    # the 4 KiB blocks between the ends start at 64 KiB + k * (1_000_000 - 128 KiB - 4 KiB) // 17, k = 1..16
    before, same, after = _copy_and_alter(path, flip)
    assert before.startswith("sample:") and same == before and after != before


def test_a_rank_names_the_first_file_of_another_copy(tmp_path):
    """content_of covers the tensor files and the JSON files the readers plan from; check_same_copy
    names the first that differs, and the rank."""
    ours, theirs = tmp_path / "node0", tmp_path / "node1"
    ours.mkdir()
    torch.save({"w": torch.randn(64, 64)}, ours / "rank_0.pt")
    (ours / "config.json").write_text('{"hidden_size": 64}')
    (ours / "notes.txt").write_text("not read by any reader")
    rank0 = content_of(str(ours), ["rank_0.pt"])
    assert sorted(rank0) == ["config.json", "rank_0.pt"] == planned_from(str(ours), ["rank_0.pt"])
    shutil.copytree(ours, theirs)
    (theirs / "notes.txt").write_text("another note")  # not compared
    check_same_copy(str(theirs), rank0, 3)
    (theirs / "config.json").write_text('{"hidden_size": 65}')
    with pytest.raises(RankDisagrees) as refused:
        check_same_copy(str(theirs), rank0, 3)
    assert str(refused.value).startswith(f"rank 3: {theirs / 'config.json'}: not the file rank 0 planned from (")
