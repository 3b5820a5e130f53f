"""Fuzz every metadata parser the readers use: only fsdpfast's own errors may come out.

    python tests/support/fuzz_parsers.py --minutes 10          # the long run (docs/guarantees.md: the fuzz record)
    python -m pytest -q tests/trust/test_fuzz.py             # the short run, part of the suite and CI

Targets, each fed by hypothesis from real files (mutated: bits flipped, bytes set, inserted,
deleted, cut, spliced between files, little-endian integers replaced by edge values) or built
from scratch:
  unpickle         readers.safe_load.safe_unpickle on data.pkl and .metadata pickles
  pickle_opcodes   safe_unpickle on opcode streams made of the globals and opcodes checkpoints use
  unpicklers_agree the C unpickler (plain pickles) against the Python one, on mutated real pickles
                   and on opcode streams (unpicklers_agree_opcodes): the same value, or both refuse
  twins            a rank file's pickle mutated, read as changes of rank 0's (pickle_twins) and unpickled
                   in full: the same value, or the same error
  torch_zip        readers.torch_zip.TorchZip on whole rank files (zip directory, local headers)
  dcp_metadata     a real DCP folder whose .metadata is fuzzed, planned end to end
  safetensors      a real DCP folder (safetensors .distcp) with one .distcp fuzzed, planned end to end
  merge            a real FSDP2 folder with one rank file fuzzed, merged end to end (cpu engine)
  verify           a real merged folder whose model.safetensors (header and data) is fuzzed, verified
                   against its manifest
  verify_header    the same with only the safetensors header fuzzed (its bytes, or values in its JSON
                   replaced), verified against its manifest and used as another folder's --reference
                   (_parsing/safetensors_header.py, the header reader every safetensors input uses)
  verify_manifest  a real merged folder whose fsdpfast-manifest.json is fuzzed (bytes or JSON values),
                   verified against it and given to another folder as --manifest
  deepspeed_optim  a real DeepSpeed ZeRO-2 tag folder whose rank 0 optimizer file's pickle is fuzzed, planned
                   (needs deepspeed to write the seed; the run skips the target without it)
  fsdp1_rank       a real FSDP1 LOCAL_STATE_DICT folder whose rank 0 file's pickle is fuzzed, planned (the
                   model rebuilt from config.json with transformers)
  dcp_hf_header    a real HuggingFaceStorageWriter folder whose first shard file's JSON header is fuzzed
                   (the data kept), planned against its config.json

A finding is any exception that is not an fsdpfast.errors.FsdpfastError, an example that runs
past HANG_SECONDS, or a merge that fails yet leaves its output folder behind. A crash (a signal)
ends the run, which is a finding too.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fsdpfast
from fsdpfast._parsing.safe_load import DTensorRef, StorageRef, TensorRef, each_object, safe_unpickle
from fsdpfast._parsing.torch_zip import TorchZip
from fsdpfast.errors import FsdpfastError
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.readers import dcp

HANG_SECONDS = 20
# The checkpoints the seeds come from (corpus.py names; all but one written by 2 ranks).
SEED_CHECKPOINTS = ["w2-llama", "w2-guide", "w2-dcp", "w3-dcp-safetensors"]
# The readers' own targets: target -> (seed checkpoint, the file in it that is fuzzed).
DEEPSPEED_SEED = "ds-w2-z2-bf16-frozen-tags"  # tests/support/deepspeed_checkpoints.py; its tag folder is the seed
FSDP1_SEED = "w2-tied-orig"  # tests/readers/test_fsdp1_flat.py: use_orig_params views, tied weights, alignment padding
READER_TARGETS = {
    "deepspeed_optim": (DEEPSPEED_SEED, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    "fsdp1_rank": (FSDP1_SEED, "pytorch_model_fsdp_rank0.bin"),
    "dcp_hf_header": ("w2-dcp-hf", "shard-00001-model-00001-of-00001.safetensors"),
}


class Hang(Exception):
    pass


class Blob(bytes):
    """An input whose repr in hypothesis' report is its size and hash, not 400 kB of bytes."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes, sha256 {hashlib.sha256(self).hexdigest()[:16]}>"


