"""Lifecycle of ``eaglet.engine.server.VLLMServer`` against a real process.

vLLM itself is too slow to start here (the end-to-end test does that): the server is
``tests/helpers/health_server.py``, a small HTTP server with the same command line that can be
told to become ready late, crash, ignore SIGTERM or leave a grandchild in its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from eaglet.core.config import validate
from eaglet.engine.server import (
    PortInUseError,
    ServerError,
    Terminated,
    VLLMServer,
    free_port,
    port_is_free,
    server_args,
    start_together,
    target_server,
)
from tests.helpers.paths import REPO, pythonpath_env

HEALTH_SERVER = "tests.helpers.health_server"

# the servers are processes; a stop() that never returns must fail its test, not hang the suite
pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(60)]


# -- helpers ---------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """The environment with the repo root on PYTHONPATH, so `-m tests.helpers...` resolves."""
    return pythonpath_env(REPO)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie counts as gone: an orphaned grandchild is reaped by
    init, and in containers whose init does not reap it stays a zombie for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_for_file(path: Path, timeout: float = 10.0) -> str:
    assert wait_until(path.exists, timeout), f"{path} was not written within {timeout} s"
    return path.read_text()


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def logged_server_pid(log_path: Path) -> int:
    """The pid the health server prints as its first line."""
    match = re.search(r"health server pid (\d+)", log_path.read_text())
    assert match, f"no pid line in {log_path}:\n{log_path.read_text()}"
    return int(match.group(1))


def assert_stopped(pid: int, port: int) -> None:
    assert wait_until(lambda: not pid_alive(pid), 5), f"server pid {pid} still runs"
    assert port_is_free(port), f"port {port} still in use"


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def log_path(tmp_path) -> Path:
    return tmp_path / "logs" / "server.log"


@pytest.fixture
def make_server(log_path):
    """Build a VLLMServer running the health server; ``*args`` are its extra flags."""

    def make(*args: str, **overrides) -> VLLMServer:
        settings = dict(
            model="tiny-model",
            log_path=log_path,
            args=list(args),
            module=HEALTH_SERVER,
            env=child_env(),
            startup_timeout_s=10,
            shutdown_grace_s=0.5,
        )
        settings.update(overrides)
        return VLLMServer(**settings)

    return make


@pytest.fixture
def child_pid_file(tmp_path) -> Path:
    return tmp_path / "grandchild.pid"


# -- start, readiness, stop ------------------------------------------------------------------


def test_start_serves_health_logs_output_and_stops(make_server, log_path):
    port = free_port()
    server = make_server(port=port)

    with server as entered:
        assert entered is server
        proc = server.proc
        assert server.port == port
        assert server.url == f"http://127.0.0.1:{port}"
        assert server.healthy()
        assert http_status(server.url + "/health") == 200

    log = log_path.read_text()
    assert "$ " + " ".join(server.command()) in log
    assert f"--model tiny-model --host 127.0.0.1 --port {port}" in log
    assert f"listening on 127.0.0.1:{port}" in log  # the server's own stdout
    assert server.proc is None
    assert proc.returncode == -signal.SIGTERM
    assert_stopped(proc.pid, port)
    assert not server.healthy()


def test_port_zero_picks_a_free_port(make_server):
    with make_server(port=0) as server:
        assert server.port > 0
        assert f"--port {server.port}" in " ".join(server.command())
        assert server.healthy()
    assert port_is_free(server.port)


def test_enter_returns_only_once_health_is_ok(make_server):
    started = time.monotonic()
    with make_server("--ready-after", "1.5") as server:
        assert time.monotonic() - started >= 1.5
        assert http_status(server.url + "/health") == 200


def start_error(server: VLLMServer) -> str:
    """The ServerError a server that crashes while starting raises."""
    with pytest.raises(ServerError) as info:
        with server:
            pytest.fail("the with-block must not run when the server crashed")
    return str(info.value)


def test_crash_before_ready_raises_with_exit_code_and_log_tail(make_server, log_path):
    server = make_server("--ready-after", "1000", "--crash-after", "0.2")

    message = start_error(server)
    assert "exited (exit code 3) before it was ready" in message
    assert "boom: simulated crash" in message
    assert str(log_path) in message
    assert server.proc is None
    assert not pid_alive(logged_server_pid(log_path))
    assert "Fix:" not in message  # no advice for a failure it does not know


# how vLLM 0.32's log reads when the engine core fails: the cause, then the API server's
# wrapper of it and a screen of shutdown lines (the cause was 200 lines above the end)
ENGINE_CORE_FAILURE = (
    "(EngineCore pid=8123) Traceback (most recent call last):\n"
    '(EngineCore pid=8123)   File "gpu_model_runner.py", line 5236, in _setup\n'
    "(EngineCore pid=8123) RuntimeError: Model does not support EAGLE3 interface but "
    "aux_hidden_state_outputs was requested\n"
    + "(APIServer pid=8100) INFO shutting down worker\n"
    * 60
    + "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
    "proc(s): {}\n" + "(APIServer pid=8100) INFO exiting\n" * 50
)


def test_a_server_that_dies_starting_is_reported_by_the_root_cause_in_its_log(make_server):
    server = make_server(
        "--ready-after", "1000", "--crash-after", "0.2", "--crash-message", ENGINE_CORE_FAILURE
    )
    message = start_error(server)
    cause = (
        "RuntimeError: Model does not support EAGLE3 interface but "
        "aux_hidden_state_outputs was requested"
    )
    assert message.splitlines()[0].endswith(cause), message.splitlines()[0]
    assert message.rstrip().endswith(f"The cause, from the server's log: {cause}")


def test_a_server_stopped_by_a_signal_while_starting_is_not_said_to_have_failed_on_its_own(
    make_server, log_path
):
    server = make_server(
        "--ready-after",
        "1000",
        "--crash-after",
        "0.2",
        "--crash-message",
        "INFO received SIGTERM, shutting down",
        "--crash-code",
        "0",
    )
    message = start_error(server)
    assert (
        "exited (exit code 0) before it was ready (vLLM exits with code 0 when a signal" in message
    )


def test_a_server_without_room_for_its_kv_cache_names_the_setting_that_fixes_it(make_server):
    """vLLM's CPU engine sizes the KV cache as a share of the first NUMA node's RAM: where
    that leaves nothing, the error says which eaglet setting gives it a size of its own."""
    vllm_says = (
        "RuntimeError: Worker failed with error 'Available memory on node 0 "
        "(6.12/9.34 GiB) on kv cache allocation is less than requested memory for kv "
        "(-0.04/1.4 GiB). Reduce CPU memory used by other processes.'"
    )
    message = start_error(
        make_server("--ready-after", "1000", "--crash-after", "0.2", "--crash-message", vllm_says)
    )
    assert "Available memory on node 0" in message
    assert "Fix: vLLM found no room for the KV cache: set server.kv_cache_gib" in message


def test_start_timeout_raises_and_stops_the_group(make_server, log_path, child_pid_file):
    server = make_server(
        "--ready-after",
        "1000",
        "--spawn-child",
        "--child-pid-file",
        str(child_pid_file),
        startup_timeout_s=2,
    )

    started = time.monotonic()
    with pytest.raises(ServerError) as info:
        with server:
            pytest.fail("the with-block must not run when the server never got ready")

    message = str(info.value)
    assert "not ready after 2 s" in message
    assert "server.startup_timeout_s" in message
    assert "listening on" in message  # the log tail
    assert time.monotonic() - started < 10
    assert_stopped(logged_server_pid(log_path), server.port)
    assert wait_until(lambda: not pid_alive(int(child_pid_file.read_text())), 5)


def test_port_in_use_fails_fast_and_starts_nothing(make_server, log_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = make_server(port=port)

        started = time.monotonic()
        with pytest.raises(PortInUseError) as info:
            with server:
                pytest.fail("the with-block must not run when the port is taken")

    assert time.monotonic() - started < 1
    message = str(info.value)
    assert f"port {port}" in message
    assert "server.port" in message
    assert server.proc is None
    assert not log_path.exists()


def test_exception_in_with_block_stops_server_and_propagates(make_server):
    class Boom(Exception):
        pass

    server = make_server()
    with pytest.raises(Boom):
        with server:
            pid = server.proc.pid
            raise Boom("inside the with-block")

    assert server.proc is None
    assert_stopped(pid, server.port)


def test_stop_ends_the_whole_process_group(make_server, child_pid_file):
    server = make_server("--spawn-child", "--child-pid-file", str(child_pid_file))

    with server:
        grandchild = int(wait_for_file(child_pid_file))
        assert pid_alive(grandchild)
        assert os.getpgid(grandchild) == server.proc.pid

    assert wait_until(lambda: not pid_alive(grandchild), 5), "grandchild outlived the server"


def test_stop_escalates_to_sigkill(make_server):
    server = make_server("--ignore-sigterm", shutdown_grace_s=1)

    with server:
        proc = server.proc
        exit_started = time.monotonic()

    assert time.monotonic() - exit_started < 5
    assert proc.returncode == -signal.SIGKILL
    assert_stopped(proc.pid, server.port)


def test_termination_handlers_are_installed_only_inside_the_with_block(make_server):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    with make_server():
        for sig, handler in before.items():
            assert signal.getsignal(sig) is not handler

    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_check_alive_raises_after_the_server_died(make_server):
    # --crash-after leaves time for the first readiness poll (one second apart)
    with make_server("--crash-after", "2") as server:
        server.check_alive()
        assert wait_until(lambda: server.proc.poll() is not None, 10)

        with pytest.raises(ServerError) as info:
            server.check_alive()

    message = str(info.value)
    assert "died (exit code 3)" in message
    assert "boom: simulated crash" in message


# -- several servers side by side ------------------------------------------------------------


def test_servers_started_together_start_up_at_once_on_ports_of_their_own(make_server, tmp_path):
    servers = [
        make_server("--ready-after", "1.5", log_path=tmp_path / f"s{i}.log") for i in range(3)
    ]
    with contextlib.ExitStack() as first, contextlib.ExitStack() as rest:
        start_together([(first, servers[0]), (rest, servers[1]), (rest, servers[2])])
        assert all(server.healthy() for server in servers)
        assert len({server.port for server in servers}) == 3
        # the first took its 1.5 s; the others started up meanwhile (one after another,
        # each would have waited 1.5 s of its own)
        assert servers[0].ready_after_s >= 1.5
        assert max(server.ready_after_s for server in servers[1:]) < 1.0
        pids = [server.proc.pid for server in servers]
    for server, pid in zip(servers, pids):
        assert server.proc is None
        assert_stopped(pid, server.port)


def up_crash_up(make_server, tmp_path, last: str) -> list:
    """Three servers: one up in 0.5 s, one that crashes before it is ready (exit code 3), and
    one more up in 0.5 s, logging to ok.log, crash.log and ``last``.log."""
    return [
        make_server("--ready-after", "0.5", log_path=tmp_path / "ok.log"),
        make_server(
            "--ready-after", "1000", "--crash-after", "0.2", log_path=tmp_path / "crash.log"
        ),
        make_server("--ready-after", "0.5", log_path=tmp_path / f"{last}.log"),
    ]


def test_a_server_that_fails_to_start_stops_those_started_with_it(make_server, tmp_path):
    servers = up_crash_up(make_server, tmp_path, "waiting")
    with pytest.raises(ServerError, match=r"exited \(exit code 3\)"):
        with contextlib.ExitStack() as stack:
            start_together([(stack, server) for server in servers])
    # the one that was up was stopped by its stack, the one not yet waited for right away
    assert [server.ready_after_s is not None for server in servers] == [True, False, False]
    for name, server in zip(("ok", "crash", "waiting"), servers):
        assert server.proc is None
        assert not pid_alive(logged_server_pid(tmp_path / f"{name}.log"))


def test_a_server_that_may_fail_is_returned_and_the_others_serve_on(make_server, tmp_path):
    servers = up_crash_up(make_server, tmp_path, "after")
    with contextlib.ExitStack() as stack:
        failed = start_together([(stack, server) for server in servers], may_fail={1})
        assert list(failed) == [1] and "exited (exit code 3)" in str(failed[1])
        # the one before it and the one after it serve; the failed one is stopped
        assert servers[0].healthy() and servers[2].healthy()
        assert servers[1].proc is None
        assert not pid_alive(logged_server_pid(tmp_path / "crash.log"))
    for server in servers:
        assert server.proc is None


# -- signals to the process that owns the server ---------------------------------------------

DRIVER = textwrap.dedent("""
    import json, os, signal, sys, time
    from eaglet.engine.server import VLLMServer

    info_path, log_path, child_pid_file = sys.argv[1:4]
    # Python leaves SIGINT alone when it starts with SIGINT ignored (background jobs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = VLLMServer(model="tiny-model", log_path=log_path, module={module!r},
                        args=["--spawn-child", "--child-pid-file", child_pid_file],
                        startup_timeout_s=10, shutdown_grace_s=0.5)
    try:
        with server:
            with open(info_path + ".tmp", "w") as handle:
                json.dump({{"pid": server.proc.pid, "port": server.port}}, handle)
            os.replace(info_path + ".tmp", info_path)
            time.sleep(600)
    except BaseException as exc:
        print("stopped by", type(exc).__name__, flush=True)
        raise
