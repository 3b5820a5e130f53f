"""Malicious pickles are refused before anything in them runs.

Each payload's side effect would create a marker file; every test checks the marker is
absent afterwards. A control test shows that plain `pickle.loads` of the same bytes does
create it, so the absence means fsdpfast refused the payload, not that the payload was inert.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401  (the classes a real DCP .metadata pickles)
import torch.distributed.tensor  # noqa: F401  (lets torch.load(weights_only=True) rebuild DTensors)
from helpers import copy_checkpoint, rank_file

from fsdpfast._parsing import safe_load
from fsdpfast._parsing.safe_load import safe_unpickle
from fsdpfast.errors import EXIT_BAD_INPUT, BadInput, UnsafeCheckpoint


class Calls:
    """Pickles as "call `function` with `args`" (the __reduce__ trick every exploit uses)."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def touch_command(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def create_file_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def pickled_call(function, *args, protocol: int = 2) -> bytes:
    # fix_imports=False keeps Python 3 names (builtins.exec, not __builtin__.exec) below protocol 3
    return pickle.dumps(Calls(function, *args), protocol=protocol, fix_imports=False)


def pickled_global_call(module: str, name: str) -> bytes:
    """GLOBAL module.name called with no arguments: pickle.dumps reaches some builtins only
    through getattr/eval, while an attacker simply names them."""
    return f"c{module}\n{name}\n)R.".encode()


# name -> (pickle bytes for (marker, protocol) whose side effect creates the marker,
#          the global the refusal must name)
LIVE_PAYLOADS = {
    "os.system": (lambda m, p: pickled_call(os.system, touch_command(m), protocol=p), f"{os.system.__module__}.system"),
    "builtins.exec": (lambda m, p: pickled_call(exec, create_file_code(m), protocol=p), "builtins.exec"),
    "builtins.eval": (lambda m, p: pickled_call(eval, create_file_code(m), protocol=p), "builtins.eval"),
    "subprocess.Popen": (
        lambda m, p: pickled_call(subprocess.Popen, ["touch", str(m)], protocol=p),
        "subprocess.Popen",
    ),
    "torch.save": (lambda m, p: pickled_call(torch.save, {}, str(m), protocol=p), "torch.serialization.save"),
}
# Torch internals a checkpoint never names; they have no side effect to observe, so the
# proof is the refusal itself.
TORCH_INTERNALS = {
    "torch.load": (lambda m, p: pickled_call(torch.load, str(m), protocol=p), "torch.serialization.load"),
    "torch._C._get_tracing_state": (
        lambda m, p: pickled_global_call("torch._C", "_get_tracing_state"),
        "torch._C._get_tracing_state",
    ),
}
ALL_PAYLOADS = {**LIVE_PAYLOADS, **TORCH_INTERNALS}
PICKLED_CALLS = [name for name in ALL_PAYLOADS if name != "torch._C._get_tracing_state"]


def payload_bytes(name: str, marker: Path, protocol: int = 2) -> bytes:
    build, _ = ALL_PAYLOADS[name]
    return build(marker, protocol)


def refused_global(name: str) -> str:
    return ALL_PAYLOADS[name][1]


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "MARKER"


# --- the payloads are live ------------------------------------------------------------------


@pytest.mark.parametrize("name", LIVE_PAYLOADS)
def test_control_plain_pickle_runs_the_payload(marker, name):
    result = pickle.loads(payload_bytes(name, marker))
    if isinstance(result, subprocess.Popen):
        result.wait()
    assert marker.exists(), "the payload must be live for the other tests to mean anything"


# --- safe_unpickle on the raw payloads --------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("name", PICKLED_CALLS)
def test_safe_unpickle_refuses_every_protocol(marker, name, protocol):
    with pytest.raises(UnsafeCheckpoint, match="refusing to unpickle") as caught:
        safe_unpickle(payload_bytes(name, marker, protocol), "evil/data.pkl")
    assert refused_global(name) in str(caught.value)
    assert "evil/data.pkl" in str(caught.value)
    assert not marker.exists()


