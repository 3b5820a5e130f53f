"""az:// through Azurite (the Azure Storage emulator, from npm; skipped where `azurite-blob` is not on PATH):
a merge into a container is the local merge byte for byte, verifies there, and merges back out of it."""

from __future__ import annotations

import os

import pytest
from azurite import Azurite, azurite_program

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.remote import stores

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(azurite_program() is None, reason="azurite-blob not on PATH (npm install -g azurite)"),
]


def test_merge_into_azure_is_the_local_merge(checkpoints, tmp_path, monkeypatch, capsys):
    import obstore

    monkeypatch.setattr(stores, "_OPTIONS", {})  # this test's --storage-option pairs only
    monkeypatch.setattr(stores, "_STORES", {})
    azurite = Azurite().start()
    try:
        azurite.create_container("merged")
        options = [arg for pair in azurite.storage_options() for arg in ("--storage-option", pair)]
        _, folder = checkpoints.get("w2-llama")
        fsdpfast.merge(folder, tmp_path / "local")
        assert main(["merge", folder, "--out", "az://merged/step", *options]) == 0
        store, _ = stores.store_for("az://merged/step")
        listed = sorted(m["path"] for batch in obstore.list(store, prefix="step/") for m in batch)
        local = sorted(os.listdir(tmp_path / "local"))
        assert listed == [f"step/{name}" for name in local]
        for name in local:
            if name != MANIFEST_NAME:
                got = bytes(obstore.get(store, f"step/{name}").bytes())
                assert got == (tmp_path / "local" / name).read_bytes(), name
        assert main(["verify", "az://merged/step", *options]) == 0
        capsys.readouterr()
        assert main(["inspect", "az://merged/step", *options]) == 2  # a merged folder is no sharded checkpoint
        error = capsys.readouterr().err
        assert (
            error.startswith("fsdpfast: error: az://merged/step: no known checkpoint layout")
            and "fsdpfast-remote-" not in error
        )
    finally:
        azurite.stop()