""").format(module=HEALTH_SERVER)


@pytest.mark.parametrize(
    ("sig", "raised"),
    [
        (signal.SIGTERM, Terminated.__name__),
        (signal.SIGHUP, Terminated.__name__),
        (signal.SIGINT, KeyboardInterrupt.__name__),
    ],
    ids=lambda value: getattr(value, "name", value),
)
def test_signal_to_owner_stops_the_server(tmp_path, log_path, child_pid_file, sig, raised):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    info_path = tmp_path / "server.json"
    driver = subprocess.Popen(
        [sys.executable, str(script), str(info_path), str(log_path), str(child_pid_file)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        info = json.loads(wait_for_file(info_path, timeout=15))
        grandchild = int(wait_for_file(child_pid_file))
        assert pid_alive(info["pid"]) and pid_alive(grandchild)

        driver.send_signal(sig)
        output, _ = driver.communicate(timeout=15)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()

    assert driver.returncode != 0
    assert f"stopped by {raised}" in output
    # the grandchild gets no parent-death signal: only stop() can have ended it
    assert_stopped(info["pid"], info["port"])
    assert wait_until(lambda: not pid_alive(grandchild), 5), "grandchild outlived the driver"


# -- server_args -----------------------------------------------------------------------------


def test_server_args_from_default_config():
    cfg = validate({})

    assert server_args(cfg["target"], cfg["server"], "tiny") == [
        "--served-model-name",
        "tiny",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--tensor-parallel-size",
        "1",
    ]


def test_server_args_with_every_option_set():
    cfg = validate(
        {
            "target": {"dtype": "bfloat16", "max_model_len": 4096},
            "server": {
                "tensor_parallel_size": 2,
                "enforce_eager": True,
                "memory_utilization": 0.4,
                "kv_cache_gib": 1.5,
                "reasoning_parser": "qwen3",
                "extra_args": ["--max-num-seqs", "64"],
            },
        }
    )

    assert server_args(cfg["target"], cfg["server"], "served") == [
        "--served-model-name",
        "served",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
        "--tensor-parallel-size",
        "2",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.4",
        "--kv-cache-memory-bytes",
        str(3 * 2**29),
        "--reasoning-parser",
        "qwen3",
        "--max-num-seqs",
        "64",
    ]


def test_server_args_without_enforce_eager():
    cfg = validate({"server": {"enforce_eager": False}})

    assert "--enforce-eager" not in server_args(cfg["target"], cfg["server"], "tiny")


def test_target_server_is_built_from_the_config_with_the_extra_args_last(tmp_path):
    cfg = validate(
        {
            "server": {
                "port": 8123,
                "startup_timeout_s": 77,
                "shutdown_grace_s": 5,
                "extra_args": ["--max-num-seqs", "8"],
            }
        }
    )
    server = target_server(
        cfg, "model-dir", tmp_path / "server.log", ["--speculative-config", "{}"]
    )
    assert (server.model, server.port, server.startup_timeout_s, server.shutdown_grace_s) == (
        "model-dir",
        8123,
        77,
        5,
    )
    assert server.args == [
        "--served-model-name",
        "target",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--tensor-parallel-size",
        "1",
        "--max-num-seqs",
        "8",
        "--speculative-config",
        "{}",
    ]
    assert server.proc is None  # built, not started: the caller's `with` starts it


def test_pid_alive_counts_running_processes_not_zombies_or_reaped_ones():
    from eaglet.engine.server import pid_alive, process_stat

    assert pid_alive(os.getpid()) and process_stat(os.getpid())[1] == os.getpgrp()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while process_stat(child.pid) is not None and process_stat(child.pid)[0] != "Z":
        time.sleep(0.05)  # exited but not waited for: a zombie
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid) and process_stat(child.pid) is None
    assert not pid_alive(None)


def test_server_env_reaches_the_managed_server_over_the_workflows_own(monkeypatch):
    monkeypatch.setenv("EAGLET_TEST_OUTER", "kept")
    cfg = validate({"server": {"env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}})
    server = target_server(cfg, "/models/t", "server.log")
    assert server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert server.env["EAGLET_TEST_OUTER"] == "kept"
    # no server.env: the server inherits the environment as it is when it starts
    assert target_server(validate({}), "/models/t", "server.log").env is None


def test_a_fixed_kv_cache_on_gpus_is_warned_about(caplog):
    """config.yaml's fixed KV cache is for the CPU demo: on GPUs it would cap the cache
    whatever memory_utilization leaves free, so a GPU server with one says so."""
    from eaglet.engine.server import target_server

    cfg = validate({"server": {"gpus": 1, "kv_cache_gib": 2}})
    with caplog.at_level("WARNING", logger="eaglet.engine.server"):
        server = target_server(cfg, "m", "log")
    assert "--kv-cache-memory-bytes" in server.args
    assert "server.kv_cache_gib is 2 on a GPU server" in caplog.text
    caplog.clear()
    target_server(validate({"server": {"gpus": 0, "kv_cache_gib": 2}}), "m", "log")
    target_server(validate({"server": {"gpus": 1}}), "m", "log")
    assert caplog.text == ""


# -- a server that dies while eaglet uses it -------------------------------------------------


def test_a_killed_server_ends_the_retries_at_once_with_its_signal_and_log(make_server):
    """kill -9 of a running server: the request's connection error is not retried for many
    seconds and then reported as a connection error; the engine client's retry loop checks
    the process and says it was killed, by which signal, with its log's last lines."""
    import asyncio

    import httpx

    from eaglet.engine.client import post_json, with_retries

    async def request(server: VLLMServer) -> None:
        async with httpx.AsyncClient(base_url=server.url) as client:
            await with_retries(
                lambda: post_json(client, "/v1/completions", {}, timeout=5),
                max_retries=6,
                health_check=server.check_alive,
            )

    with make_server() as server:
        os.killpg(server.proc.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ServerError) as info:
            asyncio.run(request(server))
        elapsed = time.monotonic() - started

    first, *rest = str(info.value).splitlines()
    assert "died (killed by SIGKILL)" in first and server.url in first
    assert "ConnectError" not in first
    assert "health server for tiny-model listening" in "\n".join(rest)  # the log's tail
    assert elapsed < 10, f"retried for {elapsed:.0f} s (six retries back off for over a minute)"


