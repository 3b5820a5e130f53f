"""Build the class config.json names on the meta device and keep what the check needs of it.

The one place the check imports torch and transformers (seconds of CPU, a few hundred MB). It runs
in a child process started as planning begins (plan.expected_builds), so the merge's own process
imports neither and moves bytes meanwhile: `python -m fsdpfast.plan.model_build` reads one request
(JSON on stdin), builds, stores the entry in the cache (plan.model_cache) and writes it on stdout.
Only classes transformers itself ships are built: no code from the checkpoint runs.
"""

from __future__ import annotations

import base64
import json
import sys

from . import model_cache
from .expected_model import ExpectedModel

PATH_MARK = "<config.json>"  # where the config's path goes in a message kept in the cache


def build_entry(path: str, config: dict) -> dict:
    """{"model": ExpectedModel.as_json() or None, "why_not": why there is no model (PATH_MARK for the
    path), "lasting": whether that answer holds for as long as these bytes and this transformers do,
    "transformers": its version}."""
    try:
        import torch
        import transformers
    except ImportError:
        return {"model": None, "why_not": "transformers is not installed", "lasting": False, "transformers": None}
    version = transformers.__version__
    architectures = config.get("architectures")
    named = isinstance(architectures, list) and architectures and isinstance(architectures[0], str)

    def without(why: str, lasting: bool) -> dict:
        return {"model": None, "why_not": why.replace(path, PATH_MARK), "lasting": lasting, "transformers": version}

    if named:
        cls = getattr(transformers, architectures[0], None)
        if not isinstance(cls, type) or not hasattr(cls, "config_class"):
            return without(
                f"{path} names {architectures[0]}, which this transformers ({version}) "
                "does not ship (custom model code is never run)",
                True,
            )
    else:
        cls = _base_model_class(transformers, config["model_type"])
        if cls is None:
            return without(
                f"{path} has no 'architectures' field and transformers ({version}) "
                f"knows no model_type {config['model_type']!r}",
                True,
            )
    try:
        model = _build_on_meta(torch, transformers, cls, config)
    except Exception as exc:  # noqa: BLE001 - any failure to build means the check cannot run, said in a note
        # not kept: it may come from something installed later (a package the class needs)
        return without(f"{cls.__name__} could not be built from {path} ({type(exc).__name__}: {str(exc)[:200]})", False)
    expected = ExpectedModel(
        cls.__name__,
        path,
        {key: tuple(value.shape) for key, value in model.state_dict().items()},
        _tied_names(model),
        getattr(model, "base_model_prefix", "") or "",
        _patterns(model, "_keys_to_ignore_on_load_missing"),
        _patterns(model, "_keys_to_ignore_on_load_unexpected"),
        base_only=not named,
        kept_fp32=(
            tuple(sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ())),
            tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ())),
        ),
    )
    return {"model": expected.as_json(), "why_not": "", "lasting": True, "transformers": version}


def _base_model_class(transformers, model_type: str):
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
        return transformers.MODEL_MAPPING[config_class]
    except (KeyError, ValueError):
        return None


def _build_on_meta(torch, transformers, cls, config: dict):
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        hf_config = cls.config_class.from_dict(dict(config))
        hf_config._attn_implementation = "eager"  # the kernels are irrelevant on meta; flash-attn may be absent
        with torch.device("meta"):
            return cls(hf_config)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _tied_names(model) -> dict[str, str]:
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _patterns(model, attribute: str) -> tuple[str, ...]:
    value = getattr(model, attribute, None) or ()
    return tuple(str(p) for p in value)


def request(path: str, data: bytes, key: str | None) -> bytes:
    """What the child reads: the config's bytes, how messages name it, the cache key (None: not kept)
    and the parent's import path (a package found through sys.path edits is found here too)."""
    return json.dumps(
        {"path": path, "data": base64.b64encode(data).decode(), "key": key, "sys_path": list(sys.path)}
    ).encode()


def main() -> None:
    asked = json.loads(sys.stdin.buffer.read())
    sys.path.extend(p for p in asked["sys_path"] if p not in sys.path)
    config = json.loads(base64.b64decode(asked["data"]))
    entry = build_entry(asked["path"], config)
    if asked["key"] and entry["lasting"]:
        entry["stored"] = model_cache.write_entry(asked["key"], entry)
    sys.stdout.write(json.dumps(entry))


if __name__ == "__main__":
    main()
