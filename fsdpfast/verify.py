"""Check a merged folder: against its manifest, against the shards it came from, against a reference.

- manifest (default): every tensor's place and CRC-32C as recorded while it was written; fast,
  needs no sources.
- against a checkpoint: every tensor recomputed from the shards chunk by chunk (the merge's own
  plan and kernels, nothing held whole) and compared byte for byte.
- against a reference folder: tensor by tensor, exact, or within rtol/atol in float64.
Each mismatch names the tensor and, where known, the first differing element and byte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from . import _ops
from .dtypes import CASTABLE, itemsize, target_dtype
from .errors import BadInput, ModelMismatch, on_command_line, option
from .execute.compare import SLICE_BYTES, CompareSink, first_difference
from .execute.runner import run
from .io.sources import SourceFiles
from .io.stored import DamagedFile, MappedFiles, StoredTensor, read_folder
from .lora import verify as lora_verify
from .manifest import CHECKSUM, MANIFEST_NAME, DamagedManifest, changed_sources, load_manifest, read_manifest
from .plan.layout import PlacedTensor
from .wording import count, size

MAX_LISTED = 20  # mismatches printed one per line; the JSON report holds them all


@dataclass
class Mismatch:
    tensor: str
    what: str
    byte: int | None = None  # first differing byte within the tensor's data
    element: int | None = None  # first differing element (row-major)

    def line(self) -> str:
        where = f" (first difference at element {self.element}, byte {self.byte})" if self.byte is not None else ""
        return f"{self.tensor}: {self.what}{where}"


@dataclass
class VerifyReport:
    """What `verify` checked (`checks`), how many tensors and bytes, and every mismatch found;
    `ok` is True when there is none. `summary()` is the command line's text."""

    out_dir: str
    checks: list[str] = field(default_factory=list)  # manifest, against CKPT, reference DIR, smoke
    tensors: int = 0
    bytes_checked: int = 0  # output bytes some check read, each counted once however many checks read it
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._checked: set[str] = set()  # not a field: the JSON report holds the count

    def count_checked(self, tensor: StoredTensor) -> None:
        if tensor.name not in self._checked:
            self._checked.add(tensor.name)
            self.bytes_checked += tensor.nbytes

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        lines = [f"mismatch: {m.line()}" for m in self.mismatches[:MAX_LISTED]]
        if len(self.mismatches) > MAX_LISTED:
            lines.append(
                f"... and {count(len(self.mismatches) - MAX_LISTED, 'more mismatch', 'more mismatches')} "
                f"({'--json lists' if on_command_line() else 'the report lists'} them all)"
            )
        lines += [f"note: {note}" for note in self.notes]
        verdict = "OK" if self.ok else f"FAILED, {count(len(self.mismatches), 'mismatch', 'mismatches')}"
        lines.append(
            f"verify {self.out_dir}: {verdict}: {count(self.tensors, 'tensor')}, {size(self.bytes_checked)} "
            f"checked ({'; '.join(self.checks)})"
        )
        return "\n".join(lines)