def test_safe_unpickle_refuses_a_payload_nested_among_tensors(marker):
    # A real state dict pickled the way torch.save does, with one entry that runs a shell.
    state = {"weight": torch.zeros(2), "bias": Calls(os.system, touch_command(marker))}
    with pytest.raises(UnsafeCheckpoint, match="refusing to unpickle"):
        safe_unpickle(torch_data_pkl(state), "evil/data.pkl")
    assert not marker.exists()


# Opcodes written by hand, the way an attacker would; name -> (bytes for marker, runs under pickle.loads)
HAND_WRITTEN = {
    "python2 name for exec": (lambda m: f"c__builtin__\nexec\n(V{create_file_code(m)}\ntR.".encode(), True),
    "INST opcode": (lambda m: f"(V{touch_command(m)}\nios\nsystem\n.".encode(), True),
    "copyreg._reconstructor": (
        lambda m: f"ccopyreg\n_reconstructor\n(cos\nsystem\nV{touch_command(m)}\ntR.".encode(),
        False,
    ),
    "builtins.getattr": (lambda m: b"cbuiltins\ngetattr\n(cos\nsystem\nVname\ntR.", False),
    "torch.storage._load_from_bytes": (lambda m: b"ctorch.storage\n_load_from_bytes\n(C\x00tR.", False),
}


@pytest.mark.parametrize("name", [name for name, (_, live) in HAND_WRITTEN.items() if live])
def test_control_plain_pickle_runs_the_hand_written_payload(marker, name):
    pickle.loads(HAND_WRITTEN[name][0](marker))
    assert marker.exists()


@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_safe_unpickle_refuses_hand_written_opcodes(marker, name):
    with pytest.raises(UnsafeCheckpoint, match="refusing to unpickle"):
        safe_unpickle(HAND_WRITTEN[name][0](marker), "evil/data.pkl")
    assert not marker.exists()


def test_safe_unpickle_refuses_codecs_encode_with_another_codec():
    # _codecs.encode is allowed for protocol-2 bytes only; other codecs (zlib, rot13) are not data.
    crafted = b"c_codecs\nencode\n(Vdata\nVzlib\ntR."
    with pytest.raises(UnsafeCheckpoint, match="_codecs.encode"):
        safe_unpickle(crafted, "evil/data.pkl")


def test_safe_unpickle_refuses_a_persistent_id_that_is_not_a_storage():
    class NamesAFile(pickle.Pickler):
        def persistent_id(self, obj):
            return ("file", "/etc/passwd") if obj == "secret" else None

    buffer = io.BytesIO()
    NamesAFile(buffer, protocol=2).dump({"x": "secret"})
    with pytest.raises(UnsafeCheckpoint, match="persistent id"):
        safe_unpickle(buffer.getvalue(), "evil/data.pkl")


def test_safe_unpickle_turns_garbage_into_bad_input():
    with pytest.raises(BadInput, match="damaged"):
        safe_unpickle(b"\x80\x02}q\x00(X\x01", "evil/data.pkl")


# --- BUILD: pickled state may not change fsdpfast's shared stand-ins ----------------------------


