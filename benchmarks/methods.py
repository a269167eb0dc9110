"""Drafter methods side by side on one finished run's data: each trained on the same shards in a
results dir of its own, all served in one evaluation beside the run's own drafter.

For each ``--method`` (``peagle``, ``dflash``, ``dflash:2`` for two DFlash layers, ``eagle31``
for EAGLE-3.1) a sibling results dir ``<results>-<label>`` gets the finished run's data as hard
links (prompts, answers, vocabulary, target, hidden states; not its drafter or evaluation) and
trains that drafter (``train.method``, ``train.dflash_layers``, ``train.drafter_variant``);
then ``<results>-methods`` links the run with its own drafter and evaluates it with
``evaluate.compare_drafters`` naming the others (ngram and the k schedule off: the drafters are
what is compared). Every drafter is replayed offline as its own and checked against vLLM.

    .venv/bin/python benchmarks/methods.py [--results results] [--configfile config.yaml] \\
        [--method peagle --method dflash --method dflash:2] [--cores 2]

About 35 minutes on 2 cores for the demo and these three. The table (AL pooled and per
request, per prompt set, acceptance per position, speedup with its interval and ms per step
at each concurrency, training minutes, offline replay against vLLM) is written to
benchmarks/results/methods_dflash.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from eaglet.core.io import read_json, write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
NOT_LINKED = ("drafter", "drafter_checkpoints", "eval", "logs", "run")


def method_settings(spec: str) -> tuple[str, dict]:
    """``spec`` (``dflash:2``) as a label and the train settings it sets."""
    name, _, layers = spec.partition(":")
    if name == "eagle31":
        return name, {"drafter_variant": "eagle3.1"}
    if name not in ("eagle3", "peagle", "dflash"):
        raise SystemExit(f"--method {spec}: one of eagle3, eagle31, peagle, dflash[:layers]")
    settings = {"method": name}
    if layers:
        settings["dflash_layers"] = int(layers)
    return name + (f"{layers}" if layers else ""), settings


def linked_copy(results: Path, to: Path, skip: tuple[str, ...]) -> None:
    """``results`` in ``to`` as hard links (mtimes kept, so nothing upstream reruns)."""
    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    for part in results.iterdir():
        if part.name in skip:
            continue
        if part.is_dir():
            shutil.copytree(part, to / part.name, copy_function=os.link)
        else:
            os.link(part, to / part.name)


def snakemake(config: dict, target: str, cores: int, where: Path) -> None:
    path = where / "benchmark_config.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "--cores",
        str(cores),
        "--configfile",
        str(path),
        "--rerun-triggers",
        "mtime",
        "--",
        target,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def table(acceptance: dict) -> list[dict]:
    """The methods table of one evaluation with what the README shows of each row."""
    runs = {r["name"]: r for r in acceptance["runs"]}
    offline = acceptance.get("offline") or {}
    rows = []
    for row in acceptance["methods"]:
        run, check = runs[row["name"]], offline.get(row["name"]) or {}
        rows.append(
            {
                **{
                    k: row[k]
                    for k in (
                        "name",
                        "kind",
                        "drafter",
                        "compared",
                        "k",
                        "acceptance_length",
                        "acceptance_length_per_request",
                        "per_position_rate",
                        "by_concurrency",
                        "training_minutes",
                    )
                },
                "sets": {
                    name: {
                        k: s.get(k)
                        for k in ("acceptance_length", "acceptance_length_per_request", "drafts")
                    }
                    for name, s in (run.get("sets") or {}).items()
                },
                "offline": {
                    k: check.get(k)
                    for k in (
                        "acceptance_length",
                        "vllm_acceptance_length",
                        "ratio_offline_over_vllm",
                        "drafts",
                        "agrees",
                    )
                },
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    fmt = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    concurrencies = [c["concurrency"] for c in rows[0]["by_concurrency"]]
    head = [
        "drafter",
        "training",
        "AL pooled (per request)",
        "heldout / everyday",
        "accepted at positions",
        *[f"concurrency {c} (ms/step, alone)" for c in concurrencies],
        "offline AL (vLLM's)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sets = " / ".join(fmt(s["acceptance_length"], 3) for s in r["sets"].values())
        speed = [
            f"{fmt(c['speedup'])}x [{fmt(c['speedup_low'])}, {fmt(c['speedup_high'])}] "
            f"({fmt(c['step_ms'], 1)}, {fmt(c['target_step_ms'], 1)})"
            for c in r["by_concurrency"]
        ]
        o = r["offline"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["kind"] + ("" if r["compared"] else " (the run's)"),
                    f"{fmt(r['training_minutes'], 1)} min",
                    f"{fmt(r['acceptance_length'], 3)} ({fmt(r['acceptance_length_per_request'], 3)})",
                    sets,
                    " ".join(fmt(x) for x in r["per_position_rate"]),
                    *speed,
                    f"{fmt(o['acceptance_length'], 4)} ({fmt(o['vllm_acceptance_length'], 4)})",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="a finished run (default results)")
    parser.add_argument("--configfile", default=str(ROOT / "config.yaml"))
    parser.add_argument(
        "--method",
        action="append",
        default=None,
        help="peagle, dflash, dflash:LAYERS, eagle31 (repeatable; default "
        "peagle, dflash, dflash:2)",
    )
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--out", default=str(OUT / "methods_dflash"))
    args = parser.parse_args()
    results = Path(args.results).resolve()
    base = yaml.safe_load(Path(args.configfile).read_text()) or {}
    compared = []
    for spec in args.method or ["peagle", "dflash", "dflash:2"]:
        label, settings = method_settings(spec)
        where = results.with_name(f"{results.name}-{label}")
        linked_copy(results, where, NOT_LINKED)
        cfg = copy.deepcopy(base)
        cfg["results_dir"] = str(where)
        cfg.setdefault("train", {}).update(settings)
        snakemake(cfg, str(where / "drafter" / "model.safetensors"), args.cores, where)
        compared.append(str(where / "drafter"))
    where = results.with_name(f"{results.name}-methods")
    linked_copy(results, where, ("eval", "logs", "run"))
    cfg = copy.deepcopy(base)
    cfg["results_dir"] = str(where)
    cfg.setdefault("evaluate", {}).update(ngram=False, schedule=False, compare_drafters=compared)
    snakemake(cfg, str(where / "eval" / "acceptance.json"), args.cores, where)
    acceptance = read_json(where / "eval" / "acceptance.json")
    rows = table(acceptance)
    write_json(
        Path(args.out + ".json"),
        {"results": str(results), "methods": rows, "verdict": acceptance["verdict"]["summary"]},
    )
    Path(args.out + ".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
