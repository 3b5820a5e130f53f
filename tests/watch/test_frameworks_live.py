"""Each framework's own checkpoint manager saves several steps while `fsdpfast watch` runs in
another process (polling every 20 ms, inotify too): accelerate's `save_state`, a real
`Trainer.train()` under FSDP2 (save_steps=1), torchtitan's `CheckpointManager`, DeepSpeed's
`engine.save_checkpoint`, and verl's own `FSDPCheckpointManager.save_checkpoint` with its trainer's
tracker write where verl is importable (the frameworks are in fsdpfast._testing.framework_runs). Every step is published once, in step order,
bit for bit what `merge` writes from the finished checkpoint afterwards and the live model's
weights; nothing refused or failed. Beside the watcher, this process asks watch.discover which
checkpoints are complete as fast as it can while the job writes, and records the files the merge
reads of each one it calls complete: they must be the files the finished checkpoint holds (a
checkpoint called complete while a file was still to come or growing would differ)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from framework_checkpoints import HAVE_ACCELERATE, HAVE_TORCHTITAN
from helpers import assert_bit_exact, load_reference, read_merged

import fsdpfast
from fsdpfast import readers
from fsdpfast._testing.framework_runs import checkpoint_name, run_folder, write_framework_run
from fsdpfast.readers.framework_folders import locate
from fsdpfast.watch.discover import complete_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 3
_PATIENCE_S = 600
HAVE_DEEPSPEED = __import__("importlib.util").util.find_spec("deepspeed") is not None
_NEEDS = {
    "accelerate": HAVE_ACCELERATE,
    "trainer": HAVE_ACCELERATE,
    "torchtitan": HAVE_TORCHTITAN,
    "deepspeed": HAVE_DEEPSPEED,
    "verl": __import__("importlib.util").util.find_spec("verl") is not None,
}


def _not_importable(framework: str) -> str | None:
    """Why the framework's saving code cannot run here (None: it can). verl is installed by hand, not
    by the test extra: `pip install --no-deps verl==0.9.1` with omegaconf, tensordict, ray, codetiming
    (its requirements pin transformers < 5.11 and pull in ray's and vLLM's worlds)."""
    if framework != "verl":
        return None
    try:
        import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401
    except ImportError as exc:
        return f"verl is installed but its FSDPCheckpointManager cannot be imported: {exc}"
    return None


class Observer(threading.Thread):
    """Lists the run folder's complete checkpoints in a loop; for each, the files under the folder
    the merge reads (name -> size) every time it is called complete; and how often a checkpoint's
    folder was there but not yet complete (the watcher's rule saw it midway)."""

    def __init__(self, run_dir: str):
        super().__init__(daemon=True)
        self.run_dir, self.stop = run_dir, threading.Event()
        self.seen: dict[str, set] = {}
        self.incomplete: dict[str, int] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            complete = {c.name: c.path for c in complete_checkpoints(self.run_dir)}
            for name, path in complete.items():
                try:
                    self.seen.setdefault(name, set()).add(_files(locate(path, _holds_layout).path))
                except OSError:  # a file removed while listed: a framework's temporary file
                    self.seen[name].add(("vanished",))
            for entry in os.listdir(self.run_dir) if os.path.isdir(self.run_dir) else []:
                if entry not in complete and os.path.isdir(os.path.join(self.run_dir, entry)):
                    self.incomplete[entry] = self.incomplete.get(entry, 0) + 1
            time.sleep(0.002)


def _holds_layout(folder: str) -> bool:
    return any(reader.sniff(folder) for reader in readers.READERS.values())


def _files(folder: str) -> tuple:
    found = []
    for base, _, names in os.walk(folder):
        found += [
            (os.path.relpath(os.path.join(base, n), folder), os.path.getsize(os.path.join(base, n))) for n in names
        ]
    return tuple(sorted(found))


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


@pytest.fixture(scope="module", params=[pytest.param(f, id=f) for f in _NEEDS])
def watched_run(request, tmp_path_factory):
    framework = request.param
    if not _NEEDS[framework]:
        pytest.skip(f"{framework} is not installed")
    if _not_importable(framework):
        pytest.skip(_not_importable(framework))
    root = tmp_path_factory.mktemp(framework)
    run_dir, out, log = run_folder(str(root), framework), root / "out", root / "events.jsonl"
    os.makedirs(run_dir, exist_ok=True)
    command = [sys.executable, "-m", "fsdpfast", "watch", run_dir, "--out", str(out), "--json", "--interval", "0.02"]
    command += ["--config", str(root / "run")]  # config.json in the run's output_dir, as a user keeps it
    watcher = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.PIPE, text=True)
    observer = Observer(run_dir)
    observer.start()
    try:
        write_framework_run(str(root), framework, STEPS)
        _await_every_step(watcher, log)
    finally:
        _stop(watcher, observer)
    names = [checkpoint_name(framework, step) for step in range(1, STEPS + 1)]
    return framework, root, run_dir, names, _events(log), observer


