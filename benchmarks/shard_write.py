"""Writing one hidden-state shard: ``shards.write`` against a plain write of the same bytes.

Three ways to put the same shard on disk, alternated in one run (``--repeats`` rounds, the
order rotated each round) so that the machine's drift hits them alike:

* ``plain``: the shard's bytes, already in memory, written to a file and fsynced: the floor;
* ``serial``: the writer as it was before the block digest: row blocks cast and written in
  order, the file's sha256 updated by the writing thread itself, fsync, rename;
* ``shards.write``: row blocks cast and written, every 8 MiB block of the file digested by a
  pool of threads once written (its writeback started then too), fsync, rename.

The input states are random, held in bf16 as per-sequence pieces of 500 tokens, as
extraction hands them over. The goal (issue: the GPU stages at the hardware's speed) is
``shards.write`` at >= 0.9x the plain write's rate for bf16 shards. Results:
benchmarks/results/shard_write.json and .md.

    .venv/bin/python benchmarks/shard_write.py [--tokens 100000] [--hidden 576] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eaglet.core.io import atomic_open, write_json
from eaglet.data import shards

OUT = Path(__file__).parent / "results"
AUX_IDS = [2, 15, 27]
SAMPLE_TOKENS = 500  # tokens per synthetic sequence (extraction's per-sequence pieces)


def inputs(tokens: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = [SAMPLE_TOKENS] * (tokens // SAMPLE_TOKENS)
    if tokens % SAMPLE_TOKENS:
        lengths.append(tokens % SAMPLE_TOKENS)
    aux = [torch.empty(n, 3 * hidden, dtype=torch.bfloat16).normal_(generator=g) for n in lengths]
    final = torch.empty(tokens, hidden, dtype=torch.bfloat16).normal_(generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return {
        "input_ids": torch.randint(0, 50_000, (tokens,), generator=g),
        "loss_mask": torch.ones(tokens, dtype=torch.uint8),
        "offsets": offsets,
        "teacher_argmax": torch.randint(-1, 50_000, (tokens,), generator=g),
        "aux_rows": aux,
        "final": final,
        "sample_ids": [f"p-{i:06d}" for i in range(len(lengths))],
    }


def write_shard(path: Path, x: dict, dtype: str) -> str:
    return shards.write(
        path,
        x["input_ids"],
        x["loss_mask"],
        x["offsets"],
        x["teacher_argmax"],
        x["aux_rows"],
        x["final"],
        sample_ids=x["sample_ids"],
        aux_layer_ids=AUX_IDS,
        dtype=dtype,
        target={"spec": "benchmark"},
    ).sha256


def write_serial(path: Path, data: bytes, block: int = shards.CHUNK_BYTES // 2) -> str:
    """The former writer's disk side on the same bytes: write a block, hash it in the same
    thread, the next block; fsync; rename. (Its casting of the blocks is left out: the
    states are bf16 already, so the cast was a no-op.)"""
    digest = hashlib.sha256()
    view = memoryview(data)
    with atomic_open(path, "wb") as handle:
        for at in range(0, len(view), block):
            handle.write(view[at : at + block])
            digest.update(view[at : at + block])
    return digest.hexdigest()


def write_plain(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def measure(dtype: str, args, directory: Path) -> dict:
    x = inputs(args.tokens, args.hidden)
    reference = directory / "reference.safetensors"
    digest = write_shard(reference, x, dtype)
    data = reference.read_bytes()
    reference.unlink()
    if shards.digest_bytes(data) != digest:
        raise SystemExit(f"{dtype}: the writer's digest is not its file's")
    paths = {
        "plain": lambda p: write_plain(p, data),
        "serial": lambda p: write_serial(p, data),
        "shards.write": lambda p: write_shard(p, x, dtype),
    }
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for round_ in range(args.repeats):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            path = directory / f"{name}.bin"
            start = time.perf_counter()
            paths[name](path)
            seconds[name].append(time.perf_counter() - start)
            if args.verify and path.read_bytes() != data:
                raise SystemExit(f"{dtype}: {name} wrote other bytes")
            path.unlink()
    rate = {name: [len(data) / s / 1e9 for s in values] for name, values in seconds.items()}
    row = {
        "dtype": dtype,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "file_mb": len(data) / 1e6,
        "repeats": args.repeats,
    }
    for name in names:
        row[f"{name} GB/s"] = statistics.median(rate[name])
        row[f"{name} GB/s range"] = f"{min(rate[name]):.2f}-{max(rate[name]):.2f}"
    ratios = [p / w for p, w in zip(seconds["plain"], seconds["shards.write"])]
    row["shards.write / plain"] = statistics.median(ratios)
    row["/ plain range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
    row["shards.write / serial"] = statistics.median(
        s / w for s, w in zip(seconds["serial"], seconds["shards.write"])
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dtypes", default="bfloat16,fp8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--verify", action="store_true", help="compare every file's bytes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:  # on the disk results go to
        rows = [measure(dtype, args, Path(tmp)) for dtype in args.dtypes.split(",")]
    device = (
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
        f"{shards._hash_threads()} digest threads"
    )
    write_json(OUT / "shard_write.json", {"device": device, "rows": rows})
    columns = list(rows[0])
    lines = [
        "# Writing one shard: shards.write against a plain write of the same bytes",
        "",
        f"{device}; the shard's states held in bf16 as per-sequence pieces of "
        f"{SAMPLE_TOKENS} tokens. Rates are the medians of {args.repeats} rounds (ranges "
        "beside them), the three ways alternated; every way fsyncs. plain: the bytes "
        "written from memory; serial: the former writer (write and sha256 in one thread); "
        "shards.write: block digests on a pool of threads beside the writes. fp8 also "
        "quantizes its states, which plain and serial do not.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += [
        "| "
        + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in columns)
        + " |"
        for r in rows
    ]
    (OUT / "shard_write.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