def verify(
    out_dir: str,
    *,
    against: str | None = None,
    reference: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    smoke: bool = False,
    layout: str | None = None,
    manifest_of: str | None = None,
    **options,
) -> VerifyReport:
    """Check the merged folder `out_dir`; a VerifyReport (`.ok`, `.mismatches`, `.summary()`).

    With no other argument, every tensor's place and CRC-32C against the folder's own manifest.
    against: the checkpoint folder: every tensor recomputed from the shards, compared byte for byte.
    reference: another safetensors folder, compared tensor by tensor: exactly, or within `rtol` /
        `atol` (in float64) when either is given.
    manifest_of: another merge's manifest (its file or folder), e.g. an earlier merge of the same
        checkpoint: every tensor's dtype, shape and checksum must match it.
    smoke: load the folder with transformers and run one forward pass.
    layout, options: for `against`, as in `plan_merge`; by default what the merge recorded.

    Mismatches are reported, not raised; BadInput (a ValueError) means the check itself could not
    run as asked.
    """
    out_dir = os.fspath(out_dir)
    # A damaged output (its headers or its own manifest) is a failed check, not a usage error.
    try:
        stored = {} if lora_verify.adapters_only(out_dir) else read_folder(out_dir)
    except DamagedFile as exc:
        return VerifyReport(out_dir, checks=["headers"], mismatches=[Mismatch("(file)", str(exc))])
    report = VerifyReport(out_dir, tensors=len(stored))
    try:
        manifest = read_manifest(out_dir)
    except DamagedManifest as exc:
        report.checks.append("manifest")
        report.mismatches.append(
            Mismatch("(manifest)", f"{exc}; check the output with {option('against', meta='CKPT_DIR')}")
        )
        manifest = None
    if (rtol is not None or atol is not None) and reference is None:
        raise BadInput(f"{option('rtol')} and {option('atol')} apply to {option('reference', meta='HF_DIR')}")
    other = _other_manifest(os.fspath(manifest_of)) if manifest_of is not None else None  # bad input: refused first
    if against is None and reference is None and manifest is None and manifest_of is None and not smoke:
        if report.mismatches:  # the damaged manifest was all there was to check against
            return report
        raise BadInput(
            f"{out_dir}: no fsdpfast-manifest.json (not merged by fsdpfast, or by an older one); "
            f"check it with {option('against', meta='CKPT_DIR')} or {option('reference', meta='HF_DIR')}"
        )
    with MappedFiles(stored) as files:
        if manifest is not None:
            _note_source_changes(report, manifest, against)
        if against is not None:
            _check_against(report, stored, files, os.fspath(against), manifest, layout, options)
        elif manifest is not None and reference is None:
            _check_manifest(report, stored, files, manifest)
        if manifest_of is not None:
            _check_other_manifest(report, stored, files, os.fspath(manifest_of), other, manifest)
        if reference is not None:
            _check_reference(report, stored, files, os.fspath(reference), rtol, atol)
    folders = lora_verify.adapter_folders(manifest)  # PEFT adapter folders written beside the model
    lora_verify.check_adapters(
        report,
        out_dir,
        folders,
        against=against,
        reference=reference,
        rtol=rtol,
        atol=atol,
        layout=layout,
        options=options,
    )
    if smoke:
        from .smoke import smoke_test

        report.checks.append("smoke: transformers forward pass" + (" with peft adapters" if folders else ""))
        if lora_verify.is_adapter_folder(out_dir):
            problems = lora_verify.smoke_adapter_folder(out_dir, report.notes)
        else:
            problems = smoke_test(out_dir) + lora_verify.smoke_adapters(out_dir, folders, report.notes)
        report.mismatches += [Mismatch("(smoke)", problem) for problem in problems]
    return report


def _note_source_changes(report: VerifyReport, manifest: dict, against: str | None) -> None:
    root = against or manifest.get("checkpoint")
    if not root or not os.path.isdir(root):
        report.notes.append(f"the merge's sources ({manifest.get('checkpoint')}) are not there to compare with")
        return
    changes = changed_sources(root, manifest.get("sources", []))
    if changes:
        report.notes.append(f"source files changed since the merge ({len(changes)}): {'; '.join(changes[:5])}")


# --- against the manifest ---------------------------------------------------------------------


