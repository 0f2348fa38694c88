"""Atomic writes: whole files, ordinary permissions, no temporary files left behind."""

import json
import os
import stat

import pytest

from moe_place.io import write_atomic, write_json_atomic


def test_write_json_atomic_round_trip_and_mode(tmp_path):
    path = tmp_path / "sub" / "plan.json"
    write_json_atomic(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.bin"
    write_atomic(path, b"old")


    with pytest.raises(TypeError):
        write_atomic(path, 123)  # not bytes or str: fails before replacing
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]
