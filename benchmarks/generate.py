"""Generation throughput: eaglet's client against a bare concurrent client, and the server's
tokens/s at several concurrency levels (the rate `eaglet status` uses for its ETA).

Both clients send the same greedy requests (so the same tokens come back) to the same
running vLLM server, alternating, and the ratio of their tokens/s is reported. Run:

    .venv/bin/python benchmarks/generate.py --target results/target [--prompts 64]

With ``--capture``: what ``generate.capture_hidden_states`` costs generation. Two servers run
side by side, one plain and one with the capture options, and eaglet's client sends the same
greedy ShareGPT requests to each in turn (with capture, every answer waits for its states on
disk, as the stage does); the ratio of their tokens/s goes to capture.json/.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from eaglet.core.config import validate
from eaglet.core.io import write_json
from eaglet.data.prompts import load_source
from eaglet.engine.server import VLLMServer, server_args
from eaglet.stages.generate.answers import Sampling
from eaglet.stages.generate.run import GenerationSettings, generate

OUT = Path(__file__).parent / "results"


async def bare_client(url: str, prompts: list[dict], sampling: Sampling, concurrency: int) -> int:
    """The least a client can do: concurrent POSTs, count the tokens, keep nothing."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def one(prompt):
            async with gate:
                resp = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "target",
                        "messages": prompt["messages"],
                        "temperature": sampling.temperature,
                        "top_p": sampling.top_p,
                        "max_tokens": sampling.max_tokens,
                        "seed": sampling.seed,
                        "return_token_ids": True,
                    },
                )
                resp.raise_for_status()
                return resp.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def time_bare(url, prompts, sampling, concurrency) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = asyncio.run(bare_client(url, prompts, sampling, concurrency))
    return time.perf_counter() - start, tokens


def time_eaglet(url, prompts, sampling, concurrency, capture_dir=None) -> tuple[float, int]:
    settings = GenerationSettings(
        base_url=url,
        sampling=sampling,
        concurrency=concurrency,
        request_timeout_s=600,
        max_retries=0,
        model_name="target",
        capture_dir=capture_dir,
    )
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        records = generate(prompts, settings, Path(tmp) / "partial.jsonl")
        elapsed = time.perf_counter() - start
    return elapsed, sum(len(r["completion_token_ids"]) for r in records.values())


def sharegpt_setup(args, memory_utilization: float) -> tuple[dict, list[dict], Sampling]:
    """A float32 eager CPU server's config, ``args.prompts`` ShareGPT first turns (pasted
    documents skipped, as the demo does) and greedy sampling of ``args.max_tokens``."""
    cfg = validate(
        {
            "target": {"dtype": "float32"},
            "server": {"memory_utilization": memory_utilization, "enforce_eager": True},
        }
    )
    prompts, _ = load_source(
        {"type": "sharegpt", "limit": args.prompts * 2, "max_prompt_chars": 1000}
    )
    return (
        cfg,
        prompts[: args.prompts],
        Sampling(temperature=0.0, top_p=1.0, max_tokens=args.max_tokens, seed=0),
    )


