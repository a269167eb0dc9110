"""The classes of tests by what they start (tests/conftest.py): an unmarked test is unit, and
a unit test cannot start a process, so `make test-fast` (-m unit) stays in-process."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import subprocess
import sys

import pytest

from tests.conftest import ProcessInUnitTest, refusing_processes


def test_an_unmarked_test_is_a_unit_test(request):
    assert request.node.get_closest_marker("unit") is not None


def test_every_way_of_starting_a_process_is_refused_and_named():
    before = (subprocess.Popen._execute_child, multiprocessing.util.spawnv_passfds, os.fork)
    started: list[str] = []
    with refusing_processes(started):
        with pytest.raises(ProcessInUnitTest, match="a unit test started true --version"):
            subprocess.run(["true", "--version"])
        with pytest.raises(ProcessInUnitTest):
            multiprocessing.get_context("spawn").Process(target=print).start()
        with pytest.raises(ProcessInUnitTest, match=r"os\.fork\(\)"):
            os.fork()
    assert started[0] == "true --version" and len(started) == 3
    assert (subprocess.Popen._execute_child, multiprocessing.util.spawnv_passfds, os.fork) == before


@pytest.mark.subprocess
def test_a_subprocess_test_is_no_unit_test_and_may_start_one(request):
    assert request.node.get_closest_marker("unit") is None
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
