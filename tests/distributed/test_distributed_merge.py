"""Several processes, one merge: `python -m fsdpfast merge` in W processes given their ranks as
torchrun gives them (each alone, as if on its own node; one shared output folder), real torchrun,
and `fsdpfast.merge(..., group=pg)`. Each is compared with the single-process merge of the same
checkpoint: the same files byte for byte, the same manifest. A rank killed mid-write, or one that
cannot see the checkpoint or the output folder, stops all of them with nothing published.

The checkpoints have a vocabulary large enough (16000 x 64 floats: a 4 MB embedding) that with
1 MB files a share ends inside a tensor: a file is written by two processes, and the CRC-32C of
the tensor they share is combined from theirs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from helpers import CheckpointsByWorld, assert_bit_exact, load_reference, read_merged
from merge_processes import Ranks, left_beside, same_output
from refusals import edit_state_dict, tree_digest

import fsdpfast
from fsdpfast import _ops
from fsdpfast._testing.fsdp2_writer import CheckpointSpec, _free_port, write_checkpoints
from fsdpfast.errors import EXIT_BAD_INPUT
from fsdpfast.execute.engines import select_engine
from fsdpfast.execute.parts import clip_extent, share_out, share_whole_files, tensor_checksums
from fsdpfast.execute.writer import execute
from fsdpfast.io.local_target import LocalTarget
from fsdpfast.io.sources import open_sources
from fsdpfast.plan.layout import plan_files
from fsdpfast.plan.model import Extent, MergePlan, SourceBuffer, TensorPlan

pytestmark = [
    pytest.mark.skipif(not _ops.native_cpu(), reason="split tensors' checksums are combined by the native module"),
    pytest.mark.distributed,
]

SHARD = "1MB"
SPECS = {
    "wide": (2, CheckpointSpec("wide", model="llama-tied", sizes={"vocab_size": 16000}, seed=31)),
    "wide-dcp": (2, CheckpointSpec("wide-dcp", layout="dcp", sizes={"vocab_size": 16000}, seed=32)),
    "wide-dim1": (2, CheckpointSpec("wide-dim1", shard_dim=1, sizes={"vocab_size": 3000}, seed=33)),  # strided pieces
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> CheckpointsByWorld:
    return CheckpointsByWorld(
        str(tmp_path_factory.mktemp("wide")), SPECS, write_checkpoints, lambda spec, root: spec.folder(root)
    )


# A rank that dies by SIGKILL once it has written the first piece of its share: a node lost mid-write.
DIES_MID_WRITE = r"""
import os, signal, sys
import fsdpfast.execute.writer as writer
def first_piece_then_die(pieces, sources, sink, progress=None, held=False):
    sink.write(pieces[:1], sources)
    os.kill(os.getpid(), signal.SIGKILL)
writer.run = first_piece_then_die
from fsdpfast.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("fsdpfast:")]


def _splits_a_tensor(folder: str, processes: int, dtype: str = "keep") -> bool:
    files = plan_files(fsdpfast.plan_merge(folder, dtype=dtype), SHARD)
    owners: dict[str, set[int]] = {}
    for rank, share in enumerate(share_out(files, processes)):
        for part in share:
            for p in part.file.tensors:
                if part.start < p.offset + p.nbytes and p.offset < part.end:
                    owners.setdefault(p.tensor.name, set()).add(rank)
    return any(len(ranks) > 1 for ranks in owners.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,processes,options",
    [
        ("wide", 2, []),
        ("wide", 3, ["--dtype", "bf16"]),
        ("wide", 2, ["--dtype", "bf16", "--read-mode", "pread"]),  # each process reads its share with preads
        ("wide-dcp", 4, []),
    ],
)
def test_processes_write_the_single_process_merge(wide, tmp_path, name, processes, options):
    spec, folder = wide.get(name)
    single, out = tmp_path / "single", tmp_path / "shared" / "out"
    dtype = options[1] if options else "keep"
    fsdpfast.merge(folder, single, max_shard_size=SHARD, dtype=dtype)
    assert _splits_a_tensor(folder, processes, dtype)  # the case this test is for
    results = Ranks(
        lambda rank: [folder, "--out", out, "--max-shard-size", SHARD, "--timeout", 120, *options], processes
    ).wait()
    assert [status for status, *_ in results] == [0] * processes, results
    assert results[0][1].startswith("merged ") and f"in {processes} processes" in results[0][1]
    assert all(not stdout for _, stdout, _, _ in results[1:])  # rank 0 alone reports
    same_output(single, out)
    reference, tied = load_reference(spec.reference_path(wide.root))
    assert_bit_exact(read_merged(str(out)), reference, torch.bfloat16 if options else None, tied)
    assert left_beside(out) == []


