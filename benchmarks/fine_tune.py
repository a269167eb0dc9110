"""Start from a published drafter, fine-tune it on your own traffic, prove the gain.

No drafter is published for the embedded SmolLM2 target, so one is made the way the field
makes them and handed over the way users get them: the demo's recipe trained on everyday
chat only (ShareGPT, recorded answers) and exported in the speculators format. Then, on code
prompts (HumanEval, answered by the target), three drafters are measured in one evaluation,
on the same prompts, rounds and machine moments:

- ``start_k3``: the starting drafter as published (it never saw code);
- ``eagle3_k3``: that drafter fine-tuned by eaglet on the code data (``train.init_from`` the
  speculators export, ``--epochs`` epochs);
- ``eagle3_3_k3``: one trained from scratch on the same code data, the same epochs (the same
  steps: the same minutes), its own vocabulary map from that data.

Each is a real workflow run through the real vLLM CPU server (``--root`` holds them: start/,
scratch/, tuned/). The held-out split is code (the domain the start never saw); ``everyday``
is the chat the start was trained on. Run (about an hour on 2 cores)::

    .venv/bin/python benchmarks/fine_tune.py --root bench-fine-tune

Writes benchmarks/results/fine_tune.{json,md}, dated with the commit and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eaglet.core.io import read_json, write_json
from eaglet.model.export import export_speculators
from eaglet.target.checkpoint import read_target

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results"
SNAKEMAKE = Path(sys.executable).parent / "snakemake"


def config(root: Path, name: str, epochs: int, **changes) -> Path:
    """The demo's config.yaml with ``changes`` (section -> settings), results in root/name."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["results_dir"] = str(root / name)
    cfg["train"]["epochs"] = epochs
    for section, settings in changes.items():
        cfg[section] = (
            {**cfg.get(section, {}), **settings} if isinstance(settings, dict) else settings
        )
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def snakemake(config_path: Path, target: str, cores: int) -> float:
    """Run the workflow to ``target``; its wall seconds."""
    started = time.monotonic()
    subprocess.run(
        [
            str(SNAKEMAKE),
            target,  # before --configfile, which takes every word after it
            "--cores",
            str(cores),
            "--workflow-profile",
            "profiles/default",
            "--configfile",
            str(config_path),
        ],
        cwd=REPO,
        check=True,
    )
    return time.monotonic() - started


def link_data(source: Path, dest: Path, parts: tuple[str, ...]) -> None:
    """``dest`` reuses ``source``'s finished ``parts`` (hard links): the same data, not made
    again."""
    dest.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if (source / part).is_dir() and not (dest / part).exists():
            shutil.copytree(source / part, dest / part, copy_function=os.link)


def commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    chat = [{"type": "sharegpt", "limit": 330, "max_prompt_chars": 1000, "answers": "dataset"}]
    code = [{"type": "humaneval", "limit": 164}]
    serving = {"ngram": False, "schedule": False}
    walls = {}

    # 1. the "published" drafter: everyday chat only, handed over in the speculators format
    start_cfg = config(root, "start", 4, data={"sources": chat})
    walls["start"] = snakemake(
        start_cfg, str(root / "start" / "drafter" / "model.safetensors"), args.cores
    )
    published = root / "start_speculators"
    if published.exists():
        shutil.rmtree(published)
    target = read_target(root / "start" / "target" / "target.json")["path"]
    export_speculators(root / "start" / "drafter", published, target, 3)

    # 2. from scratch on the code data (its own vocabulary from it), trained first: the
    # fine-tune's evaluation serves it beside the others
    scratch_cfg = config(root, "scratch", args.epochs, data={"sources": code})
    walls["scratch"] = snakemake(
        scratch_cfg, str(root / "scratch" / "drafter" / "model.safetensors"), args.cores
    )

    # 3. the fine-tune on the same code data (its prompts and answers linked), evaluated with
    # the start (served as published) and the scratch drafter beside it
    link_data(root / "scratch", root / "tuned", ("target", "prompts", "synthetic"))
    tuned_cfg = config(
        root,
        "tuned",
        args.epochs,
        data={"sources": code},
        train={"init_from": str(published)},
        evaluate={**serving, "compare_drafters": [str(root / "scratch" / "drafter")]},
    )
    walls["tuned"] = snakemake(
        tuned_cfg, str(root / "tuned" / "eval" / "acceptance.json"), args.cores
    )

    acceptance = read_json(root / "tuned" / "eval" / "acceptance.json")
    labels = {
        str(root / "tuned" / "start_drafter"): "start (as published, chat only)",
        str(root / "tuned" / "drafter"): "fine-tuned by eaglet on code",
        str(root / "scratch" / "drafter"): "from scratch on the same code data",
    }
    rows = []
    for row in acceptance["methods"]:
        run = next(r for r in acceptance["runs"] if r["name"] == row["name"])
        what = labels.get(
            str(Path(row["drafter"]).resolve()) if row.get("drafter") else "", row["name"]
        )
        rows.append(
            {
                "name": row["name"],
                "what": what,
                "acceptance_length": row["acceptance_length"],
                "sets": {s: v["acceptance_length"] for s, v in run["sets"].items()},
                "speedup": {
                    c["concurrency"]: [
                        c.get("speedup"),
                        c.get("speedup_low"),
                        c.get("speedup_high"),
                    ]
                    for c in row.get("by_concurrency", [])
                },
            }
        )
    stats = {
        name: read_json(root / name / "drafter" / "stats.json") for name in ("scratch", "tuned")
    }
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU only)",
        "command": f"benchmarks/fine_tune.py --root {args.root} --epochs {args.epochs}",
        "epochs": args.epochs,
        "wall_s": walls,
        "rows": rows,
        "train_elapsed_s": {n: s.get("elapsed_s") for n, s in stats.items()},
        "heldout_sim_al": {n: s["shipped"]["heldout_al"] for n, s in stats.items()},
        "start_format": read_json(root / "tuned" / "start_drafter" / "start.json")["format"],
        "vocab": read_json(root / "tuned" / "vocab" / "stats.json"),
    }
    OUT.mkdir(exist_ok=True)
    write_json(OUT / "fine_tune.json", result)
    (OUT / "fine_tune.md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    sets = sorted({s for row in r["rows"] for s in row["sets"]})
    lines = [
        "# Fine-tuning a published drafter on your own traffic\n",
        f"Date {r['date']}, commit {r['commit']}, machine: {r['machine']}. Command: "
        f"`{r['command']}`.\n",
        "One evaluation on code prompts (HumanEval; `heldout` is the code held-out split, "
        "`everyday` the chat the start was trained on), greedy, k = 3, every drafter "
        "served side by side. The start was published in the "
        f"{r['start_format']} layout and read from it.\n",
        "| drafter | AL | "
        + " | ".join(f"AL {s}" for s in sets)
        + " | speedup by concurrency [95% interval] |",
        "|---|---|" + "---|" * len(sets) + "---|",
    ]
    for row in r["rows"]:
        speed = "; ".join(
            f"c={c}: {v[0]:.2f}x [{v[1]:.2f}, {v[2]:.2f}]"
            if v[1] is not None
            else f"c={c}: {v[0]:.2f}x"
            for c, v in row["speedup"].items()
            if v[0] is not None
        )
        lines.append(
            f"| {row['what']} (`{row['name']}`) | {row['acceptance_length']:.3f} | "
            + " | ".join(f"{row['sets'].get(s, float('nan')):.3f}" for s in sets)
            + f" | {speed} |"
        )
    lines += [
        "",
        "Held-out simulated AL at training's end: "
        + ", ".join(f"{n} {v:.3f}" for n, v in r["heldout_sim_al"].items())
        + "; training seconds: "
        + ", ".join(f"{n} {v:.0f}" for n, v in r["train_elapsed_s"].items() if v)
        + f". The start's vocabulary covers {100 * r['vocab']['coverage']:.1f}% of the "
        f"code answers' tokens, a map of its size from them "
        f"{100 * r['vocab']['coverage_of_a_map_from_this_data']:.1f}%.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
