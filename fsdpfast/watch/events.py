"""What the watcher tells a pipeline: one line per event on stdout, JSON (`--json`) or a sentence.

Events: `watching` (the start), `found` (a complete checkpoint not yet published), `skipped` (its
output already holds it), `started`, `published` (seconds, bytes), `refused` (the one-line reason:
bad input, fix and it is tried again once its files change), `failed` (any other error, the same;
the object store failing past its client's retries: tried again the next pass, the checkpoint null
when it failed listing), `then` (the command's exit status), `removed` (--keep-last), `stopped`.
"""

from __future__ import annotations

import json
import sys
import time


class Events:
    def __init__(self, as_json: bool, stream=None):
        self.as_json = as_json
        self.stream = stream or sys.stdout

    def __call__(self, event: str, **fields) -> None:
        if self.as_json:
            line = json.dumps({"event": event, "time": round(time.time(), 3), **fields})
        else:
            line = f"fsdpfast watch: {_sentence(event, fields)}"
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except BrokenPipeError:  # the reader went away: the watcher goes on publishing
            pass


def _sentence(event: str, f: dict) -> str:
    name = f.get("checkpoint", "")
    if event == "watching":
        how = (
            "once"
            if f.get("once")
            else f"every {f['interval']:g} s" + (", sooner on changes" if f.get("notified") else "")
        )
        return f"watching {f['run_dir']} ({how}), publishing into {f['out_root']}"
    if event == "found":
        return f"found {name} ({f['framework']})"
    if event == "skipped":
        return f"{name}: already published in {f['out']}"
    if event == "started":
        return f"merging {name} into {f['out']}"
    if event == "published":
        return f"published {name} as {f['out']} ({f['bytes']} bytes in {f['seconds']:.2f} s)"
    if event in ("refused", "failed"):
        return f"{event} {name}: {f['reason']}" if name else f"{event}: {f['reason']}"
    if event == "then":
        return f"{f['command']} {f['out']}: exit status {f['status']}"
    if event == "removed":
        kept = f"; kept what fsdpfast did not write: {', '.join(f['kept'])}" if f.get("kept") else ""
        return f"removed {f['out']} (--keep-last){kept}"
    if event == "stopped":
        return f"stopped ({f['reason']})"
    return f"{event} {f}"
