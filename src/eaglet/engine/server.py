"""Lifecycle of a vLLM OpenAI-compatible server that eaglet starts and owns.

``VLLMServer`` is a context manager: it starts ``python -m vllm.entrypoints.openai.api_server``
in its own process group on 127.0.0.1, sends its output to a log file, waits for
``/health``, and on every way out of the ``with`` block (normal exit, exception, SIGINT,
SIGTERM from Snakemake) stops the whole process group, escalating to SIGKILL after a grace
period, and checks that the port is free again.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.engine import support

log = logging.getLogger("eaglet.engine.server")

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class ServerError(RuntimeError):
    """The inference server could not be started or stopped cleanly."""


class PortInUseError(ServerError):
    pass


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM or SIGHUP."""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", taken: Collection[int] = ()) -> int:
    """A port nothing listens on, and not one of ``taken``."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


def _wait_port_released(port: int, host: str, timeout: float = 10.0) -> None:
    """Wait until ``port`` is free again, at most ``timeout`` seconds (then warn)."""
    deadline = time.monotonic() + timeout
    while not port_is_free(port, host):
        if time.monotonic() > deadline:
            log.warning("port %d is still in use after the server stopped", port)
            return
        time.sleep(0.2)


def log_tail(path: str | os.PathLike, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# What a server log says, and the fix in eaglet's terms (vLLM's own advice names its flags)
KNOWN_FAILURES = [
    (
        "on kv cache allocation is less than requested memory",
        "vLLM found no room for the KV cache: set server.kv_cache_gib (evaluate.kv_cache_gib for "
        "the evaluation's servers) to a size that fits, e.g. 1; on the CPU engine "
        "memory_utilization is a share of the first NUMA node's RAM, which may be far less than "
        "the machine's",
    ),
    (
        "is less than desired CPU memory utilization",
        "the NUMA node has less free RAM than server.memory_utilization asks for: set "
        "server.kv_cache_gib (a size, not a share) or lower memory_utilization",
    ),
]


# vLLM's own lines that wrap the real error ("See root cause above")
WRAPPER_ERRORS = (
    "root cause above",
    "Engine core initialization failed",
    "Worker failed with error",
    "EngineDeadError",
)
_EXCEPTION_LINE = re.compile(r"\b((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (\S.*)$")


def root_cause(log_path: str | os.PathLike, max_bytes: int = 4 << 20) -> str | None:
    """The exception a server's log ends on, skipping vLLM's own wrappers of it: the last
    ``SomeError: message`` line that is not "Engine core initialization failed. See root cause
    above" or the like (None where the log has none)."""
    try:
        with open(log_path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(log_path) - max_bytes))
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        match = _EXCEPTION_LINE.search(line)
        if match and not any(w in line for w in WRAPPER_ERRORS):
            found = f"{match.group(1)}: {match.group(2).strip()}"
    return found


def exit_reason(returncode: int) -> str:
    """How a process ended, from its return code: ``killed by SIGKILL`` (a negative code is
    the signal) or ``exit code 3``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def failure_advice(tail: str) -> str:
    """The fix for a failure the log's tail shows, as a line to append (or nothing)."""
    for marker, advice in KNOWN_FAILURES:
        if marker in tail:
            return f"\nFix: {advice}."
    return ""


