"""Waiting between two passes of the watcher: the poll interval, cut short by inotify where it works.

Polling is what works everywhere (network filesystems, object stores and FUSE mounts of them). On Linux a
local run folder also tells the watcher at once when something is created, moved in or finished
writing in it or in its direct sub-folders (a step folder, its marker file): inotify, through the
C library (no package needed), each pass's folders watched anew. Where inotify cannot be had (not
Linux, a filesystem that sends no events, the per-user watch limit reached) the interval alone
decides; an event only makes the next pass come sooner, it is never trusted to say a checkpoint
is complete (watch.discover decides that from the files).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import time

from ..remote.urls import is_remote

_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x08, 0x80, 0x100
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_EVENTS = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE


class Wakeups:
    """`wait(seconds)`: sleep that long, or less when the run folder changes (inotify)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._libc = None if is_remote(run_dir) else _libc()  # a store sends nothing: polled
        self._fd = -1
        if self._libc is not None:
            self._fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)

    @property
    def notified(self) -> bool:
        """Whether changes can cut a wait short here."""
        return self._fd >= 0

    def wait(self, seconds: float) -> None:
        if not self.notified:
            time.sleep(seconds)
            return
        self._watch_folders()
        ready, _, _ = select.select([self._fd], [], [], seconds)
        if ready:
            time.sleep(0.2)  # let a burst of writes (a marker file, then its rename) settle first
            self._drain()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _watch_folders(self) -> None:
        """The run folder and its direct sub-folders (inotify watches one folder each; adding one twice is a no-op)."""
        folders = [self.run_dir]
        try:
            folders += [e.path for e in os.scandir(self.run_dir) if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass
        for folder in folders:
            self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _EVENTS)  # -1 (limit, gone): polled

    def _drain(self) -> None:
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass


def _libc():
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None
