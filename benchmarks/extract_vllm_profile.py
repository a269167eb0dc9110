"""Shard-mode extraction through vLLM against the engine's bare prefill, side by side.

On the same sequences (the first ``--samples`` of a synthetic/train.jsonl), ``--rounds``
times, every other round in the reverse order:

* bare: a plain vLLM server with the run's target and server settings and no capture
  options; one prefill-only request per sequence (``max_tokens`` 1) at the extraction's
  concurrency (``extract.concurrency``);
* capture: the extraction's server (the same plus the capture options), the same requests;
  each saves its states to a file that nothing reads (removed afterwards);
* eaglet: ``extract_vllm.capture_shards`` on that server: the whole shard path once the
  server is ready (requests, reading the files, the teacher check, packing, writing) into
  ``--shards`` shards. It runs in a process of its own, with this checkout's ``src`` and,
  with ``--before-src DIR``, also with the code in DIR (e.g. the last commit's:
  ``git archive HEAD src | tar -x -C DIR``), both on the same server, in turn: a machine
  whose speed drifts, or that other work shares, slows both alike.

Each measure: tokens/s (best and spread over the rounds), the CPU seconds of the server's
processes, of eaglet's and of everything else on the machine (a measure waits, a while, for
the machine to be quiet, and is taken again once when other work took a tenth of it); the
eaglet measure adds the packing's seconds per part (the stage's own accounting, or timers
wrapped around the functions of code that has none) and the shards' sha256, which are equal
across rounds and code versions when the output is the same.

    .venv/bin/python benchmarks/extract_vllm_profile.py --target results/target \\
        --data results/synthetic/train.jsonl [--samples 120] [--shards 2] [--rounds 2] \\
        [--before-src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx

from eaglet.core.config import load
from eaglet.core.io import read_json, read_jsonl, request_lock, write_json, writer_done
from eaglet.engine import capture
from eaglet.engine.capture import capture_layer_ids, capture_server
from eaglet.engine.server import VLLMServer, target_server
from eaglet.stages.extract import vllm as extract_vllm
from eaglet.stages.extract.vllm import capture_shards, staged_shards
from eaglet.target import states as extract_common
from eaglet.target.checkpoint import model_identity, read_target_config, text_config
from eaglet.target.states import resolve_aux_layer_ids, sequence

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "extract_vllm"
CLOCK = os.sysconf("SC_CLK_TCK")


# -- CPU time ------------------------------------------------------------------------------


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (a server
    eaglet starts is its own group: the API server and its engine core)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine (every process), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK


def others_cpu_s(server) -> float:
    """Busy CPU seconds of every process but ``server``'s and this one (and its children)."""
    return machine_cpu_s() - group_cpu_s(server.proc.pid) - own_cpu_s()


@contextlib.contextmanager
def measured(server, into: dict):
    """Wall seconds and the CPU seconds of ``server``'s processes, of eaglet's (this process
    and the children it waited for) and of everything else on the machine."""
    wall, srv, own, others = (
        time.perf_counter(),
        group_cpu_s(server.proc.pid),
        own_cpu_s(),
        others_cpu_s(server),
    )
    yield
    into["wall_s"] = time.perf_counter() - wall
    into["server_cpu_s"] = group_cpu_s(server.proc.pid) - srv
    into["eaglet_cpu_s"] = own_cpu_s() - own
    into["others_cpu_s"] = max(0.0, others_cpu_s(server) - others)


def wait_quiet(server, patience_s: float, most_cores: float = 0.3, window_s: float = 5.0) -> None:
    """Wait (at most ``patience_s``) until the machine's other work stays under
    ``most_cores`` for ``window_s``."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        start = others_cpu_s(server)
        time.sleep(window_s)
        if (others_cpu_s(server) - start) / window_s < most_cores:
            return
    print("the machine did not get quiet; measuring anyway", flush=True)


# how long a measure waits for a quiet machine, and how often it is taken (while other work
# took more than a tenth of the machine during it); set from the command line
PATIENCE_S, TRIES = 120.0, 2


def clean_measure(measure, server, most_share: float = 0.1) -> dict:
    """``measure()`` once the machine is quiet, again (at most ``TRIES`` times) while other
    processes took more than ``most_share`` of the machine's cores during it."""
    for attempt in range(TRIES):  # noqa: B007 (read after the loop: the number of tries)
        wait_quiet(server, PATIENCE_S)
        out = measure()
        if out["others_cpu_s"] <= most_share * out["wall_s"] * os.cpu_count():
            break
        print(
            f"other processes used {out['others_cpu_s']:.0f} CPU s of the measure's "
            f"{out['wall_s']:.0f} s",
            flush=True,
        )
    out["tries"] = attempt + 1
    return out