def test_extraction_stops_when_its_server_exits_during_the_retries(tmp_path):
    """The vllm extraction backend's prefill requests, to a server process that is alive when
    the first one fails (nothing answers yet) and exits with code 3 a moment later: the retry
    after its exit reports the exit code and the log, not a connection error after every
    retry has run."""
    from eaglet.engine.capture import Extractor

    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time; print('loading the target', flush=True); "
                "time.sleep(1.5); print('engine core failed: out of memory', flush=True); "
                "raise SystemExit(3)",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        cfg = validate({"generate": {"max_retries": 8, "request_timeout_s": 5}})
        extractor = Extractor(cfg, "/models/t", [1, 2, 4], tmp_path / "work", log, None)
        extractor.server = VLLMServer(model="/models/t", log_path=log, port=free_port())
        extractor.server.proc = proc  # stands in for the server eaglet started
        extractor.started = True
        started = time.monotonic()
        with pytest.raises(ServerError) as info:
            extractor.states(None, [{"id": "s0"}], [[1, 2, 3]], cfg["extract"], [1, 2, 2], None)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    first, *rest = str(info.value).splitlines()
    assert f"(pid {proc.pid}) died (exit code 3)" in first
    assert "engine core failed: out of memory" in "\n".join(rest)
    assert elapsed < 15, f"retried for {elapsed:.0f} s (eight retries back off for minutes)"


def test_generation_leaves_the_recorded_answers_to_extraction_when_its_server_died(
    tmp_path, caplog
):
    """Prefilling recorded answers on generation's capturing server, which was killed: no
    minutes of retries, and generation goes on (extraction computes those states) with a
    warning that says the server was killed."""
    from eaglet.stages.generate.run import prefill_recorded

    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; print('serving', flush=True); time.sleep(60)"],
            stdout=out,
            start_new_session=True,
        )
    server = VLLMServer(model="/models/t", log_path=log, port=free_port())
    server.proc = proc
    assert wait_until(lambda: "serving" in log.read_text(), 20)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    records = [{"id": "r0", "prompt_token_ids": [1, 2], "completion_token_ids": [3]}]
    cfg = validate({"generate": {"max_retries": 8}})
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="eaglet.stages.generate"):
        saved = prefill_recorded(
            server.url, records, str(tmp_path / "capture"), cfg, health_check=server.check_alive
        )
    assert saved == 0 and time.monotonic() - started < 5
    assert "prefilling the recorded answers failed" in caplog.text
    assert "died (killed by SIGTERM)" in caplog.text and "serving" in caplog.text
