"""Held-out simulated AL per CPU-minute: which data and training recipe buys the most.

Trains one drafter per variant on the shards of a finished run and tabulates, for each, the
held-out simulated acceptance length of the drafter training ships (its best held-out
evaluation: the drafter's top-1 agreement with the target chained over the TTT steps, on the
run's held-out samples) against the CPU time it cost: training
measured here, generation and extraction of its share of the data charged at the rates the
run itself measured (``synthetic/stats.json``, ``progress/extract_*.json``).

A variant is ``{"name": ..., "shards": N, "train": {...}}``: the first N training shards (each
a contiguous block of samples: 1 of 4 is a quarter of the prompts) and train settings over
the run's own; ``{"name": ..., "from_run": true}`` reads the run's own training instead of
training it again; ``"other": true`` adds every training shard of the run given with
``--other-results`` (e.g. one trained on recorded answers, ``answers: dataset``), scored on
the first run's held-out split. Run, after a workflow run has written its shards:

    .venv/bin/python benchmarks/recipe.py --results results --variants benchmarks/recipe_demo.json

Rows are appended to benchmarks/results/recipe.json and the table is rendered as recipe.md.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import time
from pathlib import Path

from eaglet.core.config import validate
from eaglet.core.io import read_json, write_json
from eaglet.stages.train.loop import train

OUT = Path(__file__).parent / "results"


def data_cost_s(results: Path, shards: int, total_shards: int) -> dict:
    """CPU seconds the first ``shards`` shards' data cost to generate and extract, from the
    run's own measurements (generation wall time scales with the share of samples)."""
    stats = read_json(results / "synthetic" / "stats.json")
    share = shards / total_shards
    generate_s = stats["this_run"]["wall_s"] * share
    extract_s = 0.0
    for i in range(shards):
        progress = results / "progress" / f"extract_{i:05d}.json"
        if progress.exists():
            extract_s += read_json(progress)["elapsed_s"]
    for one_job in ("extract_vllm.json", "extract_all.json"):  # one job wrote every shard
        if (results / "progress" / one_job).exists():
            extract_s += read_json(results / "progress" / one_job)["elapsed_s"] * share
    return {"generate_s": generate_s, "extract_s": extract_s}


def _log_rows(training_log: Path) -> list[dict]:
    with open(training_log, newline="") as handle:
        return list(csv.DictReader(handle))


def _last_rows(training_log: Path) -> dict:
    rows = _log_rows(training_log)
    return {
        split: next(r for r in reversed(rows) if r["split"] == split) for split in ("train", "eval")
    }


def shipped_held_out(metrics: dict, training_log: Path) -> dict:
    """The held-out ``acc_0`` and ``sim_al`` of the drafter training shipped: the best
    held-out evaluation's (``metrics["shipped"]``, as stats.json holds it), which need not
    be the last, so scoring the last would understate a recipe whose held-out curve turned.
    A training without ``shipped`` (trained before training chose) gives its last evaluation."""
    shipped = metrics.get("shipped") or {}
    if shipped.get("heldout_al") is None:
        return metrics["eval"]
    row = next(
        (
            r
            for r in _log_rows(training_log)
            if r["split"] == "eval" and int(r["step"]) == shipped["step"]
        ),
        metrics["eval"],
    )
    return {**row, "sim_al": shipped["heldout_al"]}


def training_shards(results: Path) -> list[str]:
    return sorted(glob.glob(str(results / "hidden" / "shard_*.safetensors")))


