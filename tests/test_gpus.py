"""Each GPU job gets GPUs of its own (eaglet.core.gpus): real processes, a fake list of 4 GPUs.

A holder process claims its slots, prints CUDA_VISIBLE_DEVICES and sleeps until killed, as
an extraction job holds its GPUs for its lifetime.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.core import gpus
from tests.helpers.paths import SRC, pythonpath_env

HOLDER = """
import os, sys, time
from eaglet.core.gpus import hold_gpus
try:
    print(hold_gpus(int(sys.argv[1])), flush=True)
except Exception as exc:
    print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
time.sleep(60)
"""


def fake_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in pythonpath_env(SRC).items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({gpus.LIST_ENV: "0,1,2,3", gpus.LOCK_DIR_ENV: str(tmp_path / "slots")})
    env.pop(gpus.WAIT_ENV, None)
    env.update(extra)
    return env


def start(n: int, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(n)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return proc, proc.stdout.readline().strip()


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.subprocess
def test_concurrent_jobs_get_disjoint_gpus_and_a_third_waits_then_fails(tmp_path, procs):
    env = fake_env(tmp_path)
    a, seen_a = start(2, env)
    b, seen_b = start(2, env)
    procs += [a, b]
    got_a, got_b = set(seen_a.split(",")), set(seen_b.split(","))
    assert len(got_a) == 2 and len(got_b) == 2
    assert got_a.isdisjoint(got_b) and got_a | got_b == {"0", "1", "2", "3"}

    c, seen_c = start(1, fake_env(tmp_path, **{gpus.WAIT_ENV: "0.5"}))
    procs.append(c)
    assert c.wait(timeout=10) == 3
    assert seen_c.startswith("ERROR GpuSlotsBusy: no 1 free GPUs of 4 after 0.5 s")
    assert f"pid {a.pid}" in seen_c and f"pid {b.pid}" in seen_c


@pytest.mark.subprocess
def test_killed_job_releases_its_slots(tmp_path, procs):
    env = fake_env(tmp_path)
    a, seen_a = start(2, env)
    b, seen_b = start(2, env)
    procs += [a, b]
    a.send_signal(signal.SIGKILL)  # no cleanup code runs: the kernel drops the flock
    a.wait(timeout=10)
    c, seen_c = start(2, fake_env(tmp_path, **{gpus.WAIT_ENV: "5"}))
    procs.append(c)
    assert set(seen_c.split(",")) == set(seen_a.split(","))


@pytest.mark.subprocess
def test_waiting_job_starts_when_slots_free_up(tmp_path, procs):
    env = fake_env(tmp_path)
    a, seen_a = start(4, env)
    procs.append(a)
    assert seen_a == "0,1,2,3"
    waiter = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "3"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    procs.append(waiter)
    with pytest.raises(subprocess.TimeoutExpired):
        waiter.wait(timeout=1.0)  # still waiting, not failed
    a.kill()
    assert waiter.stdout.readline().strip() == "0,1,2"


@pytest.mark.subprocess
def test_scheduler_set_devices_are_kept(tmp_path, procs):
    proc, seen = start(2, fake_env(tmp_path, CUDA_VISIBLE_DEVICES="5,7"))
    procs.append(proc)
    assert seen == "5,7"
    assert not (tmp_path / "slots").exists()  # nothing claimed


def test_no_gpus_asked_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(gpus.LIST_ENV, "0,1")
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path / "slots"))
    assert gpus.hold_gpus(0) is None
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not (tmp_path / "slots").exists()


def test_more_gpus_than_the_node_has_fails_at_once(tmp_path):
    with pytest.raises(gpus.GpuSlotsBusy, match="asks for 5 GPUs but this node has 4"):
        gpus.claim(5, ["0", "1", "2", "3"], tmp_path)


def test_gpu_list_from_env(monkeypatch):
    monkeypatch.setenv(gpus.LIST_ENV, " 2, 3 ,")
    assert gpus.node_gpus() == ["2", "3"]
    monkeypatch.setenv(gpus.LIST_ENV, "")
    assert gpus.node_gpus() == []
