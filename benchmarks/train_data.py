"""The training data path on its own: shards to packed micro-batches in float32, before and
after shards were memory-mapped and batches built ahead.

* ``eager``: what training did before: every shard read whole, hashed over those bytes and
  widened to float32 (``shards.load``), all of them held; each micro-batch packed in the loop
  (``make_batch``) from float32 slices.
* ``mapped``: ``train_data.Samples`` over memory-mapped shards (hashed once in blocks, then
  mapped; pages given back past ``train.host_ram_mb``), micro-batches packed in the stored
  dtype in the loop and widened per micro-batch (``Batch.to``).
* ``mapped+prefetch``: the same, packed ahead by ``train_data.Prefetcher`` (2 deep).

Each path runs in a fresh interpreter over one epoch of ``pack_epoch`` (shuffled, seeded):
the startup (index, and the hash check or the load), the epoch's tokens/s with no model step
(and with the startup: an eager load widens everything before the first batch),
and again with an emulated step that waits ``--step-ms`` per micro-batch as a loop waits on a
GPU (where packing ahead pays); peak RSS is the process's own (``ru_maxrss``), its growth
above the interpreter with torch imported, and the batches of all paths are checked equal.
Synthetic sets: bf16 states of random samples (50-600 tokens); ``smollm2``: hidden 576, 3 aux
layers, 50K tokens in 4 shards (the demo's size); ``large``: hidden 2048, 80K tokens in 4.

    .venv/bin/python benchmarks/train_data.py [--sets smollm2,large] [--step-ms 30]

Results: benchmarks/results/train_data.json and train_data.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglet.core.io import write_json
from eaglet.data import shards
from eaglet.stages.train.data import (
    Prefetcher,
    Samples,
    data_memory,
    index_shard,
    make_batch,
    pack_epoch,
)

OUT = Path(__file__).parent / "results"
AUX_IDS = [2, 15, 27]
VOCAB = 49152
SETS = {
    "smollm2": {"hidden": 576, "tokens": 50_000, "shards": 4},
    "large": {"hidden": 2048, "tokens": 80_000, "shards": 4},
}
CFG = {
    "seed": 0,
    "shuffle": True,
    "shards_in_memory": 0,
    "max_len": 2048,
    "max_tokens_per_batch": 2048,
    "ttt_steps": 7,
    "prefetch_batches": 2,
    "host_ram_mb": 256,
}
PATHS = ["eager", "mapped", "mapped+prefetch"]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write_set(directory: Path, hidden: int, tokens: int, count: int) -> list[tuple[str, str]]:
    """``count`` bf16 shards of random samples, ~tokens in all; (path, sha256) each. The
    states are one random block reused, so writing needs little memory."""
    g = torch.Generator().manual_seed(hidden)
    block = torch.randn(4096, 4 * hidden, generator=g).to(torch.bfloat16)
    out = []
    for s in range(count):
        lengths, left = [], tokens // count
        while left > 0:
            lengths.append(min(left, int(torch.randint(50, 600, (1,), generator=g))))
            left -= lengths[-1]
        n = sum(lengths)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        starts = torch.randint(0, 4096 - 600, (len(lengths),), generator=g).tolist()
        aux = [block[a : a + n_, : 3 * hidden] for a, n_ in zip(starts, lengths)]
        final = [block[a : a + n_, 3 * hidden :] for a, n_ in zip(starts, lengths)]
        mask = torch.ones(n, dtype=torch.uint8)
        path = shards.shard_path(directory, s)
        written = shards.write(
            path,
            torch.randint(0, VOCAB, (n,), generator=g),
            mask,
            offsets,
            torch.randint(0, VOCAB, (n,), generator=g),
            aux,
            final,
            sample_ids=[f"s{s}-{i}" for i in range(len(lengths))],
            aux_layer_ids=AUX_IDS,
            dtype="bfloat16",
            target={"spec": "benchmark"},
        )
        out.append((str(path), written.sha256))
    return out


class EagerSamples:
    """The former ``Samples`` with every shard in memory: ``shards.load`` (read whole,
    hashed over those bytes, widened to float32) of each, at startup."""

    def __init__(self, infos):
        self.infos, self.lengths = infos, [n for info in infos for n in info.lengths]
        self.first = [0]
        for info in infos[:-1]:
            self.first.append(self.first[-1] + len(info.lengths))
        self.shard_of = [s for s, info in enumerate(infos) for _ in info.lengths]
        self.loaded = [shards.load(info.path, info.sha256) for info in infos]

    def __len__(self):
        return len(self.lengths)

    def get(self, index, max_len):
        number = self.shard_of[index]
        shard, local = self.loaded[number], index - self.first[number]
        rows = shard.sample(local)
        rows = slice(rows.start, min(rows.stop, rows.start + max_len))
        return (
            shard.sample_ids[local],
            shard.input_ids[rows],
            shard.loss_mask[rows],
            shard.teacher_argmax[rows],
            shard.aux_hidden[rows],
            shard.final_hidden[rows],
        )


def child(args) -> None:
    listing = json.loads(Path(args.listing).read_text())
    cpu, t2d = torch.device("cpu"), torch.arange(VOCAB) < 32000
    base = peak_rss()
    start = time.perf_counter()
    infos = [index_shard(path, VOCAB, sha) for path, sha in listing]
    if args.child == "eager":
        samples = EagerSamples(infos)
    else:
        samples = Samples(infos, CFG["shards_in_memory"], data_memory(CFG, infos))
        samples.preload()  # every shard hash-checked, as training does with shards_in_memory 0
    startup = time.perf_counter() - start
    plan = pack_epoch(samples, 0, CFG)
    pack = lambda indices: make_batch(
        [samples.get(i, CFG["max_len"]) for i in indices],  # noqa: E731
        CFG["ttt_steps"],
        t2d,
    )
    result = {"startup_s": startup, "batches": len(plan)}
    digest = hashlib.sha256()
    for label, step_s in (("data", 0.0), ("with_step", args.step_ms / 1000)):
        feed = (
            Prefetcher(pack, ((i, m) for i, m in enumerate(plan)), CFG["prefetch_batches"])
            if args.child == "mapped+prefetch"
            else None
        )
        tokens, start = 0, time.perf_counter()
        for i, indices in enumerate(plan):
            batch = (feed.take(i) if feed else pack(indices)).to(cpu)  # widened to float32
            tokens += batch.num_tokens
            if label == "data" and i % 7 == 0:  # a sample of the batches, to compare paths
                digest.update(batch.aux[::97].numpy().tobytes())
                digest.update(batch.final[::97].numpy().tobytes())
                digest.update(batch.step_ids.numpy().tobytes())
            del batch
            if step_s:
                time.sleep(step_s)  # the device's step: the loop waits, a thread may pack
        elapsed = time.perf_counter() - start
        if feed:
            feed.close()
        result[f"{label}_tokens_per_s"] = tokens / elapsed
        result[f"{label}_s"] = elapsed
    result.update(
        tokens=tokens,
        batches_sha256=digest.hexdigest(),
        peak_rss=peak_rss(),
        extra_peak=peak_rss() - base,
        page_releases=getattr(getattr(samples, "memory", None), "releases", None),
    )
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="smollm2,large")
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--listing", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    rows = []
    for name in args.sets.split(","):
        spec = SETS[name]
        with tempfile.TemporaryDirectory(dir=OUT) as tmp:  # on the disk results go to
            listing = write_set(Path(tmp), spec["hidden"], spec["tokens"], spec["shards"])
            (Path(tmp) / "listing.json").write_text(json.dumps(listing))
            disk = sum(Path(p).stat().st_size for p, _ in listing)
            got = {}
            for _ in range(args.rounds):  # alternated, the fastest of each kept: a shared
                for path in PATHS:  # machine's load moves between runs
                    cmd = [
                        sys.executable,
                        __file__,
                        "--child",
                        path,
                        "--listing",
                        str(Path(tmp) / "listing.json"),
                        "--step-ms",
                        str(args.step_ms),
                    ]
                    r = json.loads(
                        subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    )
                    r["first_epoch_tokens_per_s"] = r["tokens"] / (r["startup_s"] + r["data_s"])
                    if path in got:
                        for key in ("startup_s", "data_s", "with_step_s"):
                            r[key] = min(r[key], got[path][key])
                        for key in (
                            "data_tokens_per_s",
                            "with_step_tokens_per_s",
                            "first_epoch_tokens_per_s",
                        ):
                            r[key] = max(r[key], got[path][key])
                    got[path] = r
        if len({r["batches_sha256"] for r in got.values()}) != 1:
            raise SystemExit(f"{name}: the paths packed different batches")
        for path, r in got.items():
            rows.append(
                {
                    "set": name,
                    "hidden": spec["hidden"],
                    "tokens": r["tokens"],
                    "shards_mb": disk / 1e6,
                    "path": path,
                    "startup_s": r["startup_s"],
                    "data_tokens_per_s": r["data_tokens_per_s"],
                    "first_epoch_tokens_per_s": r["first_epoch_tokens_per_s"],
                    "with_step_tokens_per_s": r["with_step_tokens_per_s"],
                    "peak_rss_mb": r["peak_rss"] / 1e6,
                    "extra_peak_mb": r["extra_peak"] / 1e6,
                    "page_releases": r["page_releases"],
                }
            )
        eager = got["eager"]
        for r in rows[-len(PATHS) :]:
            r["rss_growth_vs_eager"] = r["extra_peak_mb"] / (eager["extra_peak"] / 1e6)
            r["data_rate_vs_eager"] = r["data_tokens_per_s"] / eager["data_tokens_per_s"]
            r["first_epoch_rate_vs_eager"] = (
                r["first_epoch_tokens_per_s"] / eager["first_epoch_tokens_per_s"]
            )
            r["with_step_rate_vs_eager"] = (
                r["with_step_tokens_per_s"] / eager["with_step_tokens_per_s"]
            )
    device = (
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    write_json(
        OUT / "train_data.json",
        {
            "device": device,
            "step_ms": args.step_ms,
            "rounds": args.rounds,
            "cfg": CFG,
            "rows": rows,
        },
    )
    columns = list(rows[0])
    lines = [
        "# Training data path: eager float32 shards (before) against mapped shards, "
        "with and without the prefetcher",
        "",
        f"{device}; bf16 shards; one shuffled epoch of micro-batches of "
        f"{CFG['max_tokens_per_batch']} tokens, TTT {CFG['ttt_steps']}, widened to float32 "
        f"as the step reads them. startup = index + hash check (+ load and widening, eager); "
        f"data = packing alone; first_epoch = startup and packing; with_step = each micro-batch "
        f"followed by a {args.step_ms:g} ms wait standing in for the device's step. "
        f"extra_peak = peak RSS above the interpreter with torch imported; host_ram_mb "
        f"{CFG['host_ram_mb']}. Fastest of {args.rounds} alternated runs per path. Every path "
        f"packed the same batches (hashed).",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += [
        "| "
        + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in columns)
        + " |"
        for r in rows
    ]
    (OUT / "train_data.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