@dataclass
class Seeds:
    """Real files to mutate, and real folders whose one file a target replaces."""

    pickles: list[bytes] = field(default_factory=list)  # data.pkl of rank files, .metadata of DCP folders
    rank_files: list[bytes] = field(default_factory=list)  # whole torch.save archives
    folders: dict[str, Path] = field(default_factory=dict)  # checkpoint name -> folder
    merged: Path | None = None  # a folder fsdpfast merged from the first checkpoint

    @classmethod
    def from_folders(cls, folders: dict[str, str]) -> Seeds:
        seeds = cls(folders={name: Path(folder) for name, folder in folders.items()})
        for folder in seeds.folders.values():
            for path in sorted(folder.iterdir()):
                if path.suffix == ".pt":
                    seeds.rank_files.append(path.read_bytes())
                    with zipfile.ZipFile(path) as archive:
                        (name,) = [n for n in archive.namelist() if n.endswith("data.pkl")]
                        seeds.pickles.append(archive.read(name))
                elif path.name == ".metadata":
                    seeds.pickles.append(path.read_bytes())
        first = next(iter(seeds.folders.values()))
        seeds.merged = first.parent / f"{first.name}-merged-for-fuzzing"
        if not seeds.merged.exists():
            fsdpfast.merge(first, seeds.merged)
        return seeds

    def add_reader_seed(self, target: str, folder: str) -> None:
        """The checkpoint folder a reader target fuzzes one file of (READER_TARGETS); its files are never changed."""
        self.folders[READER_TARGETS[target][0]] = Path(folder)

    def fuzzed_part(self, target: str) -> bytes:
        """The part of the target's file that is mutated: a pickle, or a safetensors header."""
        name, entry = READER_TARGETS[target]
        data = (self.folders[name] / entry).read_bytes()
        if target == "dcp_hf_header":
            return data[8 : 8 + int.from_bytes(data[:8], "little")]
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            (pickle,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            return archive.read(pickle)


def with_pickle(archive: bytes, pickle: bytes) -> bytes:
    """A torch.save archive with its data.pkl replaced, every other record kept in order."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as original, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in original.infolist():
            rewritten.writestr(info.filename, pickle if info.filename.endswith("/data.pkl") else original.read(info))
    return out.getvalue()


def with_header(shard: bytes, header: bytes) -> bytes:
    """A safetensors file with its JSON header replaced, its data section kept."""
    return len(header).to_bytes(8, "little") + header + shard[8 + int.from_bytes(shard[:8], "little") :]


# --- mutations --------------------------------------------------------------------------------

EDGE_INTS = [0, 1, 2, 7, 8, 64, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]


@st.composite
def mutated(draw, originals: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(originals)))
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "cut", "splice", "int"]))
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "cut":
            del data[at:]
        elif kind == "splice":
            other = draw(st.sampled_from(originals))
            start = draw(st.integers(0, max(0, len(other) - 1)))
            data[at : at + draw(st.integers(0, 64))] = other[start : start + draw(st.integers(1, 64))]
        else:  # a length, offset or count field replaced by an edge value
            width = draw(st.sampled_from([1, 2, 4, 8]))
            value = draw(st.sampled_from(EDGE_INTS)) % (1 << (8 * width))
            data[at : at + width] = value.to_bytes(width, "little")
    return Blob(data)


# Values a JSON field (of a safetensors header, of a manifest) is replaced with.
JSON_EDGES = [
    None,
    True,
    -1,
    0,
    1.5,
    2**64,
    "",
    "0",
    "F32",
    "0000000g",
    [],
    [0],
    ["0", 8],
    [8, 0],
    [2**63, 2**64],
    {},
    {"dtype": "F32"},
    [[1]],
]


@st.composite
def json_mutated(draw, original) -> object:
    """A copy of a parsed JSON value with 1-3 nodes replaced by edge values, deleted, or their ints changed."""
    value = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        parent, key, node = None, None, value
        while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)):  # walk down a random path
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            parent, node = node, node[key]
        if parent is None:
            value = copy.deepcopy(draw(st.sampled_from(JSON_EDGES)))
            continue
        kind = draw(st.sampled_from(["edge", "delete", "int"]))
        if kind == "delete" and isinstance(parent, dict):
            del parent[key]
        elif kind == "int" and isinstance(node, int):
            parent[key] = draw(st.sampled_from([*EDGE_INTS, node - 1, node + 1, -node]))
        else:
            parent[key] = copy.deepcopy(draw(st.sampled_from(JSON_EDGES)))
    return value


def _json_blob(value) -> bytes:
    return Blob(json.dumps(value).encode())


def _header_and_data(path: Path) -> tuple[bytes, bytes]:
    data = path.read_bytes()
    end = 8 + int.from_bytes(data[:8], "little")
    return data[:end], data[end:]


def mutated_header(path: Path) -> st.SearchStrategy:
    """The safetensors file with its header (length and JSON) mutated and its data as it was."""
    header, data = _header_and_data(path)
    parsed = json.loads(header[8:])

    def with_json(value) -> bytes:
        raw = json.dumps(value).encode()
        return Blob(len(raw).to_bytes(8, "little") + raw + data)

    return st.one_of(mutated([header]).map(lambda h: Blob(h + data)), json_mutated(parsed).map(with_json))


def mutated_json(path: Path) -> st.SearchStrategy:
    return st.one_of(mutated([path.read_bytes()]), json_mutated(json.loads(path.read_bytes())).map(_json_blob))


# Opcode snippets a checkpoint pickle is made of, and the globals the unpickler allows or refuses.
_GLOBALS = [
    "torch._utils\n_rebuild_tensor_v2",
    "torch._utils\n_rebuild_tensor_v3",
    "torch._utils\n_rebuild_parameter",
    "torch._utils\n_rebuild_wrapper_subclass",
    "torch._tensor\n_rebuild_from_type_v2",
    "torch\nFloatStorage",
    "torch\nbfloat16",
    "torch\nSize",
    "torch\ndevice",
    "collections\nOrderedDict",
    "builtins\nset",
    "builtins\nbytearray",
    "builtins\ncomplex",
    "_codecs\nencode",
    "torch.distributed.tensor\nDTensor",
    "torch.distributed.tensor._dtensor_spec\nDTensorSpec",
    "torch.distributed.tensor.placement_types\nShard",
    "torch.distributed.device_mesh\nDeviceMesh",
    "torch.storage\nUntypedStorage",
    "torch.distributed.checkpoint.metadata\nMetadata",
    "os\nsystem",
    "builtins\neval",
]
_SNIPPETS = [
    b"(",
    b"t",
    b")",
    b"l",
    b"]",
    b"d",
    b"}",
    b"N",
    b"\x88",
    b"\x89",
    b"K\x00",
    b"K\x05",
    b"J\xff\xff\xff\xff",
    b"M\xff\xff",
    b"\x8a\x08" + b"\xff" * 8,
    b"X\x03\x00\x00\x00abc",
    b"U\x01x",
    b"C\x02\x00\x01",
    b"G" + b"\x7f\xf8" + b"\x00" * 6,
    b"\x85",
    b"\x86",
    b"\x87",
    b"R",
    b"b",
    b"\x81",
    b"Q",
    b"s",
    b"u",
    b"a",
    b"e",
    b"\x94",
    b"h\x00",
    b"h\x01",
    b"j\x00\x00\x00\x00",
    b"q\x00",
    b"r\xff\xff\xff\x0f",
    b"0",
    b"2",
    b"\x95\x08\x00\x00\x00\x00\x00\x00\x00",
    b"\x80\x02",
    *(b"c" + g.encode() + b"\n" for g in _GLOBALS),
]


@st.composite
def opcode_streams(draw) -> bytes:
    body = b"".join(draw(st.lists(st.sampled_from(_SNIPPETS), max_size=40)))
    return Blob(b"\x80\x02" + body + b".")


# --- targets ----------------------------------------------------------------------------------


class Targets:
    def __init__(self, seeds: Seeds, workdir: Path):
        self.seeds, self.workdir = seeds, workdir
        self.examples = 0

    def unpickle(self, data: bytes) -> None:
        safe_unpickle(data, "fuzz", dcp._METADATA_CLASSES)

    def pickle_opcodes(self, data: bytes) -> None:
        safe_unpickle(data, "fuzz", dcp._METADATA_CLASSES)

    def unpicklers_agree(self, data: bytes) -> None:
        _unpicklers_agree(data)

    def unpicklers_agree_opcodes(self, data: bytes) -> None:
        _unpicklers_agree(data)

    def twins(self, data: bytes) -> None:
        from fsdpfast._parsing.pickle_twins import Twins

        twins = Twins()
        twins.load(self.seeds.pickles[0], "rank 0")  # w2-llama rank 0, whose rank 1 is mutated
        got, want = _outcome(lambda: twins.load(data, "fuzz")), _outcome(lambda: safe_unpickle(data, "fuzz"))
        assert got[0] == want[0], (got, want)
        if got[0]:
            _assert_same(got[1], want[1])
        else:
            assert str(got[1]) == str(want[1]), (got, want)

    def torch_zip(self, data: bytes) -> None:
        path = self.workdir / "fuzz.pt"
        path.write_bytes(data)
        with TorchZip(str(path)) as archive:
            value = safe_unpickle(archive.pickle_bytes, archive.where)
            for key in _storage_keys(value):
                archive.storage_span(key)

    def dcp_metadata(self, data: bytes) -> None:
        folder = self._folder_with("w2-dcp", ".metadata", data)
        fsdpfast.plan_merge(folder)

    def safetensors(self, data: bytes) -> None:
        folder = self._folder_with("w3-dcp-safetensors", "__0_0.distcp", data)
        fsdpfast.plan_merge(folder)

    def merge(self, data: bytes) -> None:
        folder = self._folder_with("w2-llama", "model_world_size_2_rank_1.pt", data)
        out = self.workdir / "merged"
        try:
            fsdpfast.merge(folder, out, engine="cpu")
        except FsdpfastError:
            if os.path.lexists(out) or [n for n in os.listdir(self.workdir) if n.startswith(".merged.")]:
                raise AssertionError("a failed merge left its output folder or staging folder behind") from None
            raise
        shutil.rmtree(out)

    def verify(self, data: bytes) -> None:
        folder = self._folder_with(None, "model.safetensors", data)
        fsdpfast.verify(folder)

    def verify_header(self, data: bytes) -> None:
        folder = self._folder_with(None, "model.safetensors", data)
        _only_clean_errors(
            lambda: fsdpfast.verify(folder), lambda: fsdpfast.verify(self.seeds.merged, reference=folder)
        )

    def verify_manifest(self, data: bytes) -> None:
        folder = self._folder_with(None, MANIFEST_NAME, data)
        _only_clean_errors(
            lambda: fsdpfast.verify(folder),
            lambda: fsdpfast.verify(self.seeds.merged, manifest_of=os.path.join(folder, MANIFEST_NAME)),
        )

    def deepspeed_optim(self, data: bytes) -> None:
        fsdpfast.plan_merge(self._reader_folder("deepspeed_optim", with_pickle, data))

    def fsdp1_rank(self, data: bytes) -> None:
        fsdpfast.plan_merge(self._reader_folder("fsdp1_rank", with_pickle, data))

    def dcp_hf_header(self, data: bytes) -> None:
        fsdpfast.plan_merge(self._reader_folder("dcp_hf_header", with_header, data))

    def _reader_folder(self, target: str, rebuild, data: bytes) -> str:
        name, entry = READER_TARGETS[target]
        return self._folder_with(name, entry, rebuild((self.seeds.folders[name] / entry).read_bytes(), data))

    def _folder_with(self, name: str | None, entry: str, data: bytes) -> str:
        """A copy of a seed folder (links to its files) with `entry` replaced by `data`; None: the merged one.
        One copy per replaced entry, so what one target damaged is not in another's folder."""
        seed = self.seeds.folders[name] if name else self.seeds.merged
        folder = self.workdir / f"ckpt-{name or 'merged'}-{entry.lstrip('.')}"
        if not folder.exists():
            folder.mkdir()
            for path in seed.iterdir():
                (folder / path.name).symlink_to(path)
        target = folder / entry
        target.unlink()
        target.write_bytes(data)
        return str(folder)


def _only_clean_errors(*checks) -> None:
    """Run every check; each may raise only a one-line FsdpfastError."""
    for check in checks:
        try:
            check()
        except FsdpfastError as exc:
            assert "\n" not in str(exc), f"a multi-line error: {exc!r}"


def _outcome(read) -> tuple[bool, object]:
    try:
        return True, read()
    except FsdpfastError as exc:
        return False, exc


def _unpicklers_agree(data: bytes) -> None:
    """The C unpickler, where the native scan lets it read `data`, and the Python one agree: the
    same value, or both refuse; and safe_unpickle answers as the Python one does."""
    from fsdpfast._parsing import safe_load

    def read(unpickler):
        return lambda: safe_load._load(unpickler, data, "fuzz", dcp._METADATA_CLASSES)

    reference = _outcome(read(safe_load._RestrictedUnpickler))
    if safe_load._plain(data):
        fast = _outcome(read(safe_load._PlainUnpickler))
        assert fast[0] == reference[0] or not fast[0], (
            f"the C unpickler read what the Python one refuses: {reference[1]}"
        )
        if fast[0]:
            _assert_same(fast[1], reference[1])
    public = _outcome(lambda: safe_unpickle(data, "fuzz", dcp._METADATA_CLASSES))
    assert public[0] == reference[0], (public, reference)
    if public[0]:
        _assert_same(public[1], reference[1])
    else:
        assert str(public[1]) == str(reference[1]) and type(public[1]) is type(reference[1]), (public, reference)


def _assert_same(a, b, seen=None) -> None:
    """Structural equality of two unpickled values (records, refs, containers; shared and cyclic ones)."""
    from fsdpfast._parsing.safe_load import Record

    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return
    seen.add((id(a), id(b)))
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, Record):
        assert a.qualname == b.qualname
        _assert_same(a.args, b.args, seen)
        _assert_same(a.state, b.state, seen)
        _assert_same(a.state_value, b.state_value, seen)
    elif isinstance(a, dict):
        assert len(a) == len(b)
        for (key, value), (other_key, other_value) in zip(a.items(), b.items()):
            _assert_same(key, other_key, seen)
            _assert_same(value, other_value, seen)
        _assert_same(getattr(a, "__dict__", None), getattr(b, "__dict__", None), seen)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y, seen)
    elif isinstance(a, (set, frozenset)):
        assert a == b
    elif isinstance(a, (DTensorRef, TensorRef, StorageRef)):
        for name in type(a).__dataclass_fields__:
            _assert_same(getattr(a, name), getattr(b, name), seen)
    elif isinstance(a, float):
        assert a == b or (a != a and b != b)
    elif isinstance(a, (int, str, bytes, bytearray, complex, type(None))):
        assert a == b or (a != a and b != b), (a, b)
    else:
        assert a is b or repr(a) == repr(b), (a, b)


