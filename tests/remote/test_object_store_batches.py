"""What a merge into a store holds in memory: each piece the engine fills has its own buffer until it is
streamed (remote.object_target), so the runner cuts a tensor larger than a batch for such a file, as it
does for reading Sources, whatever the sources are (local files here). With batches made tiny, no buffer
is larger than one, and the objects are still the local merge's byte for byte."""

from __future__ import annotations

import pytest
from s3_server import objects, pending_uploads
from test_object_store_merge import _assert_same_output, _local_files

import fsdpfast
from fsdpfast.execute import runner
from fsdpfast.plan.layout import plan_files
from fsdpfast.remote.object_target import _Window

pytestmark = pytest.mark.slow
BATCH = 4096


@pytest.mark.parametrize("engine", ["cpu", "torch"])
def test_a_tensor_larger_than_a_batch_is_filled_a_batch_at_a_time(
    checkpoints, tmp_path, s3_server, bucket, monkeypatch, engine
):
    _, folder = checkpoints.get("w2-llama")
    fsdpfast.merge(folder, tmp_path / "local", engine=engine)
    largest = max(p.nbytes for f in plan_files(fsdpfast.plan_merge(folder), 1 << 40) for p in f.tensors)
    assert largest > 4 * BATCH  # the case this test is for
    monkeypatch.setattr(runner, "BATCH_BYTES", BATCH)
    asked = []
    original = _Window.at

    def at(self, offset, nbytes):
        asked.append(nbytes)
        return original(self, offset, nbytes)

    monkeypatch.setattr(_Window, "at", at)
    fsdpfast.merge(folder, f"s3://{bucket}/out", engine=engine)
    assert asked and max(asked) <= BATCH
    client = s3_server.client()
    _assert_same_output(objects(client, bucket, "out"), _local_files(tmp_path / "local"))
    assert pending_uploads(client, bucket) == []
