"""Atomic writes: whole files or none, with the permissions any other file gets."""

from __future__ import annotations

import os
import stat

import pytest

from eaglet.io import atomic_open, write_json, write_jsonl


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    previous = os.umask(0o022)
    yield set_mask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_files_get_the_mode_of_the_umask_like_any_other_file(tmp_path, umask, mask):
    umask(mask)
    with open(tmp_path / "plain.log", "w") as handle:  # how a log file is created
        handle.write("x")
    write_json(tmp_path / "a.json", {"a": 1})
    write_jsonl(tmp_path / "b.jsonl", [{"b": 2}])
    with atomic_open(tmp_path / "c.bin", "wb") as handle:
        handle.write(b"\0")
    expected = stat.S_IMODE((tmp_path / "plain.log").stat().st_mode)
    assert expected == 0o666 & ~mask
    for name in ("a.json", "b.jsonl", "c.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, name


def test_a_failed_write_leaves_neither_file_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_open(tmp_path / "x.json") as handle:
            handle.write("half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
