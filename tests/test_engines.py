"""Every engine writes the same bytes; the engine that ran is reported; missing ones fail cleanly."""
from __future__ import annotations

import subprocess
import sys

import pytest

import fsdpfast
from fsdpfast import _ops
from fsdpfast.engine import available_engines

OTHER_ENGINES = [e for e in available_engines() if e != "torch"]


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
            assert got[file_name] == expected[file_name], f"{engine} engine: {file_name} differs"


def test_auto_picks_the_fastest_available_engine(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    report = fsdpfast.merge(folder, tmp_path / "out")
    assert report.engine == available_engines()[0]
    assert report.engine == ("cuda" if _ops.native_cuda() else "cpu" if _ops.native_cpu() else "torch")


@pytest.mark.skipif(_ops.native_cuda(), reason="a GPU is visible")
def test_cuda_engine_without_gpu_is_one_clear_error(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    result = subprocess.run([sys.executable, "-m", "fsdpfast", "merge", folder, "--out", str(tmp_path / "out"), "--engine", "cuda"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--engine cuda" in result.stderr
    assert not (tmp_path / "out").exists()
