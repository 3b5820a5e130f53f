"""What of an existing OUT_DIR an earlier merge wrote: --overwrite replaces that and nothing else.

A merge's manifest lists every file it left in its folder with its size and st_mtime_ns (`written`:
taken from the staging folder just before the manifest is written, so the config, tokenizer, index and
adapter folders are listed however they were made). In an existing OUT_DIR anything else is not
fsdpfast's: a name the list lacks (eval results, notes, other models), a listed name of another
size or modification time (another model of that name, copied in), a link, a folder no listed file is in. --overwrite refuses
such a folder, naming what it found, before anything is touched; and when the previous folder is
removed after the new one is published, only the listed files still of their size and time go, so what
appeared in it meanwhile stays.
"""

from __future__ import annotations

import os
import stat

from ..errors import BadInput, option
from ..manifest import MANIFEST_NAME, WRITTEN, load_manifest

_SHOWN = 5  # entries named in the refusal; the rest are counted


def written_files(folder: str, leave_out: tuple[str, ...] = ()) -> dict[str, dict]:
    """Every regular file below `folder` (its path relative to it, "/"-separated) and its size and
    st_mtime_ns, the top-level manifest and `leave_out` aside. What a merge records as `written`."""
    found = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and relative not in (MANIFEST_NAME, *leave_out):
                found[relative] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return found


def overwrite_refusal(out_dir: str, shown: str) -> str | None:
    """Why --overwrite may not replace the existing, non-empty folder `out_dir` (one line naming
    what was found), or None when everything in it is what an earlier merge wrote."""
    flag = option("overwrite", True)
    if os.path.islink(out_dir):
        return (
            f"{shown} is a link to {os.path.realpath(out_dir)}; {flag} replaces only a folder an earlier "
            "merge wrote: give the folder it points to as the output folder, or remove the link yourself"
        )
    try:
        listed = _listed(out_dir)
    except BadInput as exc:
        return (
            f"{exc}, so {flag} cannot tell what in {shown} fsdpfast wrote: remove it yourself or choose another folder"
        )
    if listed is None:
        return (
            f"{shown} holds files fsdpfast did not write (no {MANIFEST_NAME}); {flag} replaces only an empty "
            "folder or an earlier merge: remove it yourself or choose another folder"
        )
    try:
        foreign = _foreign(out_dir, "", listed)
    except OSError as exc:
        return f"{shown}: cannot read the existing output folder ({exc.strerror}); it is left as it is"
    if not foreign:
        return None
    count = len(foreign)
    return (
        f"{shown} holds {count} {'entry' if count == 1 else 'entries'} fsdpfast did not write ({_names(foreign)}); "
        f"{flag} replaces only what an earlier merge wrote (its {MANIFEST_NAME} lists it): move "
        f"{'it' if count == 1 else 'them'} out, remove the folder yourself, or choose another folder"
    )


def remove_written(folder: str) -> list[str]:
    """Remove from `folder` (a previous OUT_DIR, moved aside) the files its manifest lists that still
    have their size and modification time, the folders they leave empty, the manifest last (kept
    when it could not be read), and `folder` if it is then empty. What is left (entries that
    appeared after the check), relative to `folder`."""
    try:
        listed = _listed(folder)
    except BadInput:  # changed since it was checked: nothing is known to be ours
        listed = None
    try:
        _remove(folder, "", listed or {})
        manifest = os.path.join(folder, MANIFEST_NAME)
        if listed is not None and os.path.isfile(manifest) and not os.path.islink(manifest):
            os.unlink(manifest)
        left = sorted(os.listdir(folder))
        if not left:
            os.rmdir(folder)
    except OSError:  # what could not be removed stays, and is said
        try:
            return sorted(os.listdir(folder)) if os.path.lexists(folder) else []
        except OSError:
            return ["(unreadable)"]
    return left


def kept_note(folder: str, left: list[str], out_dir: str) -> str:
    """Where the entries that appeared in the previous OUT_DIR during the swap were kept (a warning)."""
    return (
        f"{_names(left)} appeared in {out_dir} while it was being replaced: not written by fsdpfast, kept in {folder}"
    )


def _names(entries: list[str]) -> str:
    more = len(entries) - _SHOWN
    return ", ".join(entries[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _listed(folder: str) -> dict[str, dict] | None:
    """The files the manifest in `folder` says the merge wrote; None when there is no manifest file.
    BadInput when it cannot be read, is damaged or lists nothing (not written by this fsdpfast)."""
    path = os.path.join(folder, MANIFEST_NAME)
    if os.path.islink(path):
        raise BadInput(f"{path} is a link, not a manifest a merge wrote")
    if not os.path.isfile(path):
        return None
    manifest = load_manifest(path)
    if WRITTEN not in manifest:
        raise BadInput(f"{path} does not list the files of its folder (an older fsdpfast's manifest, or edited)")
    written = manifest[WRITTEN]  # load_manifest checked its type and entries, and that "files" is a dict
    for name, entry in manifest.get("files", {}).items():  # the model files, listed twice: a cheap consistency check
        if not isinstance(entry, dict) or name not in written or written[name]["size"] != entry.get("size"):
            raise BadInput(f"{path}: its lists of files disagree on {name[:80]}; the manifest is damaged")
    return written


def _same(entry: os.DirEntry, listed: dict) -> bool:
    """A regular file of the size and st_mtime_ns the manifest lists for it."""
    st = entry.stat(follow_symlinks=False)
    return stat.S_ISREG(st.st_mode) and st.st_size == listed["size"] and st.st_mtime_ns == listed["mtime_ns"]


def _foreign(folder: str, prefix: str, listed: dict[str, dict]) -> list[str]:
    """The entries below `folder` (named `prefix` + name) that are not listed files of their listed
    size and modification time, nor folders holding listed files; links are never followed, unlisted folders never entered."""
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        name = prefix + entry.name
        if entry.is_symlink():
            found.append(f"{name} (a link)")
        elif entry.is_dir():
            if any(path.startswith(name + "/") for path in listed):
                found += _foreign(entry.path, name + "/", listed)
            else:
                found.append(name + "/")
        elif name == MANIFEST_NAME or (name in listed and _same(entry, listed[name])):
            continue
        elif name in listed and entry.is_file() and entry.stat().st_size != listed[name]["size"]:
            found.append(f"{name} ({entry.stat().st_size} bytes, the manifest says {listed[name]['size']})")
        elif name in listed and entry.is_file():
            found.append(f"{name} (modified or copied in since the merge wrote it: not the time the manifest lists)")
        else:
            found.append(name)
    return found


def _remove(folder: str, prefix: str, listed: dict[str, dict]) -> None:
    for entry in os.scandir(folder):
        name = prefix + entry.name
        if entry.is_symlink():
            continue
        if entry.is_dir():
            if any(path.startswith(name + "/") for path in listed):
                _remove(entry.path, name + "/", listed)
                try:
                    os.rmdir(entry.path)
                except OSError:  # holds something not listed: it stays
                    pass
        elif name in listed and _same(entry, listed[name]):
            os.unlink(entry.path)
