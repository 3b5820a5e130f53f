"""Sources read mapped or with explicit preads (--read-mode): the same bytes either way, the mode
chosen by the filesystem the checkpoint is on, and a source that shrinks under a read refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from merge_processes import comparable_manifest
from refusals import cli_refuses, run_cli

import fsdpfast
from fsdpfast import _ops
from fsdpfast.errors import BadInput
from fsdpfast.execute import runner
from fsdpfast.execute.cpu import CHUNK_BYTES
from fsdpfast.execute.engines import select_engine
from fsdpfast.io import filesystems, pread_sources
from fsdpfast.io.pread_sources import PreadSources
from fsdpfast.io.read_modes import chosen_read_mode
from fsdpfast.manifest import MANIFEST_NAME, SourceChanged
from fsdpfast.pipeline.job import REMOTE_WRITE_BYTES, large_writes_on_remote_output
from fsdpfast.plan.model import SourceBuffer

REPO = Path(__file__).resolve().parents[2]
PREAD_NOTE = "sources read with large parallel reads"


def merged_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != MANIFEST_NAME}


def manifest(out: Path) -> dict:
    return comparable_manifest(json.loads((out / MANIFEST_NAME).read_text()))


# --- the same bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("w2-tied-bf16", "fp32"),
        ("w3-bert-dim1", "bf16"),  # strided extents (Shard(1))
        ("w3-wrapped-buffer", "keep"),
        ("w2-dcp", "fp16"),
        ("w4-hsdp-tied", "bf16"),  # copies held twice
    ],
)
@pytest.mark.parametrize("ahead", [0, 5000])
def test_pread_writes_the_bytes_mmap_writes(checkpoints, tmp_path, monkeypatch, name, dtype, ahead):
    """Batches of 1 KB: every tensor cut into slices, reads announced one batch ahead or several
    (`ahead` bytes), the neighbouring batches' ranges sharing pages of one buffer, which a release must keep."""
    _, folder = checkpoints.get(name)
    fsdpfast.merge(folder, tmp_path / "mmap", dtype=dtype, max_shard_size="40KB", read_mode="mmap")
    monkeypatch.setattr(runner, "BATCH_BYTES", 1000)
    monkeypatch.setattr(PreadSources, "ahead_bytes", ahead)
    report = fsdpfast.merge(folder, tmp_path / "pread", dtype=dtype, max_shard_size="40KB", read_mode="pread")
    assert any(PREAD_NOTE in note and "--read-mode pread" in note for note in report.notes), report.notes
    assert merged_files(tmp_path / "pread") == merged_files(tmp_path / "mmap")
    assert manifest(tmp_path / "pread") == manifest(tmp_path / "mmap")  # every CRC-32C, combined from the slices


