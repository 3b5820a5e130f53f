"""The expected model of a config.json: known to this process, read from the cache, or being built in a child process.

`start_build` returns at once. A config built before (the same bytes, the same transformers) is
read from the cache (plan.model_cache) and nothing is imported; otherwise a child process
(plan.model_build) imports torch and transformers and builds it while this process goes on
planning or writing, and `result()` waits for it. In a process that has imported both already (a
training script, a notebook) building here costs less than starting a Python, so it is built at
once. A child that cannot be started or gives no answer is replaced by a build here: the check
never goes missing because of how it was run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from . import model_cache
from .expected_model import ConfigSource, ExpectedModel, config_source
from .model_build import PATH_MARK, build_entry, request

log = logging.getLogger("fsdpfast")

# key -> (entry, ""): models this process built and the cache could not keep (a read-only home), so that
# a merge planned again (pipeline.model_check.TiesChanged) does not build again
_known: dict[str, tuple[dict, str]] = {}
_running: dict[str, ExpectedBuild] = {}  # key -> the build under way, shared by whoever asks for the same config


def transformers_version() -> str | None:
    """The transformers a build would import (None: not importable, with torch), found without importing it."""
    if "transformers" in sys.modules and "torch" in sys.modules:
        return getattr(sys.modules["transformers"], "__version__", None) or "unknown"
    try:
        found = importlib.util.find_spec("transformers")
        if found is None or importlib.util.find_spec("torch") is None:
            return None
    except (ImportError, ValueError):  # a broken entry in sys.modules or on the path
        return None
    beside = _dist_info_version(found.origin)
    if beside:
        return beside
    from importlib import metadata  # 50 ms to import: only where the distribution is not beside the package

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "unknown"  # importable without an installed distribution: built every time, never cached


def _dist_info_version(origin: str | None) -> str | None:
    """The version in the name of the one transformers-VERSION.dist-info beside the package (pip's install)."""
    if not origin:
        return None
    folder = os.path.dirname(os.path.dirname(origin))
    try:
        found = [n for n in os.listdir(folder) if n.startswith("transformers-") and n.endswith(".dist-info")]
    except OSError:
        return None
    return found[0][len("transformers-") : -len(".dist-info")] if len(found) == 1 else None


class ExpectedBuild:
    """One config's expected model: `done()` without waiting, `result()` waiting, `cancel()` if no longer wanted."""

    def __init__(self, source: ConfigSource | None, key: str | None, why_not: str = "", entry=None, cached=""):
        self.source, self.key = source, key
        self._why_not = why_not
        self._entry, self._cached = entry, cached
        self._child = None
        self._files = ()
        self.started = 0.0

    @property
    def from_cache(self) -> bool:
        return bool(self._cached)

    def done(self) -> bool:
        return (
            self._entry is not None
            or self._why_not != ""
            or (self._child is not None and self._child.poll() is not None)
        )

    def result(self) -> tuple[ExpectedModel | None, str]:
        """(the model, "") or (None, why the check cannot run), waiting for the child if it is still building."""
        if self._why_not:
            return None, self._why_not
        if self._entry is None:
            self._entry = self._answer()
            if self.key and self._entry["lasting"] and not self._entry.get("stored"):
                _known[self.key] = (self._entry, "")  # the cache could not keep it: this process does
        if _running.get(self.key) is self:
            del _running[self.key]
        entry, path = self._entry, self.source.path
        if entry["model"] is None:
            return None, entry["why_not"].replace(PATH_MARK, path)
        return ExpectedModel.from_json(entry["model"], path, cached=self._cached), ""

    def cancel(self) -> None:
        """Stop the child if it is still building (what it has not stored is lost: the next run builds again)."""
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        self._child = None  # asked for after all: built here
        self._close_files()
        if _running.get(self.key) is self:
            del _running[self.key]

    def _start(self) -> None:
        """The child process, or nothing if none can be started (`_answer` builds here then)."""
        files = [tempfile.TemporaryFile() for _ in range(3)]  # request, answer, what it says on stderr
        files[0].write(request(self.source.path, self.source.data, self.key))
        files[0].seek(0)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self.started = time.perf_counter()
        try:
            # -P and a neutral working folder: `-m` would put the current folder (perhaps the
            # checkpoint's, holding a json.py) first on sys.path, and no code from it may run
            self._child = subprocess.Popen(
                [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "fsdpfast.plan.model_build"],
                cwd=tempfile.gettempdir(),
                stdin=files[0],
                stdout=files[1],
                stderr=files[2],
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            log.info("the model check's process could not start (%s); building here", exc)
            for f in files:
                f.close()
            return
        self._files = files

    def _answer(self) -> dict:
        if self._child is not None:
            status = self._child.wait()
            try:
                self._files[1].seek(0)
                entry = json.loads(self._files[1].read())
                if status == 0 and isinstance(entry, dict) and {"model", "why_not", "lasting"} <= set(entry):
                    log.info("model check built in a child process in %.2f s", time.perf_counter() - self.started)
                    return entry
                self._files[2].seek(0)
                said = self._files[2].read().decode(errors="replace").strip().splitlines()
                log.info("the model check's process failed (%s); building here", said[-1] if said else status)
            except ValueError:
                log.info("the model check's process gave no answer (exit status %s); building here", status)
            finally:
                self._close_files()
        config = json.loads(self.source.data) if self.source.data else self.source.config
        entry = build_entry(self.source.path, config)
        if self.key and entry["lasting"]:
            entry["stored"] = model_cache.write_entry(self.key, entry)
        return entry

    def _close_files(self) -> None:
        for f in self._files:
            f.close()
        self._files = ()


def start_build(config_dir: str | None, built: dict | None = None, *, version: str | None = None) -> ExpectedBuild:
    """The build of the model config.json describes (`built`: a config a reader built, used when there
    is no config_dir), started: from this process's memory, the cache, at once here, or in a child.
    `version`: the transformers version the cache key is made of (default: the one installed; a test
    gives another to see a key change). BadInput for a config.json that is not a JSON object."""
    source = config_source(config_dir, built)
    if isinstance(source, str):
        return ExpectedBuild(None, None, why_not=source)
    config = source.config
    architectures = config.get("architectures")
    named = isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
    if not named and not isinstance(config.get("model_type"), str):
        why = f"{source.path} has neither an 'architectures' field naming the model class nor a 'model_type'"
        return ExpectedBuild(source, None, why_not=why)
    installed = transformers_version()
    if installed is None:
        return ExpectedBuild(source, None, why_not="transformers is not installed")
    version = version or installed
    # a development or local build keeps one version string across changes of its code: never cached
    cacheable = version != "unknown" and "dev" not in version and "+" not in version
    key = model_cache.entry_key(source.data, version) if cacheable else None
    if key in _running:
        return _running[key]
    if key in _known:
        entry, cached = _known[key]
        return ExpectedBuild(source, key, entry=entry, cached=cached)
    if key:
        entry = _valid(model_cache.read_entry(key))
        if entry is not None:
            return ExpectedBuild(source, key, entry=entry, cached=model_cache.entry_path(key))
    build = ExpectedBuild(source, key)
    if "transformers" in sys.modules and "torch" in sys.modules:
        build.result()  # imported already: building here is the cheapest
    else:
        build._start()
        if build._child is not None and key:
            _running[key] = build
    return build


def _valid(entry: dict | None) -> dict | None:
    """An entry read back that holds a model `from_json` takes, or a reason; else None (built again)."""
    if entry is None or not entry.get("lasting"):
        return None
    try:
        if entry.get("model") is not None:
            ExpectedModel.from_json(entry["model"], "")
        elif not isinstance(entry.get("why_not"), str) or not entry["why_not"]:
            return None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return entry
