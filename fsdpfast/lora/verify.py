"""`verify` of a merge that wrote PEFT adapter folders (OUT/lora_adapter, OUT/lora_adapter/<name>).

Each adapter folder has a manifest of its own (lora.output); OUT's manifest lists them. Every
check `verify OUT` makes of OUT it makes of each adapter folder too: against its manifest, the
checkpoint (`--against`: the adapter's tensors recomputed from the shards), or the same folder
of a reference (`--reference REF`: REF/lora_adapter, e.g. verl's merger output). Mismatches
are named `lora_adapter/<tensor>`. `--smoke` loads each adapter onto the merged base model with
peft (when installed): every tensor of the file must be loaded and the forward pass finite.
ADAPTER_FOLDERS is the plan transform's FolderChecks (plan.transform), which verify finds through
the pipeline's registry; verify hands in what it needs of verify (itself, its smoke test's base
model loader), so verify imports nothing of lora.
"""

from __future__ import annotations

import json
import os

from ..errors import BadInput
from .split import find_adapter

CONFIG_FILE = "adapter_config.json"


class AdapterFolderChecks:
    """The PEFT adapter folders of a merge, as verify checks them (plan.transform.FolderChecks)."""

    what = "peft adapters"
    recorded = ("peft_adapter",)  # each adapter folder's manifest names its adapter (lora.plan)

    def verified(self, plan, recorded: dict):
        adapter = recorded.get("peft_adapter")
        return None if adapter is None else find_adapter(plan, adapter).plan

    def listed(self, manifest: dict | None) -> list:
        return adapter_folders(manifest)

    def model_less(self, out_dir: str) -> bool:
        return adapters_only(out_dir)

    def is_own_folder(self, folder: str) -> bool:
        return is_adapter_folder(folder)

    def check(self, report, out_dir: str, folders: list, *, verify_folder, **checks) -> None:
        check_adapters(report, out_dir, folders, verify_folder=verify_folder, **checks)

    def smoke(self, base_dir: str, folders: list, notes: list[str], load_base) -> list[str]:
        return smoke_adapters(base_dir, folders, notes, load_base)

    def smoke_folder(self, folder: str, notes: list[str], load_base) -> list[str]:
        return smoke_adapter_folder(folder, notes, load_base)


ADAPTER_FOLDERS = AdapterFolderChecks()


def adapter_folders(manifest: dict | None) -> list:
    """What the manifest lists (each entry checked by check_adapters)."""
    folders = (manifest or {}).get("adapters") or []
    return folders if isinstance(folders, list) else [folders]


def adapters_only(out_dir: str) -> bool:
    """A LoRA-only checkpoint's output: the adapter folders and a manifest, no model files."""
    from ..manifest import MANIFEST_NAME

    path = os.path.join(out_dir, MANIFEST_NAME)
    if not os.path.isfile(path) or any(name.endswith(".safetensors") for name in os.listdir(out_dir)):
        return False
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False  # verify reports the damaged manifest
    return isinstance(manifest, dict) and manifest.get("tensors") == {} and bool(manifest.get("adapters"))


def is_adapter_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, CONFIG_FILE)) and not os.path.isfile(os.path.join(folder, "config.json"))


def check_adapters(
    report, out_dir: str, folders: list[str], *, verify_folder, against, reference, rtol, atol, layout, options
) -> None:
    """Verify each adapter folder with `verify_folder` (verify itself, given by it), adding the findings to `report`."""
    for folder in folders:
        if not (isinstance(folder, str) and _plain(folder)):
            report.mismatch(
                "(manifest)",
                f"adapters lists {str(folder)[:80]!r}, not a folder inside the output; the manifest is damaged",
            )
            continue
        path = os.path.join(out_dir, folder)
        theirs = os.path.join(reference, folder) if reference is not None else None
        if theirs is not None and not os.path.isdir(theirs):
            report.notes.append(f"{reference} has no {folder}: that adapter was checked against its manifest only")
            theirs = None
        try:
            sub = verify_folder(
                path,
                against=against,
                reference=theirs,
                rtol=rtol if theirs else None,
                atol=atol if theirs else None,
                layout=layout,
                **options,
            )
        except BadInput as exc:
            report.mismatch(folder, str(exc))
            continue
        report.include(folder, sub)


def smoke_adapters(base_dir: str, folders: list[str], notes: list[str], load_base) -> list[str]:
    """Problems found loading each adapter folder onto the model in `base_dir` with peft.

    load_base(folder) -> (model, input ids): the base model as verify's smoke test loads it.
    """
    try:
        import peft  # noqa: F401
    except ImportError:
        notes.append(
            f"peft is not installed: --smoke did not load the adapters ({', '.join(folders)}); pip install peft"
        )
        return []
    problems = []
    for folder in (f for f in folders if isinstance(f, str) and _plain(f)):
        problems += [f"{folder}: {p}" for p in smoke_adapter(base_dir, os.path.join(base_dir, folder), load_base)]
    return problems


def smoke_adapter_folder(folder: str, notes: list[str], load_base) -> list[str]:
    """--smoke of an adapter folder given alone: the base model is its base_model_name_or_path, a local folder."""
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not isinstance(base, str) or not os.path.isfile(os.path.join(base, "config.json")):
        raise BadInput(
            f"{folder}: --smoke of an adapter folder loads its base model from base_model_name_or_path, "
            f"which is {base!r}, not a local model folder; verify the folder above it instead"
        )
    try:
        import peft  # noqa: F401
    except ImportError:
        raise BadInput(f"{folder}: --smoke of an adapter folder needs peft; pip install peft") from None
    return smoke_adapter(base, folder, load_base)


def smoke_adapter(base_dir: str, folder: str, load_base) -> list[str]:
    import peft
    import torch
    from safetensors.torch import load_file

    model, ids = load_base(base_dir)
    try:
        model = peft.PeftModel.from_pretrained(model, folder, autocast_adapter_dtype=False)
    except Exception as exc:  # peft's own refusal (a config it cannot read, shapes that do not fit) is the finding
        return [f"peft cannot load it ({type(exc).__name__}: {str(exc)[:300]})"]
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    loaded = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
    problems = [f"{name}: in the file but not loaded by peft" for name in sorted(set(saved) - set(loaded))]
    problems += [f"{name}: the model has it but the file does not" for name in sorted(set(loaded) - set(saved))]
    problems += [
        f"{name}: loaded values differ from the file's"
        for name in sorted(set(saved) & set(loaded))
        if not torch.equal(saved[name].to(loaded[name].dtype), loaded[name])
    ]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        problems.append(f"output logits: {int((~torch.isfinite(logits)).sum())} values are not finite")
    return problems


def _plain(folder: str) -> bool:
    parts = folder.split("/")
    return bool(folder) and not os.path.isabs(folder) and all(p not in ("", ".", "..") for p in parts)
