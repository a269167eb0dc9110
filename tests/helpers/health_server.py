"""A stand-in for the vLLM server in the lifecycle tests of ``eaglet.engine.server.VLLMServer``.

Run as ``python -m tests.helpers.health_server --model X --host H --port P [options]``. It
answers GET /health with 503 until ``--ready-after`` seconds have passed, then 200, and can
crash, ignore SIGTERM or spawn a grandchild in its process group.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import threading
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--ready-after", type=float, default=0.0, help="seconds of 503 on /health before 200"
    )
    parser.add_argument(
        "--crash-after", type=float, default=None, help="exit with code 3 after this many seconds"
    )
    parser.add_argument(
        "--crash-message",
        default="boom: simulated crash",
        help="what the crash prints to stderr first",
    )
    parser.add_argument("--crash-code", type=int, default=3, help="the crash's exit code")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument(
        "--spawn-child", action="store_true", help="start `sleep 600` in this process group"
    )
    parser.add_argument(
        "--child-pid-file", default=None, help="where --spawn-child writes the grandchild's pid"
    )
    return parser.parse_args(argv)


def make_handler(started: float, ready_after: float):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/health":
                self.send_error(404)
                return
            ready = time.monotonic() - started >= ready_after
            body = b"ok" if ready else b"starting"
            self.send_response(200 if ready else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # keep the log to what the tests look for
            pass

    return Handler


def crash_later(seconds: float, message: str, code: int = 3) -> None:
    def crash():
        print(message, file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(seconds, crash)
    timer.daemon = True
    timer.start()


def spawn_child(pid_file: str | None) -> None:
    child = subprocess.Popen(["sleep", "600"])  # stays in our process group
    if pid_file:
        with open(pid_file + ".tmp", "w") as handle:
            handle.write(str(child.pid))
        os.replace(pid_file + ".tmp", pid_file)  # readers never see a partial file


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    print(f"health server pid {os.getpid()} starting for {args.model}", flush=True)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_child:
        spawn_child(args.child_pid_file)
    if args.crash_after is not None:
        crash_later(args.crash_after, args.crash_message, args.crash_code)
    server = http.server.ThreadingHTTPServer(
        (args.host, args.port), make_handler(started, args.ready_after)
    )
    print(f"health server for {args.model} listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