def test_every_step_is_published_once_in_order_and_nothing_refused(watched_run):
    framework, _, _, names, events, _ = watched_run
    assert [e["checkpoint"] for e in events if e["event"] == "published"] == names, events
    assert not [e for e in events if e["event"] in ("refused", "failed")], events
    # A Trainer's checkpoint-N is complete for the merge once its model's DCP folder has its
    # .metadata (discover's accelerate rule), which may be seen before trainer_state.json.
    expected = {"trainer", "accelerate"} if framework == "trainer" else {framework}
    assert {e["framework"] for e in events if e["event"] == "found"} <= expected, events


def test_each_published_folder_is_what_merge_writes_from_the_finished_checkpoint(watched_run, tmp_path):
    _, root, run_dir, names, _, _ = watched_run
    for name in names:
        merged = tmp_path / name
        fsdpfast.merge(os.path.join(run_dir, name), merged, config=str(root / "run"))
        published = root / "out" / name
        weights = sorted(p.name for p in merged.iterdir() if p.suffix == ".safetensors")
        assert weights and weights == sorted(p.name for p in published.iterdir() if p.suffix == ".safetensors")
        for file in weights:
            assert (published / file).read_bytes() == (merged / file).read_bytes(), (name, file)
        reference, tied = load_reference(str(root / "refs" / f"{name}.pt"))
        assert_bit_exact(read_merged(str(published)), reference, tied=tied)


def test_a_checkpoint_is_complete_only_with_every_file_the_merge_reads(watched_run):
    _, _, run_dir, names, _, observer = watched_run
    assert sorted(observer.seen) == sorted(names)
    for name in names:
        final = _files(locate(os.path.join(run_dir, name), _holds_layout).path)
        assert observer.seen[name] == {final}, (name, observer.seen[name] - {final})
    assert all(observer.incomplete.get(name, 0) > 0 for name in names), observer.incomplete  # looked at midway


# ---- Megatron: megatron-core is not installed in CI; its save is replayed -----------------------

MEGATRON = Path(__file__).parents[1] / "data" / "megatron" / "tp2_pp1"
# The file system calls of a live megatron-core 0.16.1 dist_checkpointing.save of this fixture and
# Megatron-LM's tracker write after it, in the order they began, recorded with strace by
# tests/fixtures/record_megatron_save_order.py: rank 0's common.pt; both ranks' writer threads'
# __<rank>_<i>.distcp, interleaved, each fsynced and closed; rank 0's .metadata.tmp renamed to
# .metadata; metadata.json; then the tracker, truncated and rewritten in place.
SAVE_ORDER = json.loads((MEGATRON.parent / "save_order_tp2_pp1.json").read_text())["ops"]
_RECORDED = "iter_0000007"
_TRACKER = "latest_checkpointed_iteration.txt"


def _replay_megatron_save(run: Path, iteration: int) -> None:
    """The recorded calls, one at a time, on the fixture's own bytes (`.metadata.tmp`'s are
    `.metadata`'s), the folder renamed to this iteration's; a pause after each so that the
    watcher and the observer look at every state the save passes through."""
    source = MEGATRON / "run" / _RECORDED
    folder = f"iter_{iteration:07d}"
    written = {o["to"] for o in SAVE_ORDER if o["op"] == "rename"} | {
        o["path"] for o in SAVE_ORDER if o["op"] == "open" and not o["path"].endswith(".tmp")
    }
    assert sorted(written) == sorted([f"{_RECORDED}/{n}" for n in os.listdir(source)] + [_TRACKER])
    files, left = {}, {}
    for op in SAVE_ORDER:
        path = run / op["path"].replace(_RECORDED, folder)
        if op["op"] == "mkdir":
            path.mkdir()
        elif op["op"] == "open":
            files[path] = open(path, "wb")
            name = op["path"].removeprefix(_RECORDED + "/").removesuffix(".tmp")
            left[path] = str(iteration).encode() if name == _TRACKER else (source / name).read_bytes()
        elif op["op"] == "write":
            count = len(left[path]) if path.name == _TRACKER else op["bytes"]
            files[path].write(left[path][:count])
            files[path].flush()
            left[path] = left[path][count:]
        elif op["op"] == "fsync":
            os.fsync(files[path].fileno())
        elif op["op"] == "close":
            files.pop(path).write(left.pop(path))  # the rest, where the fixture's file is longer
        elif op["op"] == "rename":
            os.rename(path, run / op["to"].replace(_RECORDED, folder))
        time.sleep(0.005 if op["op"] == "write" else 0.03)
    assert not files


