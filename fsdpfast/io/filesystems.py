"""Which filesystem a folder is on, by the type statfs(2) reports for it (f_type).

On a network filesystem or a FUSE mount each page fault of a mapped file is a round trip with
few in flight, so a merge reads such sources with large explicit reads instead (io.read_modes).
The type numbers are the kernels' and the filesystems' own (linux/magic.h, coreutils' stat, the
Lustre, GPFS and BeeGFS clients); FUSE covers the object-store mounts (gcsfuse, mountpoint-s3, s3fs).
"""

from __future__ import annotations

import os
import sys

REMOTE = {
    0x6969: "NFS",
    0x517B: "SMB",
    0xFF534D42: "CIFS",
    0xFE534D42: "SMB2",
    0x65735546: "FUSE",
    0x0BD00BD0: "Lustre",
    0x47504653: "GPFS",
    0x00C36400: "CephFS",
    0x01021997: "9p",
    0x19830326: "BeeGFS",
}

_LIBC = None


def filesystem_type(path: str) -> int | None:
    """statfs's f_type for `path` (a folder or a file); None where it cannot be asked (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.statfs.argtypes = (ctypes.c_char_p, ctypes.c_void_p)
    # struct statfs begins with f_type, a word (__fsword_t: a long); 120 bytes on 64-bit Linux, room for more
    buffer = (ctypes.c_long * 64)()
    if _LIBC.statfs(os.fsencode(path), buffer) != 0:
        return None
    return buffer[0] & 0xFFFFFFFF  # the magic numbers are 32-bit; a signed word may carry them negative


def nearest_existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists (an output folder not made yet is on its parent's)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def remote_filesystem(path: str) -> str | None:
    """The name of the network or FUSE filesystem `path` is on; None for a local one (or not known)."""
    kind = filesystem_type(path)
    return None if kind is None else REMOTE.get(kind)
