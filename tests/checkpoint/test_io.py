"""mhla_diffusers.checkpoint.io: the one atomic-write helper."""

from __future__ import annotations

import json
import os

import pytest

from mhla_diffusers.checkpoint.io import atomic_output, atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_create_the_folder_and_leave_no_temporary_file(tmp_path):
    target = tmp_path / "new" / "report.json"
    assert atomic_write_json(target, {"b": 1, "a": [1, 2]}, sort_keys=True) == target
    assert target.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2, sort_keys=True) + "\n"
    assert atomic_write_text(tmp_path / "new" / "notes.md", "é\n").read_bytes() == "é\n".encode()
    assert sorted(p.name for p in target.parent.iterdir()) == ["notes.md", "report.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's 0600


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = atomic_write_bytes(tmp_path / "weights.bin", b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_output(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer failed")
    with pytest.raises(TypeError, match="not JSON serializable"):
        atomic_write_json(target, {"x": object()})
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


def test_replaces_an_existing_file(tmp_path):
    target = atomic_write_bytes(tmp_path / "a.txt", b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"


def test_wrong_types_are_refused(tmp_path):
    with pytest.raises(TypeError, match="atomic_write_text"):
        atomic_write_bytes(tmp_path / "a", "text")
    with pytest.raises(TypeError, match="atomic_write_bytes"):
        atomic_write_text(tmp_path / "a", b"bytes")
    assert not list(tmp_path.iterdir())
