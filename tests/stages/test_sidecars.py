"""The files beside the weights: a vision-language model's processor and chat-template files copied
byte for byte with the tokenizer's, and a warning naming both values where config.json,
generation_config.json and the tokenizer files disagree on the end-of-sequence token.

The tokenizers are made and saved by transformers itself (tokenizers-backed Qwen2, BERT and
Unigram tokenizers from small vocabularies); the tokenizer's eos read from the files is checked
against the one transformers loads from them. The image and video processors need pillow and
torchvision, which the test environment does not install, so their files are written with the names
transformers' constants give (a Gemma 3 processor's save, made where pillow was, writes
processor_config.json, chat_template.jinja, additional_chat_templates/*.jinja and the tokenizer's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_bit_exact, copy_checkpoint, load_reference, read_merged

import fsdpfast
from fsdpfast import api
from fsdpfast.hf.eos import eos_disagreements, tokenizer_eos

_LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def _qwen2_tokenizer(folder: Path, eos: str = "<|im_end|>", chat_template=None) -> None:
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(_LETTERS)}, merges=[], eos_token=eos)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


def _bert_tokenizer(folder: Path) -> None:  # WordPiece: the eos is a vocabulary entry, not an added token
    from transformers import BertTokenizer

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_LETTERS])}
    BertTokenizer(vocab=vocab, eos_token="[SEP]").save_pretrained(folder)


def _unigram_tokenizer(folder: Path) -> None:  # the vocabulary a list of [piece, score] in id order
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("</s>", 0.0), *[(c, -1.0) for c in _LETTERS]]
    model = Tokenizer(models.Unigram(pieces, unk_id=0))
    PreTrainedTokenizerFast(tokenizer_object=model, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def _legacy_map(folder: Path, with_decoder: bool) -> None:
    """A transformers 4 save: special_tokens_map.json names another eos; it counts only where
    tokenizer_config.json has no added_tokens_decoder."""
    _qwen2_tokenizer(folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if with_decoder:
        record = {"content": "<|im_end|>", "special": True, "lstrip": False, "rstrip": False, "normalized": False}
        config["added_tokens_decoder"] = {"26": {**record, "single_word": False}}
    path.write_text(json.dumps(config))
    record = {"content": "q", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": record}))


_TOKENIZERS = {
    "bpe-added-token": _qwen2_tokenizer,
    "wordpiece-vocab": _bert_tokenizer,
    "unigram-vocab": _unigram_tokenizer,
    "legacy-special-tokens-map": lambda folder: _legacy_map(folder, with_decoder=False),
    "legacy-added-tokens-decoder": lambda folder: _legacy_map(folder, with_decoder=True),
}


@pytest.mark.parametrize("kind", list(_TOKENIZERS))
def test_the_tokenizer_eos_read_from_the_files_is_the_one_transformers_loads(tmp_path, kind):
    from transformers import AutoTokenizer

    _TOKENIZERS[kind](tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token_id is not None
    assert tokenizer_eos(str(tmp_path)) == (loaded.eos_token, loaded.eos_token_id)


def _config_folder(folder: Path, config_eos, generation_eos, eos_token: str | None = "<|im_end|>") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama"}
    if isinstance(config_eos, dict):
        config.update(config_eos)
    elif config_eos is not None:
        config["eos_token_id"] = config_eos
    (folder / "config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    if eos_token is not None:
        _qwen2_tokenizer(folder, eos_token)  # <|im_end|>: id 26, "z": 25
    return str(folder)


@pytest.mark.parametrize(
    "config_eos,generation_eos,eos_token",
    [
        (26, 26, "<|im_end|>"),
        (26, [26, 25], "<|im_end|>"),  # generation_config.json lists more ids, the others among them
        ([25, 26], [26, 25], "<|im_end|>"),
        ({"text_config": {"eos_token_id": 26}}, [26, 25], "<|im_end|>"),  # a vision-language model's config
        (None, 26, "<|im_end|>"),  # what a file does not say is not compared
        (26, None, None),
    ],
)
def test_agreeing_eos_ids_are_silent(tmp_path, config_eos, generation_eos, eos_token):
    assert eos_disagreements(_config_folder(tmp_path / "hf", config_eos, generation_eos, eos_token)) == []


@pytest.mark.parametrize(
    "config_eos,generation_eos,eos_token,pairs",
    [
        (26, 25, None, [("config.json's eos_token_id is 26", "generation_config.json's eos_token_id is 25")]),
        (
            25,
            25,
            "<|im_end|>",
            [
                ("config.json's eos_token_id is 25", "the tokenizer's eos_token is '<|im_end|>' (id 26)"),
                ("generation_config.json's eos_token_id is 25", "the tokenizer's eos_token is '<|im_end|>' (id 26)"),
            ],
        ),
        (
            {"text_config": {"eos_token_id": [24, 25]}},
            None,
            "<|im_end|>",
            [("config.json's eos_token_id is [24, 25]", "the tokenizer's eos_token is '<|im_end|>' (id 26)")],
        ),
        ([26, 24], [26, 25], "<|im_end|>", [("config.json's eos_token_id is [26, 24]", "is [26, 25]")]),
    ],
)
def test_disagreeing_eos_ids_are_warned_naming_both(tmp_path, config_eos, generation_eos, eos_token, pairs):
    folder = _config_folder(tmp_path / "hf", config_eos, generation_eos, eos_token)
    warnings = eos_disagreements(folder)
    assert len(warnings) == len(pairs), warnings
    for warning, (first, second) in zip(warnings, pairs):
        assert first in warning and second in warning and folder in warning, warning


def _vlm_sidecars(folder: Path) -> list[str]:
    """What a vision-language model's save_pretrained leaves beside config.json, by transformers' names;
    the relative paths written."""
    from transformers.utils import (
        CHAT_TEMPLATE_DIR,
        CHAT_TEMPLATE_FILE,
        IMAGE_PROCESSOR_NAME,
        LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
        PROCESSOR_NAME,
        VIDEO_PROCESSOR_NAME,
    )

    before = _files(folder)
    # eos "c", id 2: the corpus config's eos_token_id
    _qwen2_tokenizer(folder, "c", chat_template={"default": "{{ messages }}", "tool_use": "{{ tools }}"})
    _qwen2_tokenizer(folder / "qformer_tokenizer")  # a processor's second tokenizer, in its attribute's folder
    image = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2}
    (folder / PROCESSOR_NAME).write_text(
        json.dumps({"image_processor": image, "processor_class": "Qwen2_5_VLProcessor"})
    )
    (folder / IMAGE_PROCESSOR_NAME).write_text(json.dumps(image, indent=2) + "\n")
    (folder / VIDEO_PROCESSOR_NAME).write_text(json.dumps({"video_processor_type": "Qwen2VLVideoProcessor"}))
    (folder / LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE).write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (folder / CHAT_TEMPLATE_FILE).write_bytes("{{ messages }}\r\n\u00e9".encode())  # bytes kept as they are
    assert (folder / CHAT_TEMPLATE_DIR / "tool_use.jinja").is_file()
    return sorted(_files(folder) - before)


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_vision_language_models_processor_and_chat_template_files_are_copied_byte_for_byte(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w2-llama")
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    hf = folder / "huggingface"
    sidecars = _vlm_sidecars(hf)
    assert {"processor_config.json", "chat_template.jinja", "additional_chat_templates/tool_use.jinja"} <= set(sidecars)
    (hf / "optimizer").mkdir()  # any other sub-folder, and weights, stay behind
    (hf / "optimizer" / "tokenizer_config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"not copied")
    report = fsdpfast.merge(folder, tmp_path / "merged")
    out = tmp_path / "merged"
    for name in _files(hf) - {"model.safetensors", "optimizer/tokenizer_config.json"}:
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
        assert name in report.copied, name
    assert (
        not (out / "optimizer").exists()
        and read_merged(out).keys() == load_reference(spec.reference_path(checkpoints.root))[0].keys()
    )
    assert report.warnings == []
    assert fsdpfast.verify(out).ok
    manifest = json.loads((out / "fsdpfast-manifest.json").read_text())
    assert "additional_chat_templates/tool_use.jinja" in manifest["written"]


def _merge_cli(*args):
    return subprocess.run([sys.executable, "-m", "fsdpfast", "merge", *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow
def test_a_merge_warns_when_generation_config_and_tokenizer_disagree_on_eos(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w2-llama")
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    hf = folder / "huggingface"
    _qwen2_tokenizer(hf, "<|im_end|>")  # id 26; generation_config.json says 2, and so does config.json
    config = json.loads((hf / "config.json").read_text())
    assert config["eos_token_id"] == 2 and json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 2
    result = _merge_cli(folder, "--out", tmp_path / "merged", "--json")
    assert result.returncode == 0, result.stderr  # the folder is the model: the files are copied as they are
    warnings = json.loads(result.stdout)["warnings"]
    assert len(warnings) == 2, warnings
    assert all("the tokenizer's eos_token is '<|im_end|>' (id 26)" in w for w in warnings)
    assert "config.json's eos_token_id is 2" in warnings[0]
    assert "generation_config.json's eos_token_id is 2" in warnings[1]
    assert result.stderr.count("fsdpfast: warning: the end-of-sequence token disagrees") == 2
    assert (tmp_path / "merged" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert_bit_exact(read_merged(tmp_path / "merged"), load_reference(spec.reference_path(checkpoints.root))[0])
    assert len(api.dry_run(folder, tmp_path / "other")["warnings"]) == 2  # said before anything is written


@pytest.mark.slow
def test_agreeing_eos_files_merge_with_no_warning(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    hf = folder / "huggingface"
    _qwen2_tokenizer(hf, "c")  # id 2: config.json's and generation_config.json's eos
    assert tokenizer_eos(str(hf)) == ("c", 2)
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert report.warnings == [] and "tokenizer.json" in report.copied
