"""--keep-last's choice of outputs: the order publishing uses, and only what the watcher itself named."""

from __future__ import annotations

import json

from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.watch.discover import publishing_order
from fsdpfast.watch.published import outputs_of_run


def test_a_checkpoint_without_a_step_is_the_newest_for_both():
    names = ["final", "step-20", "step-10", "release"]
    assert sorted(names, key=publishing_order) == ["step-10", "step-20", "final", "release"]


def test_only_outputs_named_after_their_checkpoint_are_the_watchers(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    for name, source in [("step-10", "step-10"), ("best", "step-10"), ("step-10-bf16", "step-10"), ("other", None)]:
        (out / name).mkdir(parents=True)
        checkpoint = str(run / source) if source else str(tmp_path / "elsewhere" / name)
        manifest = {"checksum": None, "tensors": {}, "checkpoint": checkpoint}  # the fields every manifest has
        (out / name / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert outputs_of_run(str(out), str(run)) == ["step-10"]