def capture_cost(args) -> None:
    """Plain and capturing servers side by side, the same requests to each in turn."""
    import shutil

    from eaglet.stages.generate.stage import capture_options

    cfg, prompts, sampling = sharegpt_setup(args, memory_utilization=0.2)
    work = Path(tempfile.mkdtemp(prefix="capture-"))
    plain_args = server_args(cfg["target"], cfg["server"], "target")
    runs = {"plain": [], "capture": []}
    try:
        with (
            VLLMServer(
                model=args.target, log_path=OUT / "capture.plain.server.log", args=plain_args
            ) as plain,
            VLLMServer(
                model=args.target,
                log_path=OUT / "capture.server.log",
                args=plain_args
                + capture_options(
                    {"extract": {"aux_layer_ids": None}}, args.target, str(work / "states")
                ),
            ) as capturing,
        ):
            for url in (plain.url, capturing.url):
                time_bare(url, prompts[:8], sampling, 8)  # warm-up
            for _ in range(args.repeats):
                for name, url in (("plain", plain.url), ("capture", capturing.url)):
                    states = str(work / "states") if name == "capture" else None
                    elapsed, tokens = time_eaglet(
                        url, prompts, sampling, args.concurrency, capture_dir=states
                    )
                    runs[name].append(
                        {"tokens": tokens, "s": elapsed, "tokens_per_s": tokens / elapsed}
                    )
            saved = sum(f.stat().st_size for f in (work / "states").glob("*.safetensors"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {name: max(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    result = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "runs": runs,
        "ratio_capture_over_plain": best["capture"] / best["plain"],
        "states_bytes_last_run": saved,
    }
    write_json(OUT / "capture.json", result)
    lines = [
        f"{len(prompts)} ShareGPT prompts, greedy, {args.max_tokens} tokens, concurrency "
        f"{args.concurrency}; best of {args.repeats} runs per server, alternating",
        "",
        "| server | tokens/s |",
        "|---|---|",
    ]
    lines += [f"| {name} | {rate:.1f} |" for name, rate in best.items()]
    lines += [
        "",
        f"capture / plain = {result['ratio_capture_over_plain']:.3f}; states saved "
        f"per run: {saved / 2**20:.0f} MiB (float32)",
    ]
    (OUT / "capture.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cpu_cores(args) -> None:
    """Default CPU server against one that computes on every core, one at a time."""
    cfg, prompts, sampling = sharegpt_setup(args, memory_utilization=0.25)
    single = Sampling(temperature=0.0, top_p=1.0, max_tokens=64, seed=0)
    env = {
        "default": dict(os.environ),
        "every core": {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    }
    env["default"].pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    runs: dict[str, list] = {name: [] for name in env}
    for name in ("default", "every core", "every core", "default"):
        log_path = OUT / f"cpu_cores.{name.replace(' ', '_')}.server.log"
        with VLLMServer(
            model=args.target,
            log_path=log_path,
            env=env[name],
            args=server_args(cfg["target"], cfg["server"], "target"),
        ) as server:
            time_bare(server.url, prompts[:4], single, 4)  # warm-up
            elapsed, tokens = time_bare(server.url, prompts, sampling, args.concurrency)
            one_s, one_tokens = time_bare(server.url, prompts[:4], single, 1)
            runs[name].append(
                {
                    "ready_s": server.ready_after_s,
                    f"tokens_per_s_at_{args.concurrency}": tokens / elapsed,
                    "tokens_per_s_at_1": one_tokens / one_s,
                }
            )
        print(name, runs[name][-1], flush=True)
    keys = [f"tokens_per_s_at_{args.concurrency}", "tokens_per_s_at_1", "ready_s"]
    best = {
        name: {k: (min if k == "ready_s" else max)(r[k] for r in rs) for k in keys}
        for name, rs in runs.items()
    }
    result = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "runs": runs,
        "best": best,
        "ratios": {k: best["every core"][k] / best["default"][k] for k in keys},
    }
    write_json(OUT / "cpu_cores.json", result)
    lines = [
        f"vLLM CPU engine, {os.cpu_count()} CPUs, SmolLM2-135M float32: {len(prompts)} "
        f"ShareGPT prompts greedy at concurrency {args.concurrency} ({args.max_tokens} "
        "tokens), 4 of them one at a time (64 tokens); best of 2 servers each, order "
        "A B B A",
        "",
        f"| server | tokens/s at {args.concurrency} | tokens/s at 1 | ready after (s) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {b[keys[0]]:.1f} | {b[keys[1]]:.1f} | {b[keys[2]]:.0f} |"
        for name, b in best.items()
    ]
    lines += [
        "",
        "every core / default: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()),
    ]
    (OUT / "cpu_cores.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--capture",
        action="store_true",
        help="measure generate.capture_hidden_states against plain generation",
    )
    parser.add_argument(
        "--cpu-cores",
        action="store_true",
        help="measure vLLM's CPU engine computing on every core against its "
        "default (one core kept for its scheduler)",
    )
    args = parser.parse_args()
    if args.capture:
        return capture_cost(args)
    if args.cpu_cores:
        return cpu_cores(args)

    cfg = validate({"server": {"memory_utilization": 0.4}})
    prompts, _ = load_source({"type": "humaneval", "limit": args.prompts})
    sampling = Sampling(temperature=0.0, top_p=1.0, max_tokens=args.max_tokens, seed=0)
    log_path = OUT / "generate.server.log"
    with VLLMServer(
        model=args.target,
        log_path=log_path,
        args=server_args(cfg["target"], cfg["server"], "target"),
    ) as server:
        time_bare(server.url, prompts[:8], sampling, 8)  # warm-up
        runs = {"bare": [], "eaglet": []}
        for _ in range(args.repeats):
            for name, fn in (("bare", time_bare), ("eaglet", time_eaglet)):
                elapsed, tokens = fn(server.url, prompts, sampling, args.concurrency)
                runs[name].append(tokens / elapsed)
        levels = {}
        for level in (int(x) for x in args.levels.split(",")):
            subset = prompts[: max(level * 2, 8)]
            elapsed, tokens = time_bare(server.url, subset, sampling, level)
            levels[level] = {
                "requests": len(subset),
                "tokens": tokens,
                "tokens_per_s": tokens / elapsed,
            }
    best = {name: max(rates) for name, rates in runs.items()}
    result = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "tokens_per_s": runs,
        "ratio_eaglet_over_bare": best["eaglet"] / best["bare"],
        "server_tokens_per_s_by_concurrency": levels,
    }
    write_json(OUT / "generate.json", result)
    lines = ["| client | tokens/s (best of %d) |" % args.repeats, "|---|---|"]
    lines += [f"| {name} | {rate:.1f} |" for name, rate in best.items()]
    lines += [
        "",
        f"eaglet / bare = {result['ratio_eaglet_over_bare']:.3f}",
        "",
        "| concurrency | server tokens/s |",
        "|---|---|",
    ]
    lines += [f"| {c} | {v['tokens_per_s']:.1f} |" for c, v in levels.items()]
    (OUT / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(result["ratio_eaglet_over_bare"]))


if __name__ == "__main__":
    main()