def _storage_keys(value) -> set[str]:
    keys = set()
    for item in each_object(value):
        item = item.local if isinstance(item, DTensorRef) else item
        if isinstance(item, TensorRef):
            keys.add(item.storage.key)
        elif isinstance(item, StorageRef):
            keys.add(item.key)
    return keys


def strategies(seeds: Seeds) -> dict[str, st.SearchStrategy]:
    return {
        "unpickle": mutated(seeds.pickles),
        "pickle_opcodes": opcode_streams(),
        "unpicklers_agree": mutated(seeds.pickles),
        "unpicklers_agree_opcodes": opcode_streams(),
        "twins": mutated([seeds.pickles[1]]),  # w2-llama rank 1
        "torch_zip": mutated(seeds.rank_files),
        "dcp_metadata": mutated([(seeds.folders["w2-dcp"] / ".metadata").read_bytes()]),
        "safetensors": mutated([(seeds.folders["w3-dcp-safetensors"] / "__0_0.distcp").read_bytes()]),
        "merge": mutated([(seeds.folders["w2-llama"] / "model_world_size_2_rank_1.pt").read_bytes()]),
        "verify": mutated([(seeds.merged / "model.safetensors").read_bytes()]),
        "verify_header": mutated_header(seeds.merged / "model.safetensors"),
        "verify_manifest": mutated_json(seeds.merged / MANIFEST_NAME),
        **{
            target: mutated([seeds.fuzzed_part(target)])
            for target, (name, _) in READER_TARGETS.items()
            if name in seeds.folders
        },
    }