def test_megatron_iterations_written_in_a_recorded_megatron_core_order_are_published_once_each(tmp_path):
    def save(run: Path) -> None:
        for iteration in range(1, STEPS + 1):
            _replay_megatron_save(run, iteration)

    _assert_megatron_iterations_published_once_each(tmp_path, STEPS, save)


def _assert_megatron_iterations_published_once_each(tmp_path: Path, iterations: int, save) -> None:
    """`save(run)` writes iterations 1.. of the tp2_pp1 model while a watcher polls every 20 ms: each
    published once, the fixture's weights bit for bit, every look at a complete iteration seeing its
    final files, and each looked at while it was still incomplete."""
    from safetensors.torch import load_file

    run, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "events.jsonl"
    run.mkdir()
    command = [sys.executable, "-m", "fsdpfast", "watch", str(run), "--out", str(out), "--json", "--interval", "0.02"]
    watcher = subprocess.Popen(
        command + ["--config", str(MEGATRON / "hf")], stdout=open(log, "w"), stderr=subprocess.PIPE, text=True
    )
    observer = Observer(str(run))
    observer.start()
    names = [f"iter_{i:07d}" for i in range(1, iterations + 1)]
    try:
        save(run)
        _await_every_step(watcher, log, iterations)
    finally:
        _stop(watcher, observer)
    events = _events(log)
    assert [e["checkpoint"] for e in events if e["event"] == "published"] == names, events
    assert {e["framework"] for e in events if e["event"] == "found"} == {"megatron"}
    reference = load_file(str(MEGATRON / "reference.safetensors"))
    for name in names:
        assert_bit_exact(read_merged(str(out / name)), reference)
        final = _files(str(run / name))
        assert observer.seen[name] == {final}, (name, observer.seen[name] - {final})
        assert observer.incomplete.get(name, 0) > 0, observer.incomplete


def _await_every_step(watcher: subprocess.Popen, log, steps: int = STEPS) -> None:
    """Until the watcher has said how each of the `steps` checkpoints ended (it must stay up meanwhile)."""
    deadline = time.monotonic() + _PATIENCE_S
    while len([e for e in _events(log) if e["event"] in ("published", "refused", "failed")]) < steps:
        assert watcher.poll() is None, watcher.communicate()[1]
        assert time.monotonic() < deadline, _events(log)
        time.sleep(0.05)


def _stop(watcher: subprocess.Popen, observer) -> None:
    """The observer stopped, the watcher sent SIGTERM: it must exit 0."""
    observer.stop.set()
    observer.join()
    watcher.send_signal(signal.SIGTERM)
    _, err = watcher.communicate(timeout=_PATIENCE_S)
    assert watcher.returncode == 0, err


# ---- Megatron live, where megatron-core is installed (never in CI) ------------------------------

MEGATRON_PYTHON = os.environ.get("FSDPFAST_MEGATRON_PYTHON")  # an interpreter with megatron-core 0.16.1
_LIVE_ITERATIONS = 2  # each starts two ranks that import megatron-core: a minute or more apiece


@pytest.mark.skipif(
    not MEGATRON_PYTHON, reason="megatron-core is not installed: FSDPFAST_MEGATRON_PYTHON names a python that has it"
)
def test_megatron_cores_own_save_while_watched_is_published_once_each(tmp_path):
    """megatron-core's dist_checkpointing.save and the tracker write, live on two gloo ranks
    (tests/fixtures/megatron_live_run.py), while the watcher polls."""
    script = Path(__file__).parents[1] / "fixtures" / "megatron_live_run.py"

    def save(run: Path) -> None:
        saved = subprocess.run(
            [MEGATRON_PYTHON, str(script), str(run), str(_LIVE_ITERATIONS)], capture_output=True, text=True
        )
        assert saved.returncode == 0, saved.stderr[-3000:]

    _assert_megatron_iterations_published_once_each(tmp_path, _LIVE_ITERATIONS, save)
