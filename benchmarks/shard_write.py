"""Writing one hidden-state shard: the streaming writer against the former in-memory path.

* ``old``: what extraction did before :func:`eaglet.shards.write`: concatenate the
  per-sequence aux states, cast (or quantize) every tensor, encode the whole shard with
  ``safetensors.torch.save``, rewrite its header with sorted metadata, write the bytes
  atomically, then hash them in a separate pass;
* ``new``: ``shards.write`` on the same per-sequence states (header from the shapes, row
  blocks cast or quantized and streamed to the file while hashing).

Each path runs in a fresh interpreter on the same synthetic shard (random states in bf16,
as a bf16 target gives them), so its peak resident memory is its own: the table gives the
peak above what holding the input states took, and the wall time of the write alone. Both
paths must produce the same bytes (the sha256s are compared).

    .venv/bin/python benchmarks/shard_write.py [--tokens 50000] [--hidden 576]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save

from eaglet import shards
from eaglet.io import atomic_open, write_json

OUT = Path(__file__).parent / "results"
AUX_IDS = [2, 15, 27]
SAMPLE_TOKENS = 500  # tokens per synthetic sequence (extraction's per-sequence pieces)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def inputs(tokens: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = [SAMPLE_TOKENS] * (tokens // SAMPLE_TOKENS)
    if tokens % SAMPLE_TOKENS:
        lengths.append(tokens % SAMPLE_TOKENS)
    aux = [torch.empty(n, 3 * hidden, dtype=torch.bfloat16).normal_(generator=g) for n in lengths]
    final = torch.empty(tokens, hidden, dtype=torch.bfloat16).normal_(generator=g)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return {"input_ids": torch.randint(0, 50_000, (tokens,), generator=g),
            "loss_mask": torch.ones(tokens, dtype=torch.uint8), "offsets": offsets,
            "teacher_argmax": torch.randint(-1, 50_000, (tokens,), generator=g),
            "aux_rows": aux, "final": final, "sample_ids": [f"p-{i:06d}" for i in range(len(lengths))]}


def old_write(path: Path, x: dict, dtype: str) -> str:
    """The former path, step by step as it was."""
    aux_all = torch.cat(x["aux_rows"])
    tensors = {"input_ids": x["input_ids"].to(torch.int64).contiguous(),
               "loss_mask": x["loss_mask"].to(torch.uint8).contiguous(),
               "offsets": x["offsets"].to(torch.int64).contiguous(),
               "teacher_argmax": x["teacher_argmax"].to(torch.int64).contiguous()}
    if dtype == "fp8":
        tensors["aux_hidden"], tensors["aux_scale"] = shards.quantize_fp8(aux_all, len(AUX_IDS))
        tensors["final_hidden"], tensors["final_scale"] = shards.quantize_fp8(x["final"], 1)
    else:
        tensors["aux_hidden"] = aux_all.to(shards.STORAGE_DTYPES[dtype]).contiguous()
        tensors["final_hidden"] = x["final"].to(shards.STORAGE_DTYPES[dtype]).contiguous()
    data = save(tensors, metadata=metadata(x, dtype))
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    data = data[:8] + text.ljust(n, b" ") + data[8 + n:]
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return hashlib.sha256(data).hexdigest()


def metadata(x: dict, dtype: str) -> dict:
    return {"format": shards.FORMAT, "dtype": dtype, "hidden_size": str(x["final"].shape[1]),
            "aux_layer_ids": json.dumps(AUX_IDS), "sample_ids": json.dumps(x["sample_ids"]),
            "target": json.dumps({"spec": "benchmark"}, sort_keys=True)}


def new_write(path: Path, x: dict, dtype: str) -> str:
    return shards.write(path, x["input_ids"], x["loss_mask"], x["offsets"], x["teacher_argmax"],
                        x["aux_rows"], x["final"], sample_ids=x["sample_ids"],
                        aux_layer_ids=AUX_IDS, dtype=dtype, target={"spec": "benchmark"}).sha256


def child(args) -> None:
    x = inputs(args.tokens, args.hidden)
    held = peak_rss()
    path = Path(args.dir) / f"{args.child}_{args.dtype}.safetensors"
    start = time.perf_counter()
    sha = (old_write if args.child == "old" else new_write)(path, x, args.dtype)
    wall = time.perf_counter() - start
    state_bytes = sum(t.nbytes for t in x["aux_rows"]) + x["final"].nbytes
    print(json.dumps({"wall_s": wall, "peak_rss": peak_rss(), "input_rss": held,
                      "extra_peak": peak_rss() - held, "state_bytes": state_bytes,
                      "file_bytes": path.stat().st_size, "sha256": sha}))
    path.unlink()


def run(path: str, dtype: str, args, directory: str) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--dtype", dtype, "--dir", directory,
           "--tokens", str(args.tokens), "--hidden", str(args.hidden)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dtypes", default="bfloat16,fp8")
    parser.add_argument("--child", choices=["old", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    rows = []
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:  # on the disk results go to
        for dtype in args.dtypes.split(","):
            old, new = run("old", dtype, args, tmp), run("new", dtype, args, tmp)
            if old["sha256"] != new["sha256"]:
                raise SystemExit(f"{dtype}: the two paths wrote different bytes")
            rows.append({"dtype": dtype, "tokens": args.tokens, "hidden": args.hidden,
                         "states_mb": old["state_bytes"] / 1e6, "file_mb": new["file_bytes"] / 1e6,
                         "old_s": old["wall_s"], "new_s": new["wall_s"],
                         "old_over_new_time": old["wall_s"] / new["wall_s"],
                         "old_extra_peak_mb": old["extra_peak"] / 1e6,
                         "new_extra_peak_mb": new["extra_peak"] / 1e6,
                         "old_peak_rss_mb": old["peak_rss"] / 1e6,
                         "new_peak_rss_mb": new["peak_rss"] / 1e6})
    device = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    write_json(OUT / "shard_write.json", {"device": device, "rows": rows})
    columns = list(rows[0])
    lines = ["# Writing one shard: streaming writer (new) against encode + write + hash (old)", "",
             f"{device}; input states held in bf16 as per-sequence pieces of {SAMPLE_TOKENS} "
             "tokens; extra peak = peak RSS of the write above the RSS holding the inputs; "
             "peak RSS = the process's whole peak (inputs included). Both paths wrote the same "
             "bytes.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                                for c in columns) + " |" for r in rows]
    (OUT / "shard_write.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
