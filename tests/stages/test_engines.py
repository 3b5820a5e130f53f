"""Every engine writes the same bytes; the engine that ran is reported; missing ones fail cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from merge_processes import comparable_manifest

import fsdpfast
from fsdpfast import _ops
from fsdpfast.execute.engines import available_engines, select_engine
from fsdpfast.manifest import MANIFEST_NAME

pytestmark = [pytest.mark.torch_ops]

OTHER_ENGINES = [e for e in available_engines() if e != "torch"]


@pytest.mark.slow
@pytest.mark.skipif(not OTHER_ENGINES, reason="only the torch engine is available")
@pytest.mark.parametrize("name", ["w2-tied-bf16", "w3-bert-dim1", "w3-wrapped-buffer", "w4-hsdp-bert-dim1", "w8-tied"])
@pytest.mark.parametrize("dtype", ["keep", "bf16", "fp16", "fp32"])
def test_engines_write_identical_files(checkpoints, tmp_path, name, dtype):
    _, folder = checkpoints.get(name)
    fsdpfast.merge(folder, tmp_path / "torch", dtype=dtype, engine="torch", max_shard_size="40KB")
    expected = {p.name: p.read_bytes() for p in (tmp_path / "torch").iterdir()}
    for engine in OTHER_ENGINES:
        report = fsdpfast.merge(folder, tmp_path / engine, dtype=dtype, engine=engine, max_shard_size="40KB")
        assert report.engine == engine
        got = {p.name: p.read_bytes() for p in (tmp_path / engine).iterdir()}
        assert got.keys() == expected.keys()
        for file_name in expected:
            if file_name == MANIFEST_NAME:  # names the engine; every checksum must agree
                got_manifest, want_manifest = (
                    comparable_manifest(json.loads(got[file_name])),
                    comparable_manifest(json.loads(expected[file_name])),
                )
                assert got_manifest.pop("engine") == engine and want_manifest.pop("engine") == "torch"
                assert got_manifest == want_manifest and want_manifest["checksum"] == "crc32c"
                continue
            assert got[file_name] == expected[file_name], f"{engine} engine: {file_name} differs"


def test_auto_without_a_measurement_picks_cpu_else_torch(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    report = fsdpfast.merge(folder, tmp_path / "out")
    assert report.engine == available_engines()[0]
    assert report.engine == ("cpu" if _ops.native_cpu() else "torch")


@pytest.mark.skipif(not _ops.native_cpu(), reason="native extension not built")
def test_auto_takes_cpu_even_where_the_cuda_engine_could_run(monkeypatch):
    # As on a GPU machine with the CUDA ops loaded and nothing measured: a visible GPU is no reason
    # to send an offline merge's bytes through it.
    monkeypatch.setattr(_ops, "native_cuda", lambda: True)
    assert "cuda" in available_engines()
    for kind in (None, "copy", "float32->bfloat16"):
        assert select_engine("auto", kind).name == "cpu"


def _record(path, seconds, gpu=None):
    from fsdpfast.execute import measurements

    measurements.record(seconds, gpu, str(path))
    return json.loads(path.read_text())


@pytest.mark.skipif(not _ops.native_cpu(), reason="native extension not built")
def test_auto_follows_the_engine_measured_fastest_on_this_machine(checkpoints, tmp_path, monkeypatch):
    record = tmp_path / "measured.json"
    monkeypatch.setenv("FSDPFAST_MEASUREMENTS", str(record))
    written = _record(
        record,
        {
            "copy": {"cpu": 2.0, "torch": 1.0},  # torch measured faster at keep
            "float32->bfloat16": {"cpu": 1.0, "torch": 0.97},
        },
    )  # within the margin: cpu stays
    assert written["fastest"] == {"copy": "torch", "float32->bfloat16": "cpu"}
    assert select_engine("auto", "copy").name == "torch"
    assert select_engine("auto", "float32->bfloat16").name == "cpu"
    assert select_engine("auto", "bfloat16->float32").name == "cpu"  # not measured
    assert select_engine("cpu", "copy").name == "cpu"  # a named engine is never second-guessed
    _, folder = checkpoints.get("w2-llama")  # fp32: a merge at keep is a copy job
    assert fsdpfast.merge(folder, tmp_path / "keep").engine == "torch"
    assert fsdpfast.merge(folder, tmp_path / "bf16", dtype="bf16").engine == "cpu"
    # Another machine's record (another CPU count), or an unreadable one, is not followed.
    written["machine"]["cpus"] += 1
    record.write_text(json.dumps(written))
    assert select_engine("auto", "copy").name == "cpu"
    record.write_text("{not json")
    assert select_engine("auto", "copy").name == "cpu"


@pytest.mark.skipif(_ops.native_cuda() or not _ops.native_cpu(), reason="a GPU is visible, or no native extension")
def test_auto_says_once_when_the_measured_cuda_engine_cannot_run(tmp_path, monkeypatch, capsys):
    from fsdpfast.execute import engines

    record = tmp_path / "measured.json"
    monkeypatch.setenv("FSDPFAST_MEASUREMENTS", str(record))
    monkeypatch.setattr(engines, "_said_missing", False)
    _record(record, {"float32->bfloat16": {"cpu": 2.0, "cuda": 1.0}}, gpu="NVIDIA H200")
    assert select_engine("auto", "float32->bfloat16").name == "cpu"
    assert select_engine("auto", "float32->bfloat16").name == "cpu"
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and "the cuda engine, measured fastest here for float32->bfloat16, cannot run" in notes[0]


def test_cuda_staging_is_sized_to_the_job():
    from fsdpfast.execute.cuda import MIN_SLOT_BYTES, STAGING_BYTES, slot_bytes, staging_needed
    from fsdpfast.plan.model import Extent, TensorPlan

    small = TensorPlan("t", (1000,), "bfloat16", "float32", [Extent(0, 0, 1000, 0)])
    copied = TensorPlan("c", (1 << 30,), "float32", "float32", [Extent(0, 0, 1 << 30, 0)])
    assert staging_needed([small, copied]) == 4000  # bf16 -> fp32 fills 4 bytes of a slot per element
    assert slot_bytes(4000, 3, STAGING_BYTES) == MIN_SLOT_BYTES  # a tiny job pins little
    assert slot_bytes(0, 3, STAGING_BYTES) < MIN_SLOT_BYTES  # plain copies never reach the buffers
    assert slot_bytes(10 << 30, 3, STAGING_BYTES) == STAGING_BYTES  # a large one is capped
    assert slot_bytes(3 * (5 << 20), 3, STAGING_BYTES) == 8 << 20  # between: a power of two holding its share
    assert slot_bytes(10 << 30, 2, 4096) == 4096  # a cap below the minimum is kept (the tests' tiny slots)


@pytest.mark.slow
@pytest.mark.skipif(_ops.native_cuda(), reason="a GPU is visible")
def test_cuda_engine_without_gpu_is_one_clear_error(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", folder, "--out", str(tmp_path / "out"), "--engine", "cuda"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--engine 'cuda'" in result.stderr
    assert not (tmp_path / "out").exists()


def _write_with(engine, folder: str, dtype: str, out_dir) -> dict[str, bytes]:
    """Run layout + writer with a given engine object (to reach settings the API keeps fixed)."""
    from fsdpfast.execute.writer import write_file
    from fsdpfast.io.sources import SourceFiles
    from fsdpfast.plan.layout import plan_files

    plan = fsdpfast.plan_merge(folder, dtype=dtype)
    out_dir.mkdir()
    with SourceFiles(plan.sources) as sources:
        for planned in plan_files(plan, "40KB"):
            write_file(str(out_dir / planned.name), planned, engine, sources)
    return {p.name: p.read_bytes() for p in out_dir.iterdir()}


@pytest.mark.slow
@pytest.mark.skipif(not _ops.native_cpu(), reason="native extension not built")
@pytest.mark.parametrize("chunk_bytes", [64, 200, 4096])
@pytest.mark.parametrize("name", ["w3-bert-dim1", "w4-hsdp-bert-dim1", "w8-tied"])
def test_native_engine_chunks_cut_anywhere_in_strided_pieces(checkpoints, tmp_path, name, chunk_bytes):
    from fsdpfast.execute.cpu import NativeCpuEngine
    from fsdpfast.execute.torch_engine import TorchEngine

    _, folder = checkpoints.get(name)
    for dtype in ("bf16", "keep"):
        expected = _write_with(TorchEngine(), folder, dtype, tmp_path / f"torch-{dtype}")
        got = _write_with(NativeCpuEngine(chunk_bytes=chunk_bytes), folder, dtype, tmp_path / f"cpu-{dtype}")
        assert got == expected


@pytest.mark.skipif(not _ops.native_cpu(), reason="native extension not built")
def test_native_file_writer_refuses_bad_plans_before_writing(tmp_path):
    from array import array

    source = memoryview(bytearray(64))
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        write = _ops.native().gather_convert_to_file
        # a destination of 16 floats that the only row fills 15 of
        with pytest.raises(ValueError, match="gap"):
            write(
                [source], array("q", [0, 0, 0, 0, 4, 4, 0, 15, 0, 1, 0, 0]), array("q", [0]), array("q", [64]), fd, 64
            )
        # a row reading past its source
        with pytest.raises(ValueError, match="reads past"):
            write(
                [source], array("q", [0, 0, 0, 0, 4, 4, 2, 16, 0, 1, 0, 0]), array("q", [0]), array("q", [64]), fd, 64
            )
        # a conversion between codes the kernels do not know
        with pytest.raises(ValueError, match="unsupported conversion"):
            write(
                [source], array("q", [0, 0, 0, 7, 4, 4, 0, 16, 0, 1, 0, 0]), array("q", [0]), array("q", [64]), fd, 64
            )
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


@pytest.mark.slow
def test_merge_without_the_extension_uses_torch_and_says_so_once(checkpoints, tmp_path):
    # As on a machine where the extension was not built: importing its modules fails.
    _, folder = checkpoints.get("w2-tied-bf16")
    hide_extension = (
        "import sys; sys.modules['fsdpfast._C'] = sys.modules['fsdpfast._native'] = None; "
        "from fsdpfast.cli import main; sys.exit(main())"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_extension, "merge", folder, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "with the torch engine" in result.stdout
    notes = [line for line in result.stderr.splitlines() if line.startswith("fsdpfast: note:")]
    assert len(notes) == 1 and "pure-torch engine" in notes[0]
    fsdpfast.merge(folder, tmp_path / "reference", engine="torch")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "reference" / "model.safetensors"
    ).read_bytes()


@pytest.mark.skipif(not _ops.native_cpu(), reason="native extension not built")
@pytest.mark.parametrize("target", ["bfloat16", "float32"])
def test_native_engine_reads_long_runs_in_released_slices_bit_exactly(tmp_path, target):
    """A 3 MB run at an odd offset of a file, in 4 MB chunks: converted slice by slice, each slice's
    pages dropped after use (the kernel's release_sources), every byte as torch's .to() writes it."""
    from fsdpfast.execute.cpu import NativeCpuEngine
    from fsdpfast.io.local_file import LocalFile
    from fsdpfast.io.sources import SourceFiles
    from fsdpfast.plan.layout import PlacedTensor
    from fsdpfast.plan.model import Extent, SourceBuffer, TensorPlan

    values = torch.randn(3 << 18, generator=torch.Generator().manual_seed(0))
    values[::997] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).repeat(1000)[: values[::997].numel()]
    source = tmp_path / "source.bin"
    source.write_bytes(b"\x01" * 4100 + values.numpy().tobytes() + b"\x02" * 10)
    tensor = TensorPlan("x", tuple(values.shape), "float32", target, [Extent(0, 0, values.numel(), 0)])
    expected = values.to(getattr(torch, target)).view(torch.uint8).numpy().tobytes()
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, len(expected))
        with SourceFiles([SourceBuffer(str(source), 4100, values.numel() * 4, "float32")]) as sources:
            NativeCpuEngine(chunk_bytes=4 << 20).output(LocalFile(fd), len(expected)).write(
                [PlacedTensor(tensor, 0, len(expected))], sources
            )
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == expected


class _MemoryFile:
    """A TargetFile (io.target) with no local descriptor, as a remote target's: bytes kept in memory."""

    def __init__(self, size: int):
        self.data = bytearray(size)

    def write_at(self, data, offset: int) -> None:
        self.data[offset : offset + len(data)] = data

    def window(self, start: int, end: int):
        data = self.data

        class _Window:
            def at(self, offset: int, nbytes: int) -> memoryview:
                return memoryview(data)[offset : offset + nbytes]

            def close(self) -> None:
                pass

        return _Window()

    def local_descriptor(self):
        return None

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.mark.parametrize("engine", available_engines())
def test_every_engine_writes_a_file_without_a_descriptor_through_the_target_calls(checkpoints, tmp_path, engine):
    """What a remote target's file gets (write_at and window only) is what a local file gets."""
    from fsdpfast.execute.parts import whole
    from fsdpfast.execute.writer import write_into
    from fsdpfast.io.sources import SourceFiles
    from fsdpfast.plan.layout import plan_files

    _, folder = checkpoints.get("w3-bert-dim1")
    plan = fsdpfast.plan_merge(folder, dtype="bf16")
    expected = _write_with(select_engine(engine), folder, "bf16", tmp_path / "local")
    with SourceFiles(plan.sources) as sources:
        for planned in plan_files(plan, "40KB"):
            file = _MemoryFile(planned.size)
            write_into(file, planned.name, whole(planned), select_engine(engine), sources)
            assert bytes(file.data) == expected[planned.name]