# -- requests ------------------------------------------------------------------------------


async def send_all(url: str, payloads: list[dict], concurrency: int, timeout: float) -> None:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def one(payload: dict) -> None:
            async with gate:
                answer = await client.post("/v1/completions", json=payload)
                answer.raise_for_status()

        await asyncio.gather(*(one(p) for p in payloads))


def prefill_payloads(seqs: list[list[int]], capture_dir: Path | None) -> list[dict]:
    payloads = []
    for i, ids in enumerate(seqs):
        payload = {"model": "target", "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        if capture_dir is not None:
            path = capture_dir / f"{i}.safetensors"
            payload["kv_transfer_params"] = {"hidden_states_path": str(path)}
        payloads.append(payload)
    return payloads


def clear_captures(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        writer_done(path)
        path.unlink(missing_ok=True)
        request_lock(path).unlink(missing_ok=True)


# -- the eaglet path, in a process of its own ----------------------------------------------


class Wrapped:
    """Wall seconds in the functions of the extraction path, summed over threads: the parts
    of code from before the stage kept its own account."""

    PARTS = [
        (capture, "read_request", "reading"),
        (extract_vllm, "split_states", "states"),
        (extract_common, "teacher_from_stored", "teacher"),
        (extract_vllm, "write_shard", "check and write"),
    ]

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.lock = threading.Lock()
        self.saved = []

    def timed(self, fn, name):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.seconds[name] += time.perf_counter() - start

        return run

    def __enter__(self):
        for module, attr, name in self.PARTS:
            if hasattr(module, attr):
                self.saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, self.timed(getattr(module, attr), name))
        return self

    def __exit__(self, *exc):
        for module, attr, fn in self.saved:
            setattr(module, attr, fn)

    def parts(self) -> dict[str, float]:
        out = dict(self.seconds)
        if "teacher" in out and "check and write" in out:  # the check runs inside the write
            out["writing"] = out.pop("check and write") - out["teacher"]
        return out


def eaglet_worker(spec: dict) -> dict:
    """The eaglet path on the running capture server at ``spec["port"]`` (run with the
    code version to measure on ``PYTHONPATH``)."""
    cfg = bench_config(spec["config"])
    if spec["normal_priority"]:
        capture.Extractor.low_priority = False
    records = read_jsonl(spec["data"])[: spec["samples"]]
    out, work = Path(spec["out"]), Path(spec["work"])
    jobs = staged_shards(
        records,
        spec["shards"],
        [str(out / f"shard_{i:05d}.safetensors") for i in range(spec["shards"])],
        [str(out / f"shard_{i:05d}.json") for i in range(spec["shards"])],
        work,
        spec["label"],
    )
    server = VLLMServer(model=spec["target"], log_path=spec["log"], port=spec["port"])
    stats: dict = {}
    with Wrapped() as wrapped:
        start, cpu = time.perf_counter(), own_cpu_s()
        metas = capture_shards(
            cfg, spec["info"], jobs, work, spec["log"], server=server, stats=stats
        )
        wall, cpu = time.perf_counter() - start, own_cpu_s() - cpu
    shutil.rmtree(out)
    return {
        "path_wall_s": wall,
        "path_cpu_s": cpu,
        "parts_s": stats.get("parts_s") or wrapped.parts(),
        "parts_from": "stage" if stats.get("parts_s") else "wrapped functions",
        "sha256": [m["sha256"] for m in metas],
        "teacher_agreement": [m["teacher"]["agreement"] for m in metas],
        "mean_logprob": [m["teacher"]["mean_logprob"] for m in metas],
    }


def through_eaglet(server, spec: dict, src: Path, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out: dict = {}
    with measured(server, out):
        done = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
        )
    if done.returncode:
        raise RuntimeError(f"the eaglet path with {src} failed:\n{done.stderr[-4000:]}")
    out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    out["tokens_per_s"] = tokens / out["path_wall_s"]  # its imports and set-up left out
    return out


# -- the measures --------------------------------------------------------------------------


def bench_config(path: str) -> dict:
    cfg = load(path)
    cfg["extract"] = {**cfg["extract"], "backend": "vllm", "min_teacher_agreement": 0.0}
    return cfg


def run_bare(cfg, args, seqs, warm, tokens, logs: Path) -> dict:
    """A plain server as vLLM serves by default (its prefix cache on: the capture server's
    is off, every token's states are needed), warmed up on ``warm`` (other sequences, so
    that none of the measured ones is cached whole)."""
    target = dict(cfg["target"])
    target["max_model_len"] = max(target["max_model_len"], cfg["extract"]["max_len"] + 1)
    log_path = logs.with_name(logs.name + ".bare.server.log")
    with target_server(cfg, args.target, log_path, target=target) as server:
        asyncio.run(send_all(server.url, prefill_payloads(warm, None), 4, 600))

        def bare():
            out = {"server_start_s": server.ready_after_s}
            with measured(server, out):
                asyncio.run(
                    send_all(
                        server.url,
                        prefill_payloads(seqs, None),
                        cfg["extract"]["concurrency"],
                        3600,
                    )
                )
            out["tokens_per_s"] = tokens / out["wall_s"]
            return out

        return clean_measure(bare, server)


def run_capture_server(
    cfg, args, codes: dict[str, Path], seqs, warm, tokens, info, work: Path, logs: Path, round_: int
) -> dict[str, dict]:
    layers = num_layers(args.target)
    aux_ids = resolve_aux_layer_ids(cfg["extract"]["aux_layer_ids"], layers)
    captures = work / "captures"
    captures.mkdir(parents=True, exist_ok=True)
    log_path = logs.with_name(logs.name + ".capture.server.log")
    server = capture_server(
        cfg, args.target, capture_layer_ids(aux_ids, layers), work / "requests", log_path
    )
    results = {}
    with server:
        asyncio.run(send_all(server.url, prefill_payloads(warm, captures), 4, 600))
        clear_captures(captures)

        def capture_only():
            out = {}
            with measured(server, out):
                asyncio.run(
                    send_all(
                        server.url,
                        prefill_payloads(seqs, captures),
                        cfg["extract"]["concurrency"],
                        3600,
                    )
                )
            out["tokens_per_s"] = tokens / out["wall_s"]
            clear_captures(captures)
            return out

        def eaglet(code: str):
            spec = {
                "config": args.config,
                "normal_priority": args.normal_priority,
                "data": args.data,
                "samples": args.samples,
                "shards": args.shards,
                "target": args.target,
                "info": info,
                "port": server.port,
                "log": str(log_path),
                "work": str(work),
                "out": str(work / f"out-{code}"),
                "label": f"{code}{round_}",
            }
            return lambda: through_eaglet(server, spec, codes[code], tokens)

        steps = [("capture", capture_only)] + [(f"eaglet {c}", eaglet(c)) for c in codes]
        for name, step in reversed(steps) if round_ % 2 else steps:
            results[name] = clean_measure(step, server)
            results[name]["server_start_s"] = server.ready_after_s
    return results


def num_layers(target: str) -> int:
    return text_config(read_target_config(Path(target)))["num_hidden_layers"]


def summarize(runs: list[dict], bare_best: float | None) -> dict:
    rates = [r["tokens_per_s"] for r in runs]
    out = {
        "tokens_per_s_best": max(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_median": statistics.median(rates),
        "server_cores_busy": [r["server_cpu_s"] / r["wall_s"] for r in runs],
        "eaglet_cpu_s": [r["eaglet_cpu_s"] for r in runs],
        "others_cpu_s": [r["others_cpu_s"] for r in runs],
        "runs": runs,
    }
    if bare_best:
        out["over_bare_best"] = max(rates) / bare_best
        out["over_bare_median"] = statistics.median(rates) / bare_best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="the target's HF directory")
    parser.add_argument("--data", help="synthetic/train.jsonl")
    parser.add_argument(
        "--config",
        default=str(ROOT / "config.yaml"),
        help="the run's config (target and server settings, extract section)",
    )
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument(
        "--shards",
        type=int,
        default=2,
        help="shards the samples are packed into (the demo: about 62 a shard)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before-src", help="a source tree (its src/) to measure beside this one")
    parser.add_argument("--label", default="side by side", help="the name of this run's results")
    parser.add_argument(
        "--normal-priority",
        action="store_true",
        help="the packing thread at the normal priority (A/B of that choice)",
    )
    parser.add_argument("--out", default=str(OUT), help="results go to OUT.json and OUT.md")
    parser.add_argument(
        "--patience",
        type=float,
        default=120.0,
        help="seconds a measure waits for the machine to be quiet",
    )
    parser.add_argument(
        "--tries",
        type=int,
        default=2,
        help="times a measure is taken while other work shares the machine",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global PATIENCE_S, TRIES
    PATIENCE_S, TRIES = args.patience, args.tries
    if args.worker:
        print(json.dumps(eaglet_worker(json.loads(args.worker))))
        return
    if not (args.target and args.data):
        parser.error("--target and --data are needed")
    args.target, args.data = str(Path(args.target).resolve()), str(Path(args.data).resolve())
    args.config = str(Path(args.config).resolve())
    out = Path(args.out)
    codes = {"after": ROOT / "src"}
    if args.before_src:
        codes = {"before": Path(args.before_src).resolve(), **codes}

    cfg = bench_config(args.config)
    everything_read = read_jsonl(args.data)
    records = everything_read[: args.samples]
    seqs = [sequence(r, cfg["extract"]["max_len"])[0] for r in records]
    warm = [
        sequence(r, cfg["extract"]["max_len"])[0]
        for r in (everything_read[args.samples : args.samples + 4] or records[:4])
    ]
    tokens = sum(map(len, seqs))
    info = {"spec": "benchmark", "path": args.target, **model_identity(Path(args.target))}
    runs: dict[str, list[dict]] = defaultdict(list)
    logs = out.parent / out.name  # the servers' logs: OUT.bare.server.log, OUT.capture...
    logs.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            work = Path(tmp) / f"work{round_}"
            steps = [
                lambda: {"bare": run_bare(cfg, args, seqs, warm, tokens, logs)},
                lambda work=work, round_=round_: run_capture_server(
                    cfg, args, codes, seqs, warm, tokens, info, work, logs, round_
                ),
            ]
            for step in reversed(steps) if round_ % 2 else steps:
                for name, result in step().items():
                    runs[name].append(result)
            print(
                f"round {round_}: "
                + ", ".join(f"{name} {r[-1]['tokens_per_s']:.0f}" for name, r in runs.items())
                + " tokens/s",
                flush=True,
            )
    best_bare = max(r["tokens_per_s"] for r in runs["bare"])
    result = {
        "samples": len(records),
        "tokens": tokens,
        "shards": args.shards,
        "loss_tokens": sum(sum(sequence(r, cfg["extract"]["max_len"])[1]) for r in records),
        "concurrency": cfg["extract"]["concurrency"],
        "target_dtype": cfg["target"]["dtype"],
        "shard_dtype": cfg["extract"]["dtype"],
        "cores": os.cpu_count(),
        "low_priority": not args.normal_priority,
        "rounds": args.rounds,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measures": {
            name: summarize(r, None if name == "bare" else best_bare) for name, r in runs.items()
        },
        "same_shards": {
            name: len({tuple(x["sha256"]) for x in r}) == 1
            for name, r in runs.items()
            if name.startswith("eaglet")
        },
    }
    if len(codes) > 1:
        result["same_shards"]["across code versions"] = (
            len(
                {
                    tuple(x["sha256"])
                    for name, r in runs.items()
                    if name.startswith("eaglet")
                    for x in r
                }
            )
            == 1
        )
    path = out.with_suffix(".json")
    everything = read_json(path) if path.exists() else {}
    everything[args.label] = result
    write_json(path, everything)
    write_tables(out.with_suffix(".md"), table(everything))
    print(table(everything))


MARK = "<!-- the tables below are written by benchmarks/extract_vllm_profile.py -->"


def write_tables(path: Path, tables: str) -> None:
    """The tables go below MARK in ``path``; what a person wrote above it stays."""
    head = path.read_text().split(MARK)[0] if path.exists() else ""
    path.write_text(f"{head}{MARK}\n\n{tables}")


def table(everything: dict) -> str:
    lines = [
        "| run | measure | tokens/s best | spread (min-median) | x bare (best) | "
        "server cores busy | eaglet CPU s | other processes' CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, result in everything.items():
        for name, m in result["measures"].items():
            lines.append(
                f"| {label} | {name} | {m['tokens_per_s_best']:.0f} | "
                f"{m['tokens_per_s_min']:.0f}-{m['tokens_per_s_median']:.0f} | "
                f"{m.get('over_bare_best', 1.0):.2f} | "
                f"{', '.join(f'{c:.2f}' for c in m['server_cores_busy'])} | "
                f"{', '.join(f'{c:.0f}' for c in m['eaglet_cpu_s'])} | "
                f"{', '.join(f'{c:.0f}' for c in m['others_cpu_s'])} |"
            )
    lines += [
        "",
        "Eaglet's side per part, wall seconds of each round:",
        "",
        "| run | measure | part | seconds |",
        "|---|---|---|---|",
    ]
    for label, result in everything.items():
        for name, m in result["measures"].items():
            parts = defaultdict(list)
            for run in m["runs"]:
                for part, seconds in (run.get("parts_s") or {}).items():
                    parts[part].append(seconds)
            for part, seconds in sorted(parts.items(), key=lambda kv: -max(kv[1])):
                lines.append(
                    f"| {label} | {name} | {part} | {', '.join(f'{s:.1f}' for s in seconds)} |"
                )
    lines += [
        "",
        "| run | samples | tokens | loss tokens | shards | the same shards |",
        "|---|---|---|---|---|---|",
    ]
    for label, result in everything.items():
        same = ", ".join(f"{k}: {v}" for k, v in result["same_shards"].items())
        lines.append(
            f"| {label} | {result['samples']} | {result['tokens']} | "
            f"{result['loss_tokens']} | {result['shards']} | {same} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