@pytest.mark.slow
def test_torchrun_runs_the_merge(wide, tmp_path):
    _, folder = wide.get("wide")
    single, out = tmp_path / "single", tmp_path / "out"
    fsdpfast.merge(folder, single, max_shard_size=SHARD)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fsdpfast",
            "merge",
            folder,
            "--out",
            str(out),
            "--max-shard-size",
            SHARD,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["processes"] == 2  # one report, rank 0's
    same_output(single, out)


def _api_rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """A spawned process: the merge runs in the group of ranks 1 and 2; rank 0 of the world only waits."""
    import datetime

    import torch.distributed as dist

    from fsdpfast._testing.fsdp2_writer import exit_rank

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    pair = dist.new_group([1, 2], backend="gloo")
    if rank in (1, 2):
        report = fsdpfast.merge(folder, out, max_shard_size=SHARD, group=pair)
        assert report.processes == 2 and report.files
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


@pytest.mark.slow
def test_merge_with_a_process_group(wide, tmp_path):
    import torch.multiprocessing as mp

    _, folder = wide.get("wide-dcp")
    single, out = tmp_path / "single", tmp_path / "out"
    fsdpfast.merge(folder, single, max_shard_size=SHARD)
    mp.spawn(_api_rank, args=(3, _free_port(), folder, str(out)), nprocs=3, join=True)
    same_output(single, out)


