"""The watcher's wait between passes (watch.wakeups): cut short by a change in the run folder where inotify works."""

from __future__ import annotations

import sys
import threading

import pytest

from fsdpfast.watch.wakeups import Wakeups


@pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")
@pytest.mark.parametrize("where", ["run folder", "step folder"])
def test_a_new_file_ends_the_wait(tmp_path, where):
    (tmp_path / "global_step_1").mkdir()
    wakeups = Wakeups(str(tmp_path))
    assert wakeups.notified
    waiting = threading.Thread(target=wakeups.wait, args=(3600,))  # an hour: only a change can end it
    waiting.start()
    try:
        while not waiting.is_alive():
            pass
        folder = tmp_path if where == "run folder" else tmp_path / "global_step_1"
        threading.Timer(0.5, lambda: (folder / "latest_checkpointed_iteration.txt").write_text("1")).start()
        waiting.join(timeout=120)
        assert not waiting.is_alive(), "the wait did not end on the new file"
    finally:
        wakeups.close()


def test_without_inotify_the_wait_is_the_interval(tmp_path, monkeypatch):
    wakeups = Wakeups(str(tmp_path / "not-there"))
    wakeups.close()  # as where inotify cannot be had
    assert not wakeups.notified
    wakeups.wait(0)