def test_the_local_default_is_mapped_and_unsaid(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    report = fsdpfast.merge(folder, tmp_path / "out")
    assert not any(PREAD_NOTE in note for note in report.notes), report.notes
    assert chosen_read_mode("auto", [SourceBuffer(os.path.join(folder, "x"), 0, 1, "float32")]) == ("mmap", None)


def test_buffers_read_in_ranges_that_share_pages(tmp_path):
    """Two batches' ranges of one buffer meet inside a page: releasing the first keeps that page for
    the second; a buffer viewed unannounced is read whole; one read past the file's end is refused."""
    data = os.urandom(3 * 4096 + 100)
    path = tmp_path / "rank0.bin"
    path.write_bytes(data)
    buffers = [SourceBuffer(str(path), 10, len(data) - 10, "uint8"), SourceBuffer(str(path), 0, 50, "uint8")]
    with PreadSources(buffers, threads=4, read_bytes=1000) as sources:
        first, second = (0, 5000), (5000, len(data) - 10)
        sources.read_ahead({0: [first]})
        sources.read_ahead({0: [second]})
        view = sources.view(0)
        assert bytes(view[slice(*first)]) == data[10 + first[0] : 10 + first[1]]
        view.release()
        sources.release(0)
        view = sources.view(0)
        assert bytes(view[slice(*second)]) == data[10 + second[0] : 10 + second[1]]
        view.release()
        sources.release(0)
        view = sources.view(1)  # never announced
        assert bytes(view) == data[:50]
        view.release()
    with open(path, "r+b") as f:
        f.truncate(4096)
    with PreadSources(buffers) as sources:
        with pytest.raises(SourceChanged, match=path.name):
            sources.view(0)


def test_a_source_shrinking_while_it_is_read_aborts_the_merge(checkpoints, tmp_path, monkeypatch):
    """A trainer still writing truncates a rank file between two batches: the short read refuses the
    merge naming the file, and nothing is published."""
    src = Path(shutil.copytree(checkpoints.get("w2-llama")[1], tmp_path / "ckpt"))
    victim = src / "model_world_size_2_rank_1.pt"
    monkeypatch.setattr(runner, "BATCH_BYTES", 4096)
    real, announced = PreadSources.read_ahead, []

    def shrink_after_the_first_batch(self, ranges):
        announced.append(ranges)
        if len(announced) == 2:
            os.truncate(victim, victim.stat().st_size // 4)
        return real(self, ranges)

    monkeypatch.setattr(PreadSources, "read_ahead", shrink_after_the_first_batch)
    out = tmp_path / "out"
    with pytest.raises(SourceChanged, match=victim.name):
        fsdpfast.merge(src, out, read_mode="pread")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


# --- the mode asked for, and chosen -----------------------------------------------------------------


def test_a_read_mode_that_is_not_one_is_refused(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    cli_refuses(folder, tmp_path / "out", "--read-mode", "mmapp", mentions=["--read-mode 'mmapp'", "auto, mmap, pread"])
    with pytest.raises(BadInput, match="read_mode='fast' is not one of auto, mmap, pread"):
        fsdpfast.merge(folder, tmp_path / "out", read_mode="fast")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="statfs's f_type is Linux's")
def test_local_and_kernel_filesystems_are_not_taken_for_remote_ones(tmp_path):
    for path in (tmp_path, "/proc", "/sys", "/dev"):
        assert filesystems.filesystem_type(str(path)) is not None, path
        assert filesystems.remote_filesystem(str(path)) is None, path
    assert filesystems.filesystem_type(str(tmp_path / "missing")) is None
    remote = ("nfs", "nfs4", "fuse", "cifs", "smb3", "lustre", "ceph", "9p", "gpfs", "beegfs")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mount, kind = line.split()[1:3]
        mount = mount.replace("\\040", " ")
        if (kind in remote or kind.startswith("fuse.")) and filesystems.filesystem_type(mount) is not None:
            assert filesystems.remote_filesystem(mount) is not None, (kind, mount)  # such a mount here: remote


def test_every_remote_kind_the_issue_names_is_known():
    names = set(filesystems.REMOTE.values())
    assert {"NFS", "Lustre", "GPFS", "BeeGFS", "CIFS", "SMB", "SMB2", "FUSE", "CephFS", "9p"} <= names


# --- a FUSE mount that answers each read after 2 ms (benchmarks/slowfs.c) ----------------------------


def slowfs_unusable(build_dir: Path) -> str | None:
    """Why a slowfs mount cannot be made here (None: it can); builds the binary into build_dir."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (apt-get install fuse3)"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or shutil.which("pkg-config") is None:
        return "no C compiler or pkg-config"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        return "the fuse3 headers are missing (apt-get install libfuse3-dev)"
    built = subprocess.run(
        [
            compiler,
            "-O2",
            "-o",
            str(build_dir / "slowfs"),
            str(REPO / "benchmarks" / "slowfs.c"),
            *flags.stdout.split(),
        ],
        capture_output=True,
        text=True,
    )
    return None if built.returncode == 0 else f"slowfs did not build: {built.stderr.strip()[:200]}"


@pytest.fixture
def slow_mount(tmp_path):
    """(folder to fill, its slowfs mount): files put in the first are read through the second."""
    reason = slowfs_unusable(tmp_path)
    if reason:
        pytest.skip(reason)
    backing, mount = tmp_path / "backing", tmp_path / "mount"
    backing.mkdir()
    mount.mkdir()
    server = subprocess.Popen(
        [str(tmp_path / "slowfs"), str(backing), str(mount), "--latency-us", "2000", "-f"],
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(100):
        if os.path.ismount(mount) or server.poll() is not None:
            break
        time.sleep(0.05)
    if not os.path.ismount(mount):
        server.kill()
        pytest.skip(f"slowfs could not mount here: {(server.communicate()[1] or '').strip()[:200]}")
    try:
        yield backing, mount
    finally:
        subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.mark.slow
def test_a_checkpoint_on_a_fuse_mount_is_read_with_preads(checkpoints, tmp_path, slow_mount):
    backing, mount = slow_mount
    _, folder = checkpoints.get("w3-llama")
    shutil.copytree(folder, backing / "ckpt")
    assert filesystems.remote_filesystem(str(mount / "ckpt")) == "FUSE"
    fsdpfast.merge(folder, tmp_path / "local", dtype="bf16")
    done = run_cli("merge", mount / "ckpt", "--out", tmp_path / "remote", "--dtype", "bf16", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "sources read with large parallel reads (the checkpoint is on FUSE)" in done.stdout, done.stdout
    assert merged_files(tmp_path / "remote") == merged_files(tmp_path / "local")
    mapped = fsdpfast.merge(mount / "ckpt", tmp_path / "mapped", dtype="bf16", read_mode="mmap")
    assert not any(PREAD_NOTE in note for note in mapped.notes)
    assert merged_files(tmp_path / "mapped") == merged_files(tmp_path / "local")


@pytest.mark.skipif(not _ops.native_cpu(), reason="native extension not built")
def test_the_native_engine_writes_larger_chunks_onto_a_fuse_mount(tmp_path, slow_mount):
    _, mount = slow_mount
    engine = large_writes_on_remote_output(select_engine("cpu"), str(mount / "not" / "made" / "yet"))
    assert engine.chunk_bytes == REMOTE_WRITE_BYTES
    assert large_writes_on_remote_output(select_engine("cpu"), str(tmp_path / "out")).chunk_bytes == CHUNK_BYTES


def test_reads_stay_within_the_pool_and_the_descriptor_limit(tmp_path):
    """More files than descriptors kept: each read opens what it needs, at most OPEN_FILES stay open."""
    paths = []
    for i in range(pread_sources.OPEN_FILES + 10):
        path = tmp_path / f"rank{i}.bin"
        path.write_bytes(bytes([i % 256]) * 100)
        paths.append(path)
    buffers = [SourceBuffer(str(p), 0, 100, "uint8") for p in paths]
    with PreadSources(buffers, threads=4) as sources:
        sources.read_ahead({i: [(0, 100)] for i in range(len(buffers))})
        for i in range(len(buffers)):
            view = sources.view(i)
            assert bytes(view) == bytes([i % 256]) * 100
            view.release()
        assert len(sources._files._open) <= pread_sources.OPEN_FILES


def test_reads_are_announced_in_order_and_no_deeper_than_asked(checkpoints, tmp_path, monkeypatch):
    """The runner announces batches past the one being written while they fit in ahead_bytes (at
    least one), releases each batch's buffers once it is written, and the input announced but not
    yet released stays under ahead_bytes plus a batch's."""
    _, folder = checkpoints.get("w3-llama")
    monkeypatch.setattr(runner, "BATCH_BYTES", 4096)
    ahead = 20000
    held: list[int] = []

    class Recording(PreadSources):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.open_bytes: dict[int, list[int]] = {}  # buffer -> bytes of each announced batch, oldest first
            self.announces = 0

        def read_ahead(self, ranges):
            self.announces += 1
            for index, wanted in ranges.items():
                self.open_bytes.setdefault(index, []).append(sum(e - s for s, e in wanted))
            held.append(sum(b for per in self.open_bytes.values() for b in per))
            super().read_ahead(ranges)

        def release(self, index):
            self.open_bytes[index].pop(0)
            super().release(index)

    monkeypatch.setattr(PreadSources, "ahead_bytes", ahead)
    monkeypatch.setattr(pread_sources, "PreadSources", Recording)
    fsdpfast.merge(folder, tmp_path / "pread", dtype="bf16", read_mode="pread")
    fsdpfast.merge(folder, tmp_path / "mmap", dtype="bf16", read_mode="mmap")
    assert merged_files(tmp_path / "pread") == merged_files(tmp_path / "mmap")
    largest_batch = 4096 * 2  # fp32 read for each bf16 byte written: twice the output
    assert len(held) > 10 and max(held) <= ahead + 2 * largest_batch, max(held)
    assert max(held) > 2 * largest_batch  # deeper than one batch ahead