def run_variant(
    results: Path, variant: dict, base_train: dict, out_root: Path, other: Path | None = None
) -> dict:
    """Train the variant (or, with ``from_run``, read the run's own training: its recipe
    trained once already) and measure what it cost. ``"other": true``: every training shard
    of the ``other`` run as well (its data charged at that run's own rates), held out and
    scored on this run's split and vocabulary."""
    shards = training_shards(results)
    eval_shards = sorted(glob.glob(str(results / "hidden" / "eval" / "shard_*.safetensors")))
    used = shards[: variant.get("shards", len(shards))]
    extra = []
    if variant.get("other"):
        if other is None:
            raise SystemExit(
                f"variant {variant['name']!r} trains on another run's shards too: "
                f"give that run with --other-results"
            )
        extra = training_shards(other)
    if variant.get("from_run"):
        progress = read_json(results / "progress" / "train.json")
        training_log = results / "drafter" / "training_log.csv"
        stats = results / "drafter" / "stats.json"
        metrics = {
            **_last_rows(training_log),
            "steps": progress["done"],
            "shipped": read_json(stats).get("shipped") if stats.exists() else None,
        }
        train_s = progress["elapsed_s"]
    else:
        cfg = {**base_train, **variant.get("train", {}), "resume": False}
        run_dir = out_root / variant["name"].replace(" ", "_").replace(",", "")
        start = time.perf_counter()
        metrics = train(
            cfg,
            used + extra,
            eval_shards,
            str(results / "vocab" / "vocab_map.safetensors"),
            str(results / "target"),
            str(run_dir / "drafter"),
            str(run_dir / "checkpoints"),
            None,
            None,
        )
        train_s = time.perf_counter() - start
        training_log = run_dir / "drafter" / "training_log.csv"
    cost = data_cost_s(results, len(used), len(shards))
    if extra:
        more = data_cost_s(other, len(extra), len(extra))
        cost = {key: cost[key] + more[key] for key in cost}
    held_out = shipped_held_out(metrics, training_log)
    shipped = metrics.get("shipped") or {}
    total_s = train_s + cost["generate_s"] + cost["extract_s"]
    return {
        "name": variant["name"],
        "shards": f"{len(used)}/{len(shards)}" + (f" + {len(extra)} other" if extra else ""),
        "train": variant.get("train", {}),
        "steps": metrics["steps"],
        "shipped": shipped.get("choice", "last"),
        "shipped_epoch": shipped.get("epoch"),
        "train_min": train_s / 60,
        "data_min": (cost["generate_s"] + cost["extract_s"]) / 60,
        "total_min": total_s / 60,
        "held_out_acc_0": float(held_out["acc_0"]),
        "held_out_sim_al": float(held_out["sim_al"]),
        "train_sim_al": float(metrics["train"]["sim_al"]),
        "sim_al_gain_per_cpu_hour": (float(held_out["sim_al"]) - 1) / (total_s / 3600),
    }


def render(rows: list[dict]) -> str:
    lines = [
        "# Held-out simulated AL per CPU-minute (data and training recipe)",
        "",
        "Each row is one training run on the shards of a finished workflow run; data "
        "minutes are the generation and extraction time of the shards it used, as that "
        "run measured them. Gain per CPU-hour = (held-out sim AL - 1) / total hours. "
        "Minutes carry the machine's load while each ran: compare rows measured together.",
        "",
        "| variant | shards | train settings | steps | data min | train min | total min "
        "| held-out acc_0 | held-out sim AL | train sim AL | gain / CPU-hour |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['shards']} | `{json.dumps(r['train'])}` | {r['steps']} | "
            f"{r['data_min']:.1f} | {r['train_min']:.1f} | {r['total_min']:.1f} | "
            f"{r['held_out_acc_0']:.3f} | {r['held_out_sim_al']:.3f} | {r['train_sim_al']:.3f} "
            f"| {r['sim_al_gain_per_cpu_hour']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="a finished run's results dir")
    parser.add_argument("--variants", required=True, help="JSON file: a list of variants")
    parser.add_argument("--only", nargs="*", help="run just these variant names")
    parser.add_argument("--out", default=str(OUT / "recipe"), help="run directories")
    parser.add_argument(
        "--other-results",
        help='a second finished run whose training shards variants with "other": true add',
    )
    args = parser.parse_args()
    results = Path(args.results)
    run_cfg = validate(read_json(results / "run" / "config.json"))
    base_train = {k: v for k, v in run_cfg["train"].items() if k != "gpus"}
    table_path = OUT / "recipe.json"
    rows = read_json(table_path) if table_path.exists() else []
    for variant in json.loads(Path(args.variants).read_text()):
        if args.only and variant["name"] not in args.only:
            continue
        row = run_variant(
            results,
            variant,
            base_train,
            Path(args.out),
            Path(args.other_results) if args.other_results else None,
        )
        print(json.dumps(row))
        rows = [r for r in rows if r["name"] != row["name"]] + [row]
        write_json(table_path, rows)
        (OUT / "recipe.md").write_text(render(rows))


if __name__ == "__main__":
    main()
