"""Does a change of code leave the pipeline's results as they were? The tiny config
(tests/configs/tiny.yaml, with the transformers extraction backend) runs through training
in this checkout and in another one (an earlier commit), and the deterministic outputs are
compared: the prompts, the synthetic answers, the vocabulary map, the hidden-state shards and
the trained drafter's weights.

Compared is what each output holds: a JSON-lines file's records in the order of their ids
(generation writes answers as they finish, in no fixed order) without the time each was
generated (``created_at``), a safetensors file's tensors
byte for byte and its metadata without the target's ``path`` (a shard records where the run's
target lies, another directory for each run). Each file's own bytes are compared as well.

    git worktree add ../eaglet-before <commit>
    python benchmarks/same_outputs.py --before ../eaglet-before \\
        --out benchmarks/results/same_outputs.md

Both run with this environment's Python, each with its own ``src`` first on the path, one
after the other (the real vLLM CPU server generates; about 5 minutes each on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

HERE = Path(__file__).resolve().parents[1]
TINY = HERE / "tests" / "configs" / "tiny.yaml"
# the outputs whose bytes follow from the config alone (their .json sidecars carry times)
COMPARED = [
    "prompts/train.jsonl",
    "prompts/eval.jsonl",
    "synthetic/train.jsonl",
    "synthetic/eval.jsonl",
    "vocab/vocab_map.safetensors",
    "hidden/shard_*.safetensors",
    "hidden/eval/shard_*.safetensors",
    "drafter/model.safetensors",
]


def run(tree: Path, work: Path, cores: int) -> Path:
    """The tiny config through training in ``tree``; its results directory."""
    cfg = yaml.safe_load(TINY.read_text())
    cfg["extract"]["backend"] = "hf"
    results = work / "results"
    cfg["results_dir"] = str(results)
    config = work / "tiny_hf.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--cores",
        str(cores),
        str(results / "drafter" / "model.safetensors"),
        "--configfile",
        str(config),
    ]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the tiny run in {tree} failed:\n{done.stderr[-3000:]}")
    return results


# record fields that say when, not what
WHEN = ("created_at",)


def commit(tree: Path) -> str:
    """The checkout's commit, with a + where its files differ from it."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=tree,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+" if dirty else "")


def content(path: Path) -> str:
    """The sha256 of what the file holds (the module's doc says what counts)."""
    digest = hashlib.sha256()
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for record in sorted(records, key=lambda r: r["id"]):
            kept = {k: v for k, v in record.items() if k not in WHEN}
            digest.update(json.dumps(kept, sort_keys=True).encode())
        return digest.hexdigest()
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as handle:
            meta = dict(handle.metadata() or {})
            if "target" in meta:
                meta["target"] = json.dumps(
                    {k: v for k, v in json.loads(meta["target"]).items() if k != "path"},
                    sort_keys=True,
                )
            digest.update(json.dumps(meta, sort_keys=True).encode())
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name)
                digest.update(
                    name.encode() + str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode()
                )
                digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(results: Path) -> dict[str, tuple[str, str]]:
    """Every compared output: (sha256 of its content, sha256 of its bytes)."""
    found = {}
    for pattern in COMPARED:
        paths = sorted(results.glob(pattern))
        if not paths:
            raise SystemExit(f"{results} has no {pattern}")
        for path in paths:
            found[str(path.relative_to(results))] = (
                content(path),
                hashlib.sha256(path.read_bytes()).hexdigest(),
            )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of earlier code")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="markdown table (else stdout)")
    parser.add_argument(
        "--keep", type=Path, default=None, help="run in this directory and keep both runs' results"
    )
    parser.add_argument(
        "--compare-only",
        action="store_true",
        help="compare the runs kept in --keep again, without running",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        found = {}
        for label, tree in (("before", args.before.resolve()), ("now", HERE)):
            (work / label).mkdir(parents=True, exist_ok=True)
            results = (
                work / label / "results"
                if args.compare_only
                else run(tree, work / label, args.cores)
            )
            found[label] = digests(results)
    names = sorted(set(found["before"]) | set(found["now"]))
    missing = ("-", "-")
    pairs = {n: (found["before"].get(n, missing), found["now"].get(n, missing)) for n in names}
    same = [n for n, (before, now) in pairs.items() if before[0] == now[0]]
    same_bytes = [n for n, (before, now) in pairs.items() if before[1] == now[1]]
    lines = [
        f"> Date: {time.strftime('%Y-%m-%d')}. Commit: {commit(HERE)}.  ",
        f"> Machine: {platform.machine()} ({os.cpu_count()} cores, CPU only).  ",
        f"> Command: `python benchmarks/same_outputs.py --before {args.before}"
        + (f" --out {args.out}`" if args.out else "`"),
        "",
        f"The tiny config (extract.backend hf) through training, before "
        f"({commit(args.before.resolve())}) and now ({commit(HERE)}): "
        f"{len(same)} of {len(names)} outputs hold the same content, {len(same_bytes)} "
        f"are the same bytes.",
        "",
        "| output | content before | content now | same content | same bytes |",
        "|---|---|---|---|---|",
    ]
    for name, (before, now) in pairs.items():
        lines.append(
            f"| `{name}` | {before[0][:16]} | {now[0][:16]} | "
            f"{'yes' if before[0] == now[0] else '**no**'} | "
            f"{'yes' if before[1] == now[1] else 'no'} |"
        )
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0 if len(same) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
