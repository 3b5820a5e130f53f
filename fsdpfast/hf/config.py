"""Reading a Hugging Face config.json: a JSON object, or one clear error."""

from __future__ import annotations

import json

from ..errors import BadInput


def load_config(path: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise BadInput(
            f"{path}: holds a JSON {type(config).__name__}, not an object; a Hugging Face config is an object"
        )
    return config