def _binunicode(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


# BUILD with {field: value} onto a global: pickle writes it into that object's __dict__ (or, for
# the (None, slotstate) form, setattr), so a global that is a shared object would change for the
# whole process. name -> (pickle bytes, the allowed global it targets, the field it changes).
STATE_PAYLOADS = {
    # the review's 60 bytes: every later bfloat16 storage would read as float16, silently
    "bf16 storage reads as fp16": (
        b"ctorch\nBFloat16Storage\n}" + _binunicode("dtype") + _binunicode("float16") + b"sb0N.",
        "torch.BFloat16Storage",
        "dtype",
    ),
    "DTensor class stand-in": (
        b"ctorch.distributed.tensor\nDTensor\n}" + _binunicode("qualname") + _binunicode("Tensor") + b"sb0N.",
        "torch.distributed.tensor.DTensor",
        "qualname",
    ),
    "dtype global via slot state": (
        b"ctorch\nbfloat16\n(N}" + _binunicode("planted") + _binunicode("yes") + b"stb0N.",
        "torch.bfloat16",
        "planted",
    ),
}


def _stand_in(qualname: str):
    module, name = qualname.rsplit(".", 1)
    return safe_load._RestrictedUnpickler(b"", "test", frozenset()).find_class(module, name)


@pytest.mark.parametrize("name", STATE_PAYLOADS)
def test_control_unrestricted_build_changes_the_target(name):
    """The same bytes through pickle's own BUILD, onto an ordinary object holding the stand-in's
    fields, do change it."""
    payload, qualname, field = STATE_PAYLOADS[name]
    original = _stand_in(qualname)
    throwaway = types.SimpleNamespace(**vars(original))

    class Unrestricted(pickle._Unpickler):
        def find_class(self, module, name):
            return throwaway

    Unrestricted(io.BytesIO(payload)).load()
    assert getattr(throwaway, field, None) != getattr(original, field, None)


@pytest.mark.parametrize("unpickler", [pickle._Unpickler, pickle.Unpickler], ids=["python", "c"])
@pytest.mark.parametrize("name", STATE_PAYLOADS)
def test_the_stand_ins_themselves_refuse_pickled_state(name, unpickler):
    """Even to an unpickler without fsdpfast's BUILD check (the C one, which reads plain pickles),
    the shared stand-ins refuse pickled state, unchanged."""
    payload, qualname, field = STATE_PAYLOADS[name]
    target = _stand_in(qualname)
    before = dict(vars(target))

    class Unrestricted(unpickler):
        def find_class(self, module, name):
            return target

    with pytest.raises(UnsafeCheckpoint, match="refusing to set the state of"):
        Unrestricted(io.BytesIO(payload)).load()
    assert vars(target) == before and getattr(target, field, None) == before.get(field)


@pytest.mark.parametrize("name", STATE_PAYLOADS)
def test_build_onto_a_shared_stand_in_is_refused_and_changes_nothing(name):
    payload, qualname, field = STATE_PAYLOADS[name]
    target = _stand_in(qualname)
    before = dict(vars(target))
    with pytest.raises(UnsafeCheckpoint, match="refusing to set the state of"):
        safe_unpickle(payload, "evil/data.pkl")
    assert (
        _stand_in(qualname) is target and vars(target) == before and getattr(target, field, None) == before.get(field)
    )


def test_bfloat16_tensors_still_read_as_bfloat16_after_the_payload():
    with pytest.raises(UnsafeCheckpoint):
        safe_unpickle(STATE_PAYLOADS["bf16 storage reads as fp16"][0], "evil/data.pkl")
    state = safe_unpickle(torch_data_pkl({"w": torch.ones(3, dtype=torch.bfloat16)}), "fine/data.pkl")
    assert state["w"].dtype == "bfloat16" and state["w"].storage.dtype == "bfloat16"


def test_build_still_sets_the_state_dict_metadata():
    # torch pickles a module's state dict as an OrderedDict with BUILD state {"_metadata": ...}
    model_state = torch.nn.Linear(2, 2).state_dict()
    value = safe_unpickle(torch_data_pkl(model_state), "fine/data.pkl")
    assert list(value) == ["weight", "bias"] and value._metadata == model_state._metadata


# --- real rank files carrying a payload, through the CLI --------------------------------------


def torch_data_pkl(value) -> bytes:
    """The data.pkl torch.save writes for `value` (read back from a real torch.save archive)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return archive.read(name)


def rewrite_data_pkl(path: Path, payload: bytes) -> None:
    """Replace the archive's data.pkl with `payload`, keeping every other record and their order."""
    with zipfile.ZipFile(path) as original:
        records = [(info.filename, original.read(info)) for info in original.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as rewritten:
        for name, data in records:
            rewritten.writestr(name, payload if name.endswith("/data.pkl") else data)


def merge_cli(src: Path, out: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def assert_refused_unsafe(result: subprocess.CompletedProcess, rank_path: Path, out: Path) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == EXIT_BAD_INPUT, f"exit {result.returncode}:\n{result.stderr}"
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdpfast: error: ")
    assert "refusing to unpickle" in lines[0] and str(rank_path) in lines[0], lines[0]
    assert not out.exists()
    assert not [n for n in os.listdir(out.parent) if n.startswith(f".{out.name}.fsdpfast-")]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_PAYLOADS)
def test_cli_refuses_a_rank_file_whose_data_pkl_is_a_payload(checkpoints, tmp_path, marker, name):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    victim = rank_file(folder, 1)  # rank 0 is read first and is clean
    rewrite_data_pkl(victim, payload_bytes(name, marker))
    out = tmp_path / "merged"
    line = assert_refused_unsafe(merge_cli(folder, out, cwd=tmp_path), victim, out)
    assert refused_global(name) in line
    assert not marker.exists()


@pytest.mark.slow
def test_cli_refuses_a_payload_hidden_in_a_real_state_dict(checkpoints, tmp_path, marker):
    # torch.save itself writes the trojan: every real DTensor plus one entry that runs a shell.
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    victim = rank_file(folder, 0)
    state = torch.load(victim, weights_only=True)
    state["model.norm.bias"] = Calls(os.system, touch_command(marker))
    torch.save(state, victim)
    out = tmp_path / "merged"
    assert_refused_unsafe(merge_cli(folder, out, cwd=tmp_path), victim, out)
    assert not marker.exists()


@pytest.mark.slow
def test_cli_refuses_a_payload_in_the_part_that_is_not_merged(checkpoints, tmp_path, marker):
    # The guide layout merges only "state_dict", but the whole file is unpickled: a payload in
    # its metadata must be refused too.
    folder = copy_checkpoint(checkpoints, "w2-guide", tmp_path)
    victim = rank_file(folder, 1)
    whole = torch.load(victim, weights_only=True)
    whole["metadata"]["note"] = Calls(subprocess.Popen, ["touch", str(marker)])
    torch.save(whole, victim)
    out = tmp_path / "merged"
    line = assert_refused_unsafe(merge_cli(folder, out, cwd=tmp_path), victim, out)
    assert "Popen'" in line  # torch.save pickles it under its Python 2 name, commands.Popen
    assert not marker.exists()


# --- DCP folders: the .metadata pickle and the chunk archives inside .distcp files -----------


def load_dcp_metadata(folder: Path):
    return pickle.loads((folder / ".metadata").read_bytes())


@pytest.mark.slow
def test_cli_refuses_a_dcp_metadata_carrying_a_payload(checkpoints, tmp_path, marker):
    # The real Metadata object, re-pickled as DCP does, with one planner entry that runs a shell.
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    metadata = load_dcp_metadata(folder)
    metadata.planner_data = {**(metadata.planner_data or {}), "evil": Calls(os.system, touch_command(marker))}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "merged"
    line = assert_refused_unsafe(merge_cli(folder, out, cwd=tmp_path), folder / ".metadata", out)
    assert f"{os.system.__module__}.system" in line
    assert not marker.exists()


@pytest.mark.slow
def test_cli_refuses_a_distcp_chunk_that_is_a_payload(checkpoints, tmp_path, marker):
    # One chunk's torch.save archive replaced by torch.save of a payload, in a new .distcp file
    # the (re-pickled, otherwise real) .metadata points to.
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    evil = folder / "__1_9.distcp"
    torch.save(Calls(subprocess.Popen, ["touch", str(marker)]), evil)
    metadata = load_dcp_metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn.endswith("q_proj.weight") and list(i.offset)[0] > 0)
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(evil.name, 0, evil.stat().st_size)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "merged"
    line = assert_refused_unsafe(merge_cli(folder, out, cwd=tmp_path), evil, out)
    assert "Popen'" in line
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("place", ["/etc/hostname", "../outside.distcp"])
def test_dcp_metadata_naming_a_file_outside_the_folder_is_refused(checkpoints, tmp_path, place):
    # A crafted .metadata could otherwise copy any readable file into the merged model.
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    (tmp_path / "outside.distcp").write_bytes((folder / "__1_0.distcp").read_bytes())
    metadata = load_dcp_metadata(folder)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(place, info.offset, info.length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "merged"
    result = merge_cli(folder, out, cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT and len(result.stderr.splitlines()) == 1, result.stderr
    assert "outside the checkpoint folder" in result.stderr and place in result.stderr
    assert not out.exists()


# --- more globals a checkpoint never needs, and allowed ones called the wrong way -------------

MORE_INTERNALS = {
    "a model class (NEWOBJ)": (
        lambda: pickle.dumps(torch.nn.Linear(2, 2), protocol=2),
        "torch.nn.modules.linear.Linear",
    ),
    "torch._utils._rebuild_device_tensor_from_numpy": (
        lambda: pickled_global_call("torch._utils", "_rebuild_device_tensor_from_numpy"),
        "torch._utils._rebuild_device_tensor_from_numpy",
    ),
    "torch._tensor._rebuild_from_type": (
        lambda: pickled_global_call("torch._tensor", "_rebuild_from_type"),
        "torch._tensor._rebuild_from_type",
    ),
    "torch.jit.load": (lambda: pickled_global_call("torch.jit", "load"), "torch.jit.load"),
    "numpy reconstruct": (
        lambda: pickled_global_call("numpy.core.multiarray", "_reconstruct"),
        "numpy.core.multiarray._reconstruct",
    ),
    "a distributed class outside the allow-list": (
        lambda: pickled_global_call("torch.distributed.distributed_c10d", "init_process_group"),
        "torch.distributed.distributed_c10d.init_process_group",
    ),
}


@pytest.mark.parametrize("name", MORE_INTERNALS)
def test_safe_unpickle_refuses_other_torch_internals(name):
    build, qualname = MORE_INTERNALS[name]
    with pytest.raises(UnsafeCheckpoint, match="refusing to unpickle") as caught:
        safe_unpickle(build(), "evil/data.pkl")
    assert qualname in str(caught.value)


def test_an_allowed_global_cannot_allocate_what_the_file_asks():
    # builtins.bytearray is allowed (pickles store bytearrays through it) but not bytearray(2**40).
    with pytest.raises(UnsafeCheckpoint, match="bytearray"):
        safe_unpickle(b"cbuiltins\nbytearray\n(\x8a\x06\x00\x00\x00\x00\x00\x01tR.", "evil/data.pkl")
    assert safe_unpickle(pickle.dumps(bytearray(b"ok"), protocol=2, fix_imports=False), "fine") == bytearray(b"ok")


def test_a_huge_memo_index_does_not_allocate_memory():
    # LONG_BINPUT 0x3fffffff: the C unpickler would grow its memo to 2**31 entries (16 GB).
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert safe_unpickle(b"\x80\x02N" + b"r\xff\xff\xff\x3f" + b".", "evil/data.pkl") is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KB: well under 512 MB


@pytest.mark.parametrize("shape", ["deep", "cycle", "shared"])
def test_nested_cyclic_and_shared_containers_are_handled(shape):
    if shape == "deep":
        with pytest.raises(BadInput, match="levels deep"):
            safe_unpickle(b"(" * 5000 + b"l" * 5000 + b".", "evil/data.pkl")
        return
    if shape == "cycle":
        value = safe_unpickle(b"\x80\x02]q\x00h\x00a.", "evil/data.pkl")  # a list containing itself
        assert value[0] is value
        return
    # 64 levels of [x, x]: 2**64 paths through 64 lists; anything walking it as a tree never ends.
    value = safe_unpickle(b"\x80\x02]q\x00" + b"(h\x00h\x00lq\x00" * 64 + b".", "evil/data.pkl")
    assert value[0] is value[1]
