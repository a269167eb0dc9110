"""Training on states streamed from vLLM (``train.data: stream``) beside shard mode, one run.

On the first ``--samples`` training samples of a finished run's ``synthetic/train.jsonl``
(its target, vocabulary map and held-out shard), in turn and each with a server of its own:

* shards: the ``vllm`` extraction of those samples into ``--shards`` shards
  (``extract_vllm.capture_shards``), then training on them;
* stream, once per ``--cache-gib`` value and ``--overlap`` value: training with
  ``train.data: stream``, that ``train.stream_cache_gib`` (0: every epoch asks the engine
  again) and that ``train.stream_overlap`` (false: the server and the trainer take turns).

Training uses the run's ``train`` settings with ``--epochs``. Each measure: wall seconds
(the server's start included, once in each), the peak bytes on disk of its hidden states
(shards, staged shards and request files, sampled every 0.2 s), the shipped drafter's
held-out simulated AL, and for stream mode the trainer's and the server's idle shares (the
trainer waiting for states, the started server with no request in flight).

    .venv/bin/python benchmarks/stream_train.py --results results --configfile config.yaml \\
        [--samples 120] [--epochs 2] [--cache-gib 0 4] [--overlap auto true false] \\
        [--out stream_train]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from eaglet.core.config import load
from eaglet.core.io import read_json, read_jsonl, write_json, write_jsonl
from eaglet.stages.extract import vllm as extract_vllm
from eaglet.stages.train.loop import settings, train

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


class PeakDisk:
    """The largest total size of the files under ``root`` seen while it runs."""

    def __init__(self, root: Path):
        self.root, self.peak = root, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _size(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
        return total

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self._size())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._size())


def heldout_al(summary: dict) -> float | None:
    shipped = summary.get("shipped") or {}
    return shipped.get("heldout_al")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True)
    parser.add_argument("--configfile", default=str(ROOT / "config.yaml"))
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--cache-gib", type=float, nargs="+", default=[0.0])
    parser.add_argument("--overlap", nargs="+", default=["auto"], choices=["auto", "true", "false"])
    parser.add_argument(
        "--out",
        default="stream_train",
        help="the results' name in benchmarks/results (.json and .md)",
    )
    args = parser.parse_args()

    results = Path(args.results)
    cfg = load(args.configfile)
    cfg["extract"]["num_shards"] = args.shards
    info = read_json(results / "target" / "target.json")
    records = read_jsonl(results / "synthetic" / "train.jsonl")[: args.samples]
    tokens = sum(
        min(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]), cfg["extract"]["max_len"])
        for r in records
    )
    train_cfg = {k: v for k, v in cfg["train"].items() if k != "gpus"}
    train_cfg.update(epochs=args.epochs, max_steps=None)
    eval_shards = [str(results / "hidden" / "eval" / "shard_00000.safetensors")]
    vocab = str(results / "vocab" / "vocab_map.safetensors")
    rows = []
    with tempfile.TemporaryDirectory(prefix="eaglet-stream-bench-") as tmp:
        tmp = Path(tmp)
        data = tmp / "train.jsonl"
        write_jsonl(data, records)

        # shards: extraction, then training
        hidden = tmp / "shards"
        paths = [hidden / f"shard_{i:05d}.safetensors" for i in range(args.shards)]
        jobs = extract_vllm.staged_shards(
            records,
            args.shards,
            [str(p) for p in paths],
            [str(p.with_suffix(".json")) for p in paths],
            hidden / "vllm",
            "train",
        )
        started = time.monotonic()
        with PeakDisk(hidden) as disk:
            extract_vllm.capture_shards(cfg, info, jobs, hidden / "vllm", tmp / "shards.server.log")
            extracted = time.monotonic() - started
            summary = train(
                train_cfg,
                [str(p) for p in paths],
                eval_shards,
                vocab,
                info["path"],
                out_dir=str(tmp / "shards_drafter"),
                checkpoint_dir=str(tmp / "shards_ckpt"),
                progress_path=None,
                log_path=None,
            )
        rows.append(
            {
                "mode": "shards",
                "seconds": round(time.monotonic() - started, 1),
                "extract_s": round(extracted, 1),
                "peak_disk_bytes": disk.peak,
                "heldout_al": heldout_al(summary),
                "steps": summary["steps"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)

        for cache, overlap in [(c, o) for c in args.cache_gib for o in args.overlap]:
            overlap = {"true": True, "false": False}.get(overlap, overlap)
            name = f"stream_{cache:g}_{str(overlap).lower()}"
            work = tmp / name
            (work / "requests").mkdir(parents=True)
            started = time.monotonic()
            with PeakDisk(work) as disk:
                summary = train(
                    {
                        **train_cfg,
                        "data": "stream",
                        "stream_cache_gib": cache,
                        "stream_overlap": overlap,
                    },
                    [],
                    eval_shards,
                    vocab,
                    info["path"],
                    out_dir=str(tmp / f"{name}_drafter"),
                    checkpoint_dir=str(tmp / f"{name}_ckpt"),
                    progress_path=None,
                    log_path=None,
                    stream={
                        "cfg": cfg,
                        "target_json": str(results / "target" / "target.json"),
                        "data": str(data),
                        "work_dir": str(work),
                        "server_log": str(tmp / "stream.server.log"),
                    },
                )
            seconds = time.monotonic() - started
            stream = summary["stream"]
            start = stream["server_start_s"] or 0.0
            rows.append(
                {
                    "mode": "stream",
                    "cache_gib": cache,
                    "overlap": stream["overlap"],
                    "seconds": round(seconds, 1),
                    "peak_disk_bytes": disk.peak,
                    "heldout_al": heldout_al(summary),
                    "steps": summary["steps"],
                    "trainer_idle_share": round(
                        max(stream["trainer_wait_s"] - start, 0) / seconds, 3
                    ),
                    "server_idle_share": round(
                        stream["server_idle_s"] / max(seconds - start, 1e-9), 3
                    ),
                    "stream": stream,
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    base = rows[0]
    for row in rows[1:]:
        row["time_ratio"] = round(row["seconds"] / base["seconds"], 3)
        row["disk_ratio"] = round(row["peak_disk_bytes"] / base["peak_disk_bytes"], 4)
        row["al_difference"] = (
            None
            if row["heldout_al"] is None or base["heldout_al"] is None
            else round(row["heldout_al"] - base["heldout_al"], 4)
        )
    # the command as a user reruns it in a checkout: the run's directory by its own name
    argv = [Path(a).name if a in (args.results, args.configfile) else a for a in sys.argv[1:]]
    report = {
        "command": " ".join(["benchmarks/stream_train.py", *argv]),
        "samples": len(records),
        "tokens": tokens,
        "epochs": args.epochs,
        "shards": args.shards,
        "train": settings(train_cfg),
        "rows": rows,
    }
    out = RESULTS / args.out
    write_json(out.with_suffix(".json"), report)
    lines = [
        f"# Stream mode beside shard mode ({len(records)} samples, {tokens} tokens, "
        f"{args.epochs} epochs, one run)",
        "",
        f"`{report['command']}`",
        "",
        "| mode | cache GiB | overlap | seconds | x shards | peak disk | x shards | "
        "held-out AL | trainer idle | server idle |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row.get('cache_gib', '-')} | "
            f"{str(row.get('overlap', '-')).lower()} | {row['seconds']:.0f} | "
            f"{row.get('time_ratio', 1.0):.2f} | {row['peak_disk_bytes'] / 1e6:.1f} MB | "
            f"{row.get('disk_ratio', 1.0):.3f} | "
            f"{row['heldout_al'] if row['heldout_al'] is None else format(row['heldout_al'], '.3f')}"
            f" | {row.get('trainer_idle_share', '-')} | {row.get('server_idle_share', '-')} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