def _other_manifest(path: str) -> dict:
    """Another merge's manifest (the file or its folder); a damaged one is bad input, not a failed check."""
    file = os.path.join(path, MANIFEST_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise BadInput(f"{file}: no such file; give the {MANIFEST_NAME} of an earlier merge, or its folder")
    return load_manifest(file)


def _check_other_manifest(
    report: VerifyReport, stored: dict[str, StoredTensor], files: MappedFiles, path: str, other: dict, own: dict | None
) -> None:
    if own is not None and _identity(own) != _identity(other):
        report.notes.append(
            f"the two merges read different source files (or the files changed between them); see {path}"
        )
    _check_manifest(report, stored, files, other, where=path)


def _identity(manifest: dict) -> list:
    return [(s["path"], s["size"], s["mtime_ns"]) for s in manifest.get("sources", [])]


def _check_manifest(
    report: VerifyReport, stored: dict[str, StoredTensor], files: MappedFiles, manifest: dict, where: str | None = None
) -> None:
    """Against the folder's own manifest (where=None: places must match too) or another merge's (checksums only)."""
    report.checks.append(f"manifest {where}" if where else "manifest")
    recorded = manifest.get("tensors", {})
    _compare_names(report, set(recorded), set(stored), "in the manifest", "the manifest")
    for name in sorted(set(recorded) & set(stored)):
        want, have = recorded[name], stored[name]
        place = (want["file"], want["offset"], want["nbytes"], want["dtype"], tuple(want["shape"]))
        if where is not None:  # another merge may have split the files differently
            place = (have.file, have.byte_offset) + place[2:]
        if place != (have.file, have.byte_offset, have.nbytes, have.dtype, have.shape):
            report.mismatches.append(
                Mismatch(
                    name,
                    f"stored as {have.file} byte {have.byte_offset}, {have.dtype} "
                    f"{list(have.shape)}; the manifest says {want['file']} byte {want['offset']}, "
                    f"{want['dtype']} {want['shape']}",
                )
            )
            continue
        if manifest.get("checksum") != CHECKSUM or want.get(CHECKSUM) is None:
            continue
        view = files.tensor(have.name)
        crc = _crc(view)
        view.release()
        files.done(name)
        report.count_checked(have)
        if crc != int(want[CHECKSUM], 16):
            report.mismatches.append(
                Mismatch(
                    name,
                    f"{CHECKSUM} {crc:08x}, the manifest recorded {want[CHECKSUM]} "
                    + ("(the file changed after the merge)" if where is None else f"in {where}"),
                )
            )
    if manifest.get("checksum") != CHECKSUM:
        report.notes.append(
            "the manifest has no checksums (merged without the native extension); "
            f"only names, places, dtypes and shapes were checked; use {option('against', meta='CKPT_DIR')}"
        )


def _crc(view: memoryview) -> int:
    crc = 0
    for start in range(0, len(view), SLICE_BYTES):
        crc = _ops.crc32c(view[start : start + SLICE_BYTES], crc)
        if crc is None:
            raise BadInput(
                f"checking checksums needs fsdpfast's native extension (not built); use {option('against', meta='CKPT_DIR')}"
            )
    return crc


# --- against the checkpoint -------------------------------------------------------------------


def _check_against(
    report: VerifyReport,
    stored: dict[str, StoredTensor],
    files: MappedFiles,
    checkpoint: str,
    manifest: dict | None,
    layout: str | None,
    options: dict,
) -> None:
    from .api import plan_merge

    report.checks.append(f"recomputed from {checkpoint}")
    manifest = manifest or {}
    has_config = os.path.isfile(os.path.join(report.out_dir, "config.json"))
    layout = layout or manifest.get("layout")
    recorded = dict((manifest.get("layout_options") or {}) if layout == manifest.get("layout") else {})
    adapter = recorded.pop("peft_adapter", None)  # this folder is one PEFT adapter of the checkpoint (lora.output)
    # The merge's own checks run again (names and shapes against the model, ranks and steps), and every
    # byte of the copies the checkpoint holds twice is compared, where the merge compared a sample.
    try:
        plan = plan_merge(
            checkpoint,
            dtype="keep",
            layout=layout,
            config=report.out_dir if has_config else None,
            full_copy_check=True,
            **{**recorded, **{name: value for name, value in options.items() if value is not None}},
        )
    except ModelMismatch as exc:  # the output's config.json and the checkpoint's tensors disagree
        report.mismatches.append(Mismatch("(model)", str(exc)))
        return
    if adapter is not None:
        from .lora.split import find_adapter

        plan = find_adapter(plan, adapter).plan
    _compare_names(report, {t.name for t in plan.tensors}, set(stored), "in the checkpoint", "the checkpoint")
    wanted_dtype = manifest.get("dtype")
    jobs = []
    for tensor in plan.tensors:
        have = stored.get(tensor.name)
        if have is None:
            continue
        # The merge's --dtype: from the manifest, else read off the output (a cast one is floating).
        wanted = wanted_dtype if manifest else (have.dtype if have.dtype in CASTABLE else None)
        tensor = replace(tensor, target_dtype=target_dtype(tensor.source_dtype, wanted))
        if (have.dtype, have.shape) != (tensor.target_dtype, tensor.shape):
            report.mismatches.append(
                Mismatch(
                    tensor.name,
                    f"stored as {have.dtype} {list(have.shape)}, the checkpoint "
                    f"gives {tensor.target_dtype} {list(tensor.shape)}",
                )
            )
            continue
        jobs.append((tensor, have))
    recorded = manifest.get("tensors", {}) if manifest.get("checksum") == CHECKSUM else {}
    sink = CompareSink(files, _fused_device(manifest, plan))
    pieces = [PlacedTensor(tensor, have.byte_offset, have.nbytes) for tensor, have in jobs]
    with SourceFiles(plan.sources) as sources:
        crcs = run(pieces, sources, sink)
    for (tensor, have), crc in zip(jobs, crcs):
        report.count_checked(have)
        first = sink.first[tensor.name]
        if first >= 0:
            report.mismatches.append(
                Mismatch(tensor.name, "bytes differ from the checkpoint's", first, first // itemsize(have.dtype))
            )
        elif crc is not None and tensor.name in recorded and int(recorded[tensor.name][CHECKSUM], 16) != crc:
            report.mismatches.append(Mismatch(tensor.name, "matches the checkpoint but not the manifest's checksum"))


def _fused_device(manifest: dict, plan) -> str:
    """--merge-lora outputs: fused weights are recomputed on the kind of device the merge computed them on."""
    from .lora.fuse import device_for

    device = device_for(manifest.get("engine", "cpu"))
    if device == "cuda" and any(t.compute is not None for t in plan.tensors) and not _ops.native_cuda():
        raise BadInput(
            "the LoRA weights of this output were fused on a GPU (engine cuda); recomputing them needs one: "
            "verify --against on a machine with a GPU, or check the output against its manifest"
        )
    return device


# --- against a reference folder ---------------------------------------------------------------


def _check_reference(
    report: VerifyReport,
    stored: dict[str, StoredTensor],
    files: MappedFiles,
    reference: str,
    rtol: float | None,
    atol: float | None,
) -> None:
    tolerant = rtol is not None or atol is not None
    report.checks.append(
        f"reference {reference}" + (f" (rtol {rtol or 0}, atol {atol or 0})" if tolerant else " (exact)")
    )
    theirs = read_folder(reference)
    _compare_names(report, set(theirs), set(stored), "in the reference", "the reference")
    with MappedFiles(theirs) as reference_files:
        for name in sorted(set(theirs) & set(stored)):
            have, want = stored[name], theirs[name]
            if have.shape != want.shape or (not tolerant and have.dtype != want.dtype):
                report.mismatches.append(
                    Mismatch(
                        name, f"{have.dtype} {list(have.shape)}, the reference has {want.dtype} {list(want.shape)}"
                    )
                )
                continue
            ours, expected = files.tensor(have.name), reference_files.tensor(want.name)
            report.count_checked(have)
            if tolerant:
                found = _first_not_close(ours, have.dtype, expected, want.dtype, rtol or 0.0, atol or 0.0)
                if found is not None:
                    element, detail = found
                    report.mismatches.append(
                        Mismatch(name, f"not within tolerance ({detail})", element * itemsize(have.dtype), element)
                    )
            else:
                first = first_difference(ours, expected)
                if first >= 0:
                    report.mismatches.append(
                        Mismatch(name, "bytes differ from the reference", first, first // itemsize(have.dtype))
                    )
            ours.release()
            expected.release()
            files.done(name)
            reference_files.done(name)


def _first_not_close(
    ours: memoryview, our_dtype: str, theirs: memoryview, their_dtype: str, rtol: float, atol: float
) -> tuple[int, str] | None:
    """First element where |ours - theirs| > atol + rtol * |theirs| (in float64; NaN equals NaN)."""
    import torch

    from .dtypes import torch_dtype

    count = len(ours) // itemsize(our_dtype)
    step = max(1, SLICE_BYTES // 8)
    for start in range(0, count, step):
        end = min(count, start + step)
        a = _as_float64(torch, ours, torch_dtype(our_dtype), start, end)
        b = _as_float64(torch, theirs, torch_dtype(their_dtype), start, end)
        close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(close.all()):
            i = int((~close).nonzero()[0, 0])
            return (
                start + i,
                f"{float(a[i])!r} vs {float(b[i])!r}, max |difference| {float((a - b).abs().nan_to_num(0).max()):.3g} in this slice",
            )
    return None


def _as_float64(torch, view: memoryview, dtype, start: int, end: int):
    size = torch.empty(0, dtype=dtype).element_size()
    piece = bytearray(view[start * size : end * size])  # a private copy: frombuffer wants writable memory
    return torch.frombuffer(piece, dtype=dtype).to(torch.float64) if piece else torch.empty(0, dtype=torch.float64)


def _compare_names(report: VerifyReport, expected: set[str], present: set[str], where: str, source: str) -> None:
    for name in sorted(expected - present):
        report.mismatches.append(Mismatch(name, f"{where} but not in the output"))
    for name in sorted(present - expected):
        report.mismatches.append(Mismatch(name, f"in the output but not in {source}"))