def run_target(targets: Targets, name: str, strategy, examples: int, seed: int | None = None) -> None:
    """Run one target for `examples` inputs; raises (after shrinking) on the first finding."""
    function = getattr(targets, name)

    def one(data: bytes) -> None:
        targets.examples += 1
        signal.alarm(HANG_SECONDS)
        try:
            function(data)
        except FsdpfastError as exc:
            assert "\n" not in str(exc), f"a multi-line error: {exc!r}"
        except BaseException:
            (targets.workdir / f"finding-{name}.bin").write_bytes(data)  # the last one written is the shrunk input
            raise
        finally:
            signal.alarm(0)

    test = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
    )(given(strategy)(one))
    if seed is not None:
        from hypothesis import seed as with_seed

        test = with_seed(seed)(test)
    test()


def _on_alarm(signum, frame):
    raise Hang(f"an example ran past {HANG_SECONDS} s")


def install_hang_alarm() -> None:
    signal.signal(signal.SIGALRM, _on_alarm)


# --- the long run -----------------------------------------------------------------------------


def write_seed_checkpoints(root: str) -> dict[str, str]:
    sys.path.insert(0, os.path.dirname(__file__))
    from corpus import SPECS

    from fsdpfast._testing.fsdp2_writer import write_checkpoints

    folders = {}
    names = SEED_CHECKPOINTS + [READER_TARGETS["dcp_hf_header"][0]]
    for world in sorted({SPECS[name][0] for name in names}):
        specs = [SPECS[name][1] for name in names if SPECS[name][0] == world]
        write_checkpoints(root, specs, world)
        folders.update({spec.name: spec.folder(root) for spec in specs})
    return folders


