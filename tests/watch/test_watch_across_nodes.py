"""Watchers on two "nodes" (two processes on this machine, each its own torchrun agent) merge each
checkpoint together: `fsdpfast watch --once --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT` run twice
over a real run's folder (accelerate's save_state on two gloo ranks), as a cluster job step runs it
once per node. Each checkpoint is merged once, by both nodes' processes meeting in the rendezvous
named after it; the output is byte for byte the single-process merge's; the node whose process
held rank 0 reports its bytes and runs --then, the other says published without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from framework_checkpoints import HAVE_ACCELERATE
from merge_processes import same_output
from refusals import run_cli_here

import fsdpfast
from fsdpfast._testing.framework_runs import checkpoint_name, run_folder, write_framework_run
from fsdpfast._testing.fsdp2_writer import _free_port

STEPS = 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    if not HAVE_ACCELERATE:
        pytest.skip("accelerate is not installed")
    root = tmp_path_factory.mktemp("nodes")
    write_framework_run(str(root), "accelerate", STEPS)
    return run_folder(str(root), "accelerate")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_merge_each_checkpoint_together_as_one_process_would(finished_run, tmp_path):
    run_dir, out = finished_run, tmp_path / "out"
    endpoint = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "fsdpfast", "watch", run_dir, "--out", str(out), "--once", "--json"]
    command += ["--config", run_dir, "--max-shard-size", "1MB", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    then_log = tmp_path / "then.log"  # each node appends the folders its --then ran on
    command += [
        "--then",
        f"{sys.executable} -c \"import sys; open({str(then_log)!r}, 'a').write(sys.argv[1] + '\\n')\"",
    ]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    names = [checkpoint_name("accelerate", step) for step in range(1, STEPS + 1)]
    published = [[json.loads(line) for line in stdout.splitlines()] for stdout, _ in results]
    published = [[e for e in events if e["event"] == "published"] for events in published]
    for events in published:
        assert [e["checkpoint"] for e in events] == names, results
    for name in names:  # rank 0 reports on one node; the other knows only that it published
        sizes = [e["bytes"] for events in published for e in events if e["checkpoint"] == name]
        assert len(sizes) == 2 and sizes.count(None) == 1 and max(s or 0 for s in sizes) > 0, sizes
    assert sorted(then_log.read_text().splitlines()) == [str(out / name) for name in names]  # once each
    for name in names:
        single = tmp_path / "single" / name
        fsdpfast.merge(os.path.join(run_dir, name), single, config=run_dir, max_shard_size="1MB")
        assert len([p for p in os.listdir(single) if p.endswith(".safetensors")]) > 2  # a share per process
        same_output(single, out / name)


def test_nodes_without_a_rendezvous_are_refused(tmp_path):
    result = run_cli_here("watch", tmp_path, "--out", tmp_path / "out", "--once", "--nnodes", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "fsdpfast: error: --nnodes 2 needs --rdzv-endpoint HOST:PORT, where the nodes' merges meet"
    ]
