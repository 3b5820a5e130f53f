"""Whether a config folder's files name the same end-of-sequence token: config.json,
generation_config.json and the tokenizer's.

A merge copies these files as they are; when they disagree, generation does not stop where the
model was trained to (transformers' generate stops at generation_config.json's ids, servers at
the tokenizer's too), so the merge warns, naming both values. Read from the files alone, as
transformers 5 resolves them, no tokenizer code run:
- the tokenizer's eos token is tokenizer_config.json's `eos_token` (a string, or an AddedToken
  record with `content`); where that file has no `added_tokens_decoder` (a legacy save),
  special_tokens_map.json's `eos_token` overrides it;
- its id is where that text is listed: tokenizer_config.json's `added_tokens_decoder` (id ->
  record), added_tokens.json (text -> id), tokenizer.json's `added_tokens`, then its model's
  vocabulary. Not found there (a sentencepiece model file only): not compared.
Two values agree when the ids of one are among the other's (generation_config.json often lists
more ids than config.json, and the tokenizer's one is among them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .config import load_config


@dataclass(frozen=True)
class _Eos:
    where: str  # what says it, as the warning names it
    ids: frozenset[int]
    shown: str  # the value as written


def eos_disagreements(config_dir: str | None) -> list[str]:
    """One warning for each two of config.json, generation_config.json and the tokenizer files of
    `config_dir` whose end-of-sequence ids disagree; [] where they agree or say nothing."""
    if not config_dir or not os.path.isfile(os.path.join(config_dir, "config.json")):
        return []
    config = load_config(os.path.join(config_dir, "config.json"))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    own = config.get("eos_token_id")  # a vision-language model's may be in its text_config only
    found = [
        _ids_entry("config.json", own if own is not None else text.get("eos_token_id")),
        _ids_entry("generation_config.json", _json(config_dir, "generation_config.json").get("eos_token_id")),
    ]
    found = [entry for entry in found if entry is not None]
    if found:  # else nothing to compare the tokenizer's with: its tokenizer.json (tens of MB) is not read
        found += [entry for entry in [_tokenizer_eos(config_dir)] if entry is not None]
    warnings = []
    for i, a in enumerate(found):
        for b in found[i + 1 :]:
            if not (a.ids <= b.ids or b.ids <= a.ids):
                warnings.append(
                    f"the end-of-sequence token disagrees: {a.where} is {a.shown} but {b.where} is {b.shown} "
                    f"(copied as they are from {config_dir}; generation stops at generation_config.json's ids "
                    "and, in servers, the tokenizer's: make them agree)"
                )
    return warnings


def tokenizer_eos(config_dir: str) -> tuple[str, int] | None:
    """(the tokenizer's eos token, its id) as its files give them, or None where they do not say."""
    tokenizer_config = _json(config_dir, "tokenizer_config.json")
    token = _content(tokenizer_config.get("eos_token"))
    if "added_tokens_decoder" not in tokenizer_config:  # legacy: special_tokens_map.json is read and wins
        token = _content(_json(config_dir, "special_tokens_map.json").get("eos_token")) or token
    if token is None:
        return None
    token_id = _listed_id(config_dir, token, tokenizer_config)
    return None if token_id is None else (token, token_id)


def _tokenizer_eos(config_dir: str) -> _Eos | None:
    found = tokenizer_eos(config_dir)
    if found is None:
        return None
    token, token_id = found
    return _Eos("the tokenizer's eos_token", frozenset({token_id}), f"{token!r} (id {token_id})")


def _listed_id(config_dir: str, token: str, tokenizer_config: dict) -> int | None:
    decoder = tokenizer_config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for key, record in decoder.items():
            if _content(record) == token and str(key).isdigit():
                return int(key)
    added = _json(config_dir, "added_tokens.json").get(token)
    if _is_id(added):
        return added
    full = _json(config_dir, "tokenizer.json")
    for record in full.get("added_tokens") or []:
        if isinstance(record, dict) and record.get("content") == token and _is_id(record.get("id")):
            return record["id"]
    vocab = full.get("model", {}).get("vocab") if isinstance(full.get("model"), dict) else None
    if isinstance(vocab, dict) and _is_id(vocab.get(token)):  # BPE, WordPiece, WordLevel: text -> id
        return vocab[token]
    if isinstance(vocab, list):  # Unigram: [text, score] in id order
        return next((i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry[:1] == [token]), None)
    return None


def _ids_entry(where: str, value) -> _Eos | None:
    if _is_id(value):
        return _Eos(f"{where}'s eos_token_id", frozenset({value}), str(value))
    if isinstance(value, list) and value and all(_is_id(v) for v in value):
        return _Eos(f"{where}'s eos_token_id", frozenset(value), str(value))
    return None  # absent or null: nothing said


def _content(token) -> str | None:
    if isinstance(token, dict):  # an AddedToken record
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json(config_dir: str, name: str) -> dict:
    """The file's JSON object; {} where it is absent or not a JSON object (it is copied as it is all the same)."""
    path = os.path.join(config_dir, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