def write_reader_seeds(root: str) -> dict[str, str]:
    """target -> the folder of its seed checkpoint, for the readers' own targets (but dcp-hf, written above)."""
    import importlib.util

    from corpus import FSDP1_SPECS

    from fsdpfast._testing.fsdp1_examples import write_fsdp1_checkpoints

    world, spec = FSDP1_SPECS[FSDP1_SEED]
    write_fsdp1_checkpoints(os.path.join(root, "fsdp1"), [spec], world)
    found = {"fsdp1_rank": spec.folder(os.path.join(root, "fsdp1"))}
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed_checkpoints import DS_SPECS

        from fsdpfast._testing.deepspeed_examples import write_deepspeed_checkpoints

        world, spec = DS_SPECS[DEEPSPEED_SEED]
        write_deepspeed_checkpoints(os.path.join(root, "deepspeed"), [spec], world)
        found["deepspeed_optim"] = deepspeed_tag_folder(spec.root(os.path.join(root, "deepspeed")))
    else:
        print("deepspeed is not installed: the deepspeed_optim target is left out", flush=True)
    return found


def deepspeed_tag_folder(root: str) -> str:
    """The tag folder `latest` names: the seed is one checkpoint, read as a tag folder."""
    with open(os.path.join(root, "latest")) as f:
        return os.path.join(root, f.read().strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument(
        "--examples-per-round", type=int, default=200, help="inputs per target before moving to the next"
    )
    parser.add_argument("--targets", default=None, help="comma-separated subset of the targets")
    args = parser.parse_args()
    install_hang_alarm()
    work = Path(tempfile.mkdtemp(prefix="fsdpfast-fuzz-"))
    try:
        print("writing seed checkpoints with real gloo ranks ...", flush=True)
        folders = write_seed_checkpoints(str(work / "seeds"))
        seeds = Seeds.from_folders({name: folders[name] for name in SEED_CHECKPOINTS})
        seeds.add_reader_seed("dcp_hf_header", folders[READER_TARGETS["dcp_hf_header"][0]])
        for target, folder in write_reader_seeds(str(work / "seeds")).items():
            seeds.add_reader_seed(target, folder)
        targets = Targets(seeds, work / "scratch")
        (work / "scratch").mkdir()
        chosen = strategies(seeds)
        if args.targets:
            chosen = {name: chosen[name] for name in args.targets.split(",")}
        counts = {name: 0 for name in chosen}
        findings = []
        start = time.monotonic()
        end = start + args.minutes * 60
        round_number = 0
        while time.monotonic() < end:
            for name, strategy in chosen.items():
                if time.monotonic() >= end:
                    break
                before = targets.examples
                try:
                    run_target(
                        targets, name, strategy, args.examples_per_round, seed=round_number * 1000 + len(findings)
                    )
                except Exception as exc:  # a finding: hypothesis' shrunk example is in scratch/finding-NAME.bin
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    findings.append(
                        f"{name}: {type(exc).__name__}: {str(exc)[:300]} "
                        f"(at {os.path.basename(where.filename)}:{where.lineno})"
                    )
                    print(f"FINDING in {name}: {findings[-1]}", flush=True)
                counts[name] += targets.examples - before
            round_number += 1
            print(
                f"{time.monotonic() - start:7.0f} s  inputs so far: {sum(counts.values())}  findings: {len(findings)}",
                flush=True,
            )
        print(
            f"done: {args.minutes} min, {round_number} rounds, {sum(counts.values())} inputs "
            f"({', '.join(f'{n} {c}' for n, c in counts.items())}); findings: {len(findings)}"
        )
        for finding in findings:
            print("  " + finding)
        return 1 if findings else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
