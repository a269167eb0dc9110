"""Atomic writes: whole files or none, with the permissions any other file gets."""

from __future__ import annotations

import fcntl
import os
import stat
import threading

import pytest

from eaglet.core.io import atomic_open, request_lock, write_json, write_jsonl, writer_done


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


def test_writer_done_waits_for_the_lock_the_capture_writer_holds(tmp_path):
    path = tmp_path / "abc.safetensors"
    assert writer_done(path, wait=False)  # no lock file: nobody writes
    fd = os.open(request_lock(path), os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the connector holds it while it writes
    assert not writer_done(path, wait=False)
    finished = threading.Event()
    waiter = threading.Thread(target=lambda: writer_done(path) and finished.set())
    waiter.start()
    assert not finished.wait(0.3)  # blocks while the writer holds the lock
    os.close(fd)  # the writer is done
    assert finished.wait(10)
    waiter.join()
    assert writer_done(path, wait=False)


HOLDER = """
import sys, time
from eaglet.core.io import hold_directory
with hold_directory(sys.argv[1], "train"):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.mark.subprocess
def test_a_held_directory_refuses_a_second_process_naming_the_first(tmp_path):
    """A stage still running (an orphan of a killed Snakemake) holds its directory: its rerun
    is refused at once with the live pid, and gets the directory once the first is gone."""
    import subprocess
    import sys

    from eaglet.core.io import DirectoryBusy, hold_directory

    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(
            DirectoryBusy,
            match=rf"pid {first.pid} on host .* still running.*"
            rf"kill {first.pid}",
        ):
            with hold_directory(tmp_path, "train"):
                pass
    finally:
        first.kill()
        first.wait()
    with hold_directory(tmp_path, "train"):  # the lock went with the process
        assert (tmp_path / ".owner").read_text().count(str(os.getpid())) == 1