@pytest.mark.slow
def test_a_rank_killed_mid_write_stops_all_and_publishes_nothing(wide, tmp_path):
    _, folder = wide.get("wide")
    out = tmp_path / "out"
    timeout = 30
    results = Ranks(
        lambda rank: [folder, "--out", out, "--max-shard-size", SHARD, "--timeout", timeout],
        3,
        scripts={1: DIES_MID_WRITE},
    ).wait()
    assert results[1][0] == -signal.SIGKILL
    for rank in (0, 2):
        status, _, stderr, ended = results[rank]
        assert status != 0
        assert ended - results[1][3] < timeout  # told at once, not after the timeout
        (line,) = _error_lines(stderr)
        assert "nothing was published" in line
    assert not out.exists() and left_beside(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("blind", ["checkpoint", "output"])
def test_a_rank_that_cannot_see_the_folder_stops_all(wide, tmp_path, blind):
    _, folder = wide.get("wide")
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"  # what rank 1 is given: not the folder the others share

    def argv(rank):
        src = elsewhere / "ckpt" if rank == 1 and blind == "checkpoint" else folder
        dst = elsewhere / "out" if rank == 1 and blind == "output" else out
        return [src, "--out", dst, "--max-shard-size", SHARD, "--timeout", 60]

    results = Ranks(argv, 2).wait()
    assert [status for status, *_ in results] == [EXIT_BAD_INPUT] * 2
    (own,) = _error_lines(results[1][2])
    (told,) = _error_lines(results[0][2])
    what = "no such folder on this rank" if blind == "checkpoint" else "staging folder rank 0 made"
    assert own.startswith("fsdpfast: error: rank 1: ") and what in own
    assert told.startswith("fsdpfast: error: rank 1 failed: ") and what in told and "nothing was published" in told
    assert not out.exists() and left_beside(out) == []
    assert not elsewhere.exists()  # nothing made where rank 1 looked


# --- every rank reads what rank 0 planned from, with rank 0's options ---------------------------


def _copy_with_mtimes(folder: str, where: Path) -> Path:
    """A copy of the checkpoint elsewhere (another node's disk): the same bytes, sizes and mtimes."""
    return Path(shutil.copytree(folder, where, copy_function=shutil.copy2))


def _altered_rank_file(copy: Path) -> str:
    """Rank 1's file saved again by torch with one tensor changed (its CRC-32s change with it)."""
    (path,) = copy.glob("model_world_size_*_rank_1.pt")

    def add_one(state: dict) -> None:
        value = state["model.norm.weight"]
        getattr(value, "_local_tensor", value).add_(1)  # a DTensor's local piece, or a plain tensor

    edit_state_dict(path, add_one)
    return path.name


def _altered_distcp(copy: Path) -> str:
    """The largest tensor chunk of a .distcp file saved again by torch, each element plus 1, in its
    place: DCP writes each chunk as a torch.save archive, so its CRC-32s change as a new save's would."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(copy)).read_metadata().storage_data
    chunk = max(storage.values(), key=lambda info: info.length)
    with open(copy / chunk.relative_path, "r+b") as f:
        f.seek(chunk.offset)
        tensor = torch.load(io.BytesIO(f.read(chunk.length)), weights_only=True)
        saved = io.BytesIO()
        torch.save(tensor + 1, saved)
        assert len(saved.getvalue()) == chunk.length
        f.seek(chunk.offset)
        f.write(saved.getvalue())
    return chunk.relative_path


def _altered_metadata(copy: Path) -> str:
    """.metadata as another save of the same tensors writes it: another save_id, the same length."""
    from torch.distributed.checkpoint import FileSystemReader

    save_id = FileSystemReader(str(copy)).read_metadata().storage_meta.save_id
    path = copy / ".metadata"
    data = path.read_bytes()
    assert data.count(save_id.encode()) == 1
    path.write_bytes(data.replace(save_id.encode(), str(uuid.uuid4()).encode()))
    return ".metadata"


def _same_size_and_mtime(copy: Path, name: str, folder: str) -> None:
    original = os.stat(os.path.join(folder, name))
    assert os.path.getsize(copy / name) == original.st_size  # what the check by size and mtime would pass
    os.utime(copy / name, ns=(original.st_atime_ns, original.st_mtime_ns))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,alter",
    [("wide", _altered_rank_file), ("wide-dcp", _altered_distcp), ("wide-dcp", _altered_metadata)],
    ids=["rank-file", "distcp", "metadata"],
)
def test_a_rank_reading_another_copy_stops_all(wide, tmp_path, name, alter):
    """Rank 1 reads a copy of the checkpoint with the same file sizes and mtimes but other bytes in
    one file: every rank refuses, naming the file, and nothing is published."""
    _, folder = wide.get(name)
    copy = _copy_with_mtimes(folder, tmp_path / "node1" / "ckpt")
    altered = alter(copy)
    _same_size_and_mtime(copy, altered, folder)
    out = tmp_path / "shared" / "out"
    before = tree_digest(folder), tree_digest(copy)
    results = Ranks(
        lambda rank: [copy if rank == 1 else folder, "--out", out, "--max-shard-size", SHARD, "--timeout", 60], 2
    ).wait()
    assert [status for status, *_ in results] == [EXIT_BAD_INPUT] * 2, results
    (own,) = _error_lines(results[1][2])
    (told,) = _error_lines(results[0][2])
    assert own.startswith(f"fsdpfast: error: rank 1: {copy / altered}: not the file rank 0 planned from ("), own
    assert told.startswith(f"fsdpfast: error: rank 1 failed: rank 1: {copy / altered}: ") and told.endswith(
        "; nothing was published"
    )
    assert not out.parent.exists()  # made for the merge (missing parents), removed with it
    assert (tree_digest(folder), tree_digest(copy)) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "option,rank0,rank1",
    [("--dtype", "bf16", "fp16"), ("--engine", "cpu", "torch"), ("--max-shard-size", SHARD, "2MB")],
)
def test_a_rank_started_with_other_options_stops_all(wide, tmp_path, option, rank0, rank1):
    _, folder = wide.get("wide")
    out = tmp_path / "out"
    before = tree_digest(folder)
    results = Ranks(
        lambda rank: (
            [folder, "--out", out, "--timeout", 60, "--max-shard-size", SHARD] + [option, rank1 if rank == 1 else rank0]
        ),
        2,
    ).wait()
    assert [status for status, *_ in results] == [EXIT_BAD_INPUT] * 2, results
    (own,) = _error_lines(results[1][2])
    (told,) = _error_lines(results[0][2])
    said = f"rank 1 was started with {option} {rank1!r}, rank 0 with {option} {rank0!r}; start every rank with the same options"
    assert own == f"fsdpfast: error: {said}"
    assert told == f"fsdpfast: error: rank 1 failed: {said}; nothing was published"
    assert not out.exists() and left_beside(out) == []
    assert tree_digest(folder) == before


@pytest.mark.slow
def test_a_copy_elsewhere_and_options_spelled_otherwise_merge(wide, tmp_path):
    """The look-alike of the two refusals above: rank 1 reads an identical copy at another path and is
    given --dtype bfloat16 for bf16 and 1000KB for 1MB; the output is the single-process merge's."""
    spec, folder = wide.get("wide")
    copy = _copy_with_mtimes(folder, tmp_path / "node1" / "ckpt")
    single, out = tmp_path / "single", tmp_path / "shared" / "out"
    fsdpfast.merge(folder, single, max_shard_size=SHARD, dtype="bf16")

    def argv(rank):
        if rank == 1:
            return [copy, "--out", out, "--max-shard-size", "1000KB", "--dtype", "bfloat16", "--timeout", 60]
        return [folder, "--out", out, "--max-shard-size", SHARD, "--dtype", "bf16", "--timeout", 60]

    results = Ranks(argv, 2).wait()
    assert [status for status, *_ in results] == [0, 0], results
    same_output(single, out)
    reference, tied = load_reference(spec.reference_path(wide.root))
    assert_bit_exact(read_merged(str(out)), reference, torch.bfloat16, tied)


# --- the parts, one process writing them all ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("read_mode", ["mmap", "pread"])
@pytest.mark.parametrize("engine", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["wide", "wide-dim1"])
def test_parts_cut_anywhere_make_the_whole_files(wide, tmp_path, name, engine, read_mode):
    """Shares cut at 64-byte boundaries (inside rows, inside strided Shard(1) runs), written one by one
    (the sources mapped, or read with preads), give the files and the checksums of whole files."""
    _, folder = wide.get(name)
    plan = fsdpfast.plan_merge(folder, dtype="bf16")
    files = plan_files(plan, "300KB")
    whole_dir = tmp_path / "whole"
    whole = LocalTarget(str(whole_dir), False)
    expected = tensor_checksums(files, execute(plan, files, whole, engine=select_engine(engine)))
    whole.publish()
    whole.discard()
    for count in (3, 7):
        shares = share_out(files, count, align=64)
        _check_cover(files, shares, 64)
        target = LocalTarget(str(tmp_path / f"parts-{count}"), False)
        with open_sources(plan.sources, read_mode) as sources:
            pieces = [
                piece
                for share in reversed(shares)
                for piece in execute(plan, share, target, engine=select_engine(engine), sources=sources)
            ]
        target.publish()
        target.discard()
        assert tensor_checksums(files, pieces) == expected
        for f in files:
            assert (tmp_path / f"parts-{count}" / f.name).read_bytes() == (whole_dir / f.name).read_bytes()


def _check_cover(files, shares, align) -> None:
    """Every byte of every file in exactly one share; cuts on `align` boundaries; shares within one
    `align` of each other."""
    for f in files:
        parts = sorted((part.start, part.end) for share in shares for part in share if part.file is f)
        assert parts[0][0] == 0 and parts[-1][1] == f.size
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(start % align == 0 for start, _ in parts)
    sizes = [sum(part.nbytes for part in share) for share in shares]
    assert max(sizes) - min(sizes) <= 2 * align


def test_shares_never_cut_a_computed_tensor():
    """--merge-lora weights are computed whole: a cut that would fall inside one moves past it."""
    sources = [SourceBuffer("unused", 0, 4 << 20, "float32")]
    tensors = [
        TensorPlan(
            f"t{i}", (1 << 18,), "float32", "float32", (Extent(0, 0, 1 << 18, 0),), compute=object() if i == 1 else None
        )
        for i in range(4)
    ]  # 1 MiB each
    (planned,) = plan_files(MergePlan("test", 1, sources, tensors), "1GB")
    computed = next(p for p in planned.tensors if p.tensor.compute is not None)
    for count in (2, 3, 5, 8):
        for share in share_out([planned], count, align=4096):
            for part in share:
                assert not (computed.offset < part.start < computed.offset + computed.nbytes)


@pytest.mark.parametrize("seed", range(20))
def test_whole_file_shares_balance_the_bytes(seed):
    """An object store's merge by several processes: each file whole to one process, every file once, each
    process's in plan order, and the largest share within 4/3 of the best split (found by trying them all)."""
    import itertools
    import random
    from types import SimpleNamespace

    rng = random.Random(seed)
    files = [SimpleNamespace(name=f"f{i}", size=rng.choice([1, 5, 40, 100]) * rng.randint(1, 9)) for i in range(6)]
    for count in (1, 2, 3, 4):
        shares = share_whole_files(files, count)
        owned = [part.file for share in shares for part in share]
        assert sorted(f.name for f in owned) == sorted(f.name for f in files)
        assert all(part.start == 0 and part.end == part.file.size for share in shares for part in share)
        for share in shares:
            assert [files.index(part.file) for part in share] == sorted(files.index(part.file) for part in share)
        best = min(
            max(sum(f.size for f, r in zip(files, owners) if r == rank) for rank in range(count))
            for owners in itertools.product(range(count), repeat=len(files))
        )
        assert max(sum(part.nbytes for part in share) for share in shares) <= best * 4 / 3


@pytest.mark.parametrize("seed", range(300))
def test_clipped_extents_hold_the_elements_in_the_window(seed):
    import random

    rng = random.Random(seed)
    count = rng.randint(1, 9)
    runs = rng.randint(1, 6)
    d_stride = rng.choice([0, count + rng.randint(0, 5)]) if runs > 1 else 0  # 0: runs end to end
    s_stride = rng.choice([0, count + rng.randint(0, 5)]) if runs > 1 else 0
    extent = Extent(0, rng.randint(0, 20), count, rng.randint(0, 20), runs, s_stride, d_stride)
    span = extent.dst_offset + (runs - 1) * (d_stride or count) + count
    lo = rng.randint(0, span + 2)
    hi = rng.randint(lo, span + 4)
    wanted = {(s, d - lo) for s, d in _pairs(extent) if lo <= d < hi}
    clipped = clip_extent(extent, lo, hi)
    got = [pair for e in clipped for pair in _pairs(e)]
    assert len(got) == len(set(got)) and set(got) == wanted
    assert len(clipped) <= 3


def _pairs(e: Extent):
    """(source element, tensor element) of every element an extent copies."""
    for run in range(e.runs):
        for i in range(e.count):
            yield (
                e.src_offset + run * (e.src_stride or e.count) + i,
                e.dst_offset + run * (e.dst_stride or e.count) + i,
            )


@pytest.mark.slow
def test_overwrite_under_torchrun_replaces_only_an_earlier_merge(wide, tmp_path):
    """Rank 0 checks the earlier folder before any rank writes: a file fsdpfast did not write stops them all."""
    _, folder = wide.get("wide")
    single, out = tmp_path / "single", tmp_path / "out"
    fsdpfast.merge(folder, single, max_shard_size=SHARD)
    fsdpfast.merge(folder, out, dtype="bf16")  # the earlier merge: one bf16 file
    (out / "eval_results.json").write_text('{"accuracy": 0.5}')

    def argv(rank):
        return [folder, "--out", out, "--max-shard-size", SHARD, "--timeout", 120, "--overwrite"]

    results = Ranks(argv, 2).wait()
    assert [status for status, *_ in results] == [EXIT_BAD_INPUT] * 2, results
    (own,) = _error_lines(results[0][2])
    (told,) = _error_lines(results[1][2])
    assert "1 entry fsdpfast did not write (eval_results.json)" in own
    assert told.startswith("fsdpfast: error: rank 0 failed: ") and "eval_results.json" in told
    assert (out / "eval_results.json").read_text() == '{"accuracy": 0.5}' and left_beside(out) == []
    (out / "eval_results.json").unlink()
    results = Ranks(argv, 2).wait()
    assert [status for status, *_ in results] == [0, 0], results
    same_output(single, out)
    assert left_beside(out) == []