def _die_with_parent() -> None:
    """In the child: get SIGTERM if eaglet itself is killed with SIGKILL (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class VLLMServer:
    """A vLLM server process owned by this Python process.

    ``args`` are the server's command-line arguments after ``--model``/``--host``/``--port``
    (see :func:`server_args`); ``port=0`` picks a free port.
    """

    model: str
    log_path: str | os.PathLike
    args: list[str] = field(default_factory=list)
    port: int = 0
    host: str = "127.0.0.1"
    startup_timeout_s: float = 900.0
    shutdown_grace_s: float = 30.0
    python: str = sys.executable
    env: dict[str, str] | None = None
    module: str = SERVER_MODULE

    proc: subprocess.Popen | None = field(default=None, init=False)
    ready_after_s: float | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            self.module,
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the server (unless :meth:`launch` did) and wait until it is ready."""
        if self.proc is None:
            self.launch()
        self._wait_ready()

    def launch(self, taken: Collection[int] = ()) -> None:
        """Start the server process without waiting for it to be ready; with ``port=0``,
        a free port not among ``taken`` (the ports of servers launched just before, which
        may not listen yet)."""
        if self.port == 0:
            self.port = free_port(self.host, taken)
        elif not port_is_free(self.port, self.host):
            raise PortInUseError(
                f"port {self.port} on {self.host} is already in use (another server, or one left "
                f"over from an earlier run: `ss -ltnp 'sport = :{self.port}'` shows its pid). "
                f"Stop it, or set server.port to another port or to 0 to pick a free one."
            )
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab", buffering=0)
        cmd = self.command()
        log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        log.info("starting server: %s (log: %s)", " ".join(cmd), self.log_path)
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=env,
            )
        finally:
            log_file.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        started = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = log_tail(self.log_path)
                cause = root_cause(self.log_path)
                stopped = (
                    " (vLLM exits with code 0 when a signal stops it: SIGTERM from a "
                    "person, Snakemake or the job scheduler)"
                    if code == 0
                    else ""
                )
                raise ServerError(
                    f"the vLLM server exited ({exit_reason(code)}) before it was ready"
                    f"{stopped}" + (f": {cause}" if cause else "") + "\n"
                    f"--- last lines of {self.log_path} ---\n{tail}{failure_advice(tail)}"
                    + (f"\nThe cause, from the server's log: {cause}" if cause else "")
                )
            if self.healthy():
                self.ready_after_s = time.monotonic() - started
                log.info("server ready at %s after %.0f s", self.url, self.ready_after_s)
                return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the vLLM server was not ready after {self.startup_timeout_s:.0f} s "
                    f"(server.startup_timeout_s).\n--- last lines of {self.log_path} ---\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(1.0)

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check_alive(self) -> None:
        """Raise ServerError if the server process has exited: how it ended (its signal or exit
        code) and the last lines of its log. Callers run it when a request fails, so that a
        killed server is reported as such, not as the connection error its requests get."""
        if self.proc is not None and self.proc.poll() is not None:
            tail = log_tail(self.log_path)
            killed = (
                " (SIGKILL comes from a person, the job scheduler or the kernel's "
                "out-of-memory killer, which `dmesg` names)"
                if self.proc.returncode == -signal.SIGKILL
                else ""
            )
            raise ServerError(
                f"the vLLM server at {self.url} (pid {self.proc.pid}) died "
                f"({exit_reason(self.proc.returncode)}) while eaglet was using it{killed}. "
                f"Finished work is kept: rerun to resume with a new server.\n"
                f"--- last lines of {self.log_path} ---\n{tail}{failure_advice(tail)}"
            )

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL once the grace period is over.
        A second Ctrl-C or SIGTERM while stopping is ignored so the sweep always completes."""
        if self.proc is None:
            return
        previous = _ignore_termination_signals()
        try:
            _stop_group(self.proc, self.shutdown_grace_s)
            _wait_port_released(self.port, self.host)
            self.proc = None
        finally:
            _restore_handlers(previous)

    def __enter__(self) -> VLLMServer:
        self._previous = _install_termination_handlers()
        try:
            self.start()
        except BaseException:
            self.stop()
            _restore_handlers(self._previous)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            _restore_handlers(self._previous)


def start_together(
    placed: list[tuple[contextlib.ExitStack, VLLMServer]], may_fail: Collection[int] = ()
) -> dict[int, ServerError]:
    """Start several servers at once, each entered into the stack beside it (stopped when
    that stack closes): every process is launched first, each on its own port, so that their
    start-ups overlap (on a CPU host most of a start is one core's work), then each is waited
    for in turn. A server whose index is in ``may_fail`` and that fails to start is stopped and
    its error returned (index -> error) while the others go on; when any other fails, those
    launched but not yet in their stack are stopped before the error goes on."""
    entered, failed = 0, {}
    try:
        taken: set[int] = set()
        for _, server in placed:
            server.launch(taken)
            taken.add(server.port)
        for index, (stack, server) in enumerate(placed):
            try:
                stack.enter_context(server)  # a server that fails to start stops itself
            except ServerError as error:
                if index not in may_fail:
                    raise
                failed[index] = error
            entered += 1
    except BaseException:
        for _, server in placed[entered:]:
            server.stop()
        raise
    return failed


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def process_stat(pid: int) -> tuple[str, int] | None:
    """State letter (R, S, Z, ...) and process group of ``pid`` from ``/proc/<pid>/stat``;
    None when the process is gone or the system has no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[2])  # after the command name: state, ppid, pgrp, ...
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs on this host (a zombie does not count)."""
    if not pid:
        return False
    stat = process_stat(pid)
    if stat is not None:
        return stat[0] != "Z"
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, which an init that does not
    reap may leave around, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.glob("[0-9]*"):
        stat = process_stat(int(entry.name))
        if stat is not None and stat[1] == pgid and stat[0] != "Z":
            return True
    return False


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop the process group ``proc`` leads: SIGTERM, then SIGKILL once ``grace_s`` is over;
    returns when the leader is reaped and no process of the group runs."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    if proc.poll() is None:
        log.info("stopping server (pid %d)", proc.pid)
    deadline = time.monotonic() + grace_s
    _signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("server did not stop within %.0f s; sending SIGKILL", grace_s)
    # children of the group (engine workers) may outlive the leader: always sweep
    _wait_group_gone(pgid, max(deadline - time.monotonic(), 0.0))
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()


def _raise_terminated(signum, frame):
    raise Terminated(f"received {signal.Signals(signum).name}")


def _install_termination_handlers() -> dict:
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, _raise_terminated)
        except ValueError:  # not in the main thread: leave the handlers alone
            pass
    return previous


def _ignore_termination_signals() -> dict:
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
        except ValueError:
            pass
    return previous


def _restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def server_args(target: dict, server: dict, served_model_name: str) -> list[str]:
    """vLLM command-line arguments from the validated ``target`` and ``server`` config."""
    args = [
        "--served-model-name",
        served_model_name,
        "--dtype",
        target["dtype"],
        "--max-model-len",
        str(target["max_model_len"]),
        "--tensor-parallel-size",
        str(server["tensor_parallel_size"]),
    ]
    if server["enforce_eager"]:
        args.append("--enforce-eager")
    if target.get("trust_remote_code"):
        args.append("--trust-remote-code")
    if server["memory_utilization"] is not None:
        args += ["--gpu-memory-utilization", str(server["memory_utilization"])]
    if server.get("kv_cache_gib") is not None:
        args += ["--kv-cache-memory-bytes", str(int(server["kv_cache_gib"] * 2**30))]
    if server["reasoning_parser"]:
        args += ["--reasoning-parser", server["reasoning_parser"]]
    return args + list(server["extra_args"])


def server_env(server: dict) -> dict[str, str] | None:
    """The managed server's environment: the workflow's own plus ``server.env``."""
    return {**os.environ, **server["env"]} if server.get("env") else None


def _model_config(model: str) -> dict | None:
    """The config.json of a model served from a local directory (None for a hub id)."""
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def target_server(
    cfg: dict,
    model: str,
    log_path: str | os.PathLike,
    extra_args: list[str] = (),
    target: dict | None = None,
) -> VLLMServer:
    """The target's vLLM server as the validated config's ``target`` (or the given
    ``target`` section) and ``server`` sections describe it, served as ``target``, plus
    ``extra_args``; use it with ``with``. On vLLM's CPU engine (``server.gpus`` 0) every
    model it runs gets the attention backend that takes its weights
    (:func:`eaglet.engine.support.cpu_engine_args`), and a CPU the engine cannot run on is
    named before anything starts."""
    server = cfg["server"]
    target = target or cfg["target"]
    args = server_args(target, server, "target") + list(extra_args)
    if not server["gpus"]:  # vLLM's CPU engine
        problem = support.cpu_engine_problem(support.cpu_flags())
        if problem:
            raise ServerError(f"vLLM's CPU engine cannot start: {problem}")
        args = support.cpu_engine_args(
            args, _model_config(model), target["dtype"], draft_config=_model_config
        )
    if server["gpus"] and server.get("kv_cache_gib") is not None:
        log.warning(
            "server.kv_cache_gib is %s on a GPU server: each GPU's KV cache is that "
            "size, whatever memory_utilization leaves free (config.yaml sets it for "
            "the CPU demo); set kv_cache_gib: null to let vLLM size it",
            server["kv_cache_gib"],
        )
    return VLLMServer(
        model=model,
        log_path=log_path,
        args=args,
        port=server["port"],
        startup_timeout_s=server["startup_timeout_s"],
        shutdown_grace_s=server["shutdown_grace_s"],
        env=server_env(server),
    )
