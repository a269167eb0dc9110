"""The verdict: does the drafter speed up serving, on the prompts users send, at the
concurrency they serve?

For each engine run (the target alone, vLLM's ``ngram`` speculation, and the trained
drafter at every ``num_speculative_tokens`` k), start vLLM once and, for every
concurrency of the sweep and every prompt set (the held-out split and the configured sets of
their own), send the prompts greedily and read the spec-decode Prometheus counters before and
after (``/metrics`` deltas). Acceptance length is ``1 + accepted/drafts``, acceptance rate
``accepted/draft_tokens``, per-position rate ``per_pos[i]/drafts``: pooled, every drafting
step of every request alike. Beside it, the acceptance length per request: the mean over
requests of each one's own ``1 + accepted/drafts``, from the counts vLLM returns with each
answer (:func:`per_request_acceptance`).

Every level is sent in ``rounds`` rounds; each speedup comes with a 95% interval from the
rounds' own speedups (:func:`speedup_interval`), and the verdict calls a speedup whose interval
holds 1.0 no measurable difference.

Every level is measured at each temperature of ``evaluate.temperature`` through the same
servers (vLLM verifies by rejection sampling above 0), and reported per temperature: a run
measured at T > 0 is named with it (``eagle3_k3_T1``). The last temperature listed is the one
served: the verdict, the k schedule and ``serve.json`` are taken there. The offline replay
checks the greedy runs exactly and the sampled ones by their expected acceptance.

From the sweep comes a batch-size schedule of k (vLLM's
``num_speculative_tokens_per_batch_size``: the best k at each measured concurrency, 0 where
speculation slows serving down), written ready to serve in ``serve.json`` and checked in one
more vLLM run at every concurrency.

The drafter runs are named and served by the method it was trained with (``train.method``,
read from its exported config.json: :func:`drafter_method`): EAGLE-3's ``eagle3_k3``, or
P-EAGLE's ``peagle_k3`` served with ``"parallel_drafting": true`` (:mod:`eaglet.peagle`) and
replayed offline with its one parallel forward per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import struct
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from eaglet import peagle, rates
from eaglet.io import human_size, read_json, read_jsonl, write_json
from eaglet.progress import Progress
from eaglet.plan import (SERVED_BYTES, TargetSize, config_params,  # noqa: F401 (re-exported)
                         target_size)
from eaglet.server import ServerError, start_together, target_server

log = logging.getLogger("eaglet.evaluate")

SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class EvaluationError(RuntimeError):
    pass


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format: metric name -> [(labels, value), ...]."""
    samples: dict[str, list] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            samples[name].append((dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def spec_counters(text: str) -> dict[str, Any]:
    """The spec-decode counters, summed over engines; per-position counts by position."""
    samples = parse_metrics(text)
    counts: dict[str, Any] = {key: sum(v for _, v in samples.get(name, []))
                              for key, name in SPEC_COUNTERS.items()}
    per_pos: dict[int, float] = defaultdict(float)
    for labels, value in samples.get(PER_POSITION, []):
        per_pos[int(labels.get("position", 0))] += value
    counts["per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return counts


def counter_delta(before: dict, after: dict) -> dict:
    delta = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    width = max(len(before["per_position"]), len(after["per_position"]))
    pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
    delta["per_position"] = [a - b for a, b in zip(pad(after["per_position"]),
                                                    pad(before["per_position"]))]
    return delta


def acceptance(delta: dict, k: int | None) -> dict:
    """Acceptance length, rate and per-position rates from counter deltas, pooled over every
    drafting step. None where nothing was drafted, and at k 0: a level where the schedule
    drafts nothing has no acceptance to report, though its counters may hold a few drafts from
    the moments its batch shrank into a range that drafts (the last requests of a round); they
    are kept as counted."""
    drafts, draft_tokens, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted"]
    if not drafts or k == 0:
        return {"k": k, "drafts": int(drafts), "draft_tokens": int(draft_tokens),
                "accepted_tokens": int(accepted), "acceptance_length": None,
                "acceptance_rate": None, "per_position_rate": []}
    return {
        "k": k, "drafts": int(drafts), "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "per_position_rate": [p / drafts for p in delta["per_position"]],
    }


def per_request_acceptance(counts: list[dict | None], k: int | None) -> dict:
    """Acceptance length per request: the mean over requests of each request's own
    ``1 + accepted/drafts``, over the requests that drafted at least once, with how many those
    were (``requests_drafted``). ``counts``: each request's own counts, as vLLM returns them
    with its answer (:data:`PER_REQUEST_METRICS`, :func:`_spec_counts`) or as the offline
    replay counts one sequence; None for a request that came without.

    The pooled acceptance length weighs every drafting step alike, so long answers dominate
    it; this weighs every request alike. None at k 0 (:func:`acceptance`), where no request
    drafted, and where the server returned no per-request counts (the target alone, or a vLLM
    without the flag: ``requests_drafted`` is then None too)."""
    counted = [c for c in counts if c]
    drafted = [c for c in counted if c["drafts"]]
    mean = (sum(1 + c["accepted"] / c["drafts"] for c in drafted) / len(drafted)
            if drafted and k != 0 else None)
    return {"acceptance_length_per_request": mean,
            "requests_drafted": len(drafted) if counted else None}


def _answer_counts(level: dict) -> list[dict | None]:
    """Each answer's own spec-decode counts at one level (None where it came without)."""
    return [a.get("spec_decoding") for a in level["_answers"]]


def _spec_counts(body: dict) -> dict | None:
    """One answer's own spec-decode counts from the response's ``metrics`` (vLLM's
    ``metrics.speculative_decoding``), named as the counters are; None where it has none."""
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if not spec:
        return None
    return {"drafts": spec["num_spec_steps"], "draft_tokens": spec["num_draft_tokens"],
            "accepted": spec["num_accepted_draft_tokens"]}


def read_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


# Sampling pinned to the softmax at the request's temperature, cut only by the run's
# evaluate.top_p and top_k: without these, vLLM fills them from the target's
# generation_config.json (Qwen3's top_k 20 and top_p 0.95, say), and the offline replay's
# target distribution would not be the one vLLM verified against.
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}


def cut(ev: dict) -> dict:
    """The top-p and top-k every sampled evaluation request is served with (evaluate.top_p,
    top_k; 1 and 0: off), which the offline replay's target distribution applies too."""
    return {"top_p": float(ev.get("top_p", 1.0)), "top_k": int(ev.get("top_k", 0))}


def sampling(temperature: float, top_p: float = 1.0, top_k: int = 0) -> dict:
    """The sampling fields of one evaluation request at ``temperature``. Greedy requests keep
    a seed (their answers are the same either way); sampled ones are unseeded, as production
    sends them (a seed sends a request down vLLM's per-request generator path), and cut to
    ``top_p`` and ``top_k``."""
    if not temperature:
        return {"temperature": temperature, **PLAIN_SAMPLING, "seed": 0}
    return {"temperature": temperature, **PLAIN_SAMPLING, "top_p": top_p, "top_k": top_k}


def sampling_text(temperature: float, ev: dict) -> str:
    """How a temperature's requests were sampled, in words: ``temperature 1, top-p 0.95``."""
    parts = [f"temperature {temperature:g}"]
    if temperature:
        c = cut(ev)
        parts += ([f"top-p {c['top_p']:g}"] if c["top_p"] < 1 else []) + (
            [f"top-k {c['top_k']}"] if c["top_k"] else [])
    return ", ".join(parts)


async def _run_prompts(url: str, prompts: list[dict], max_tokens: int, concurrency: int,
                       timeout: float, template_kwargs: dict | None = None,
                       temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0) -> list[dict]:
    extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(prompt: dict) -> dict:
            async with gate:
                start = time.perf_counter()
                resp = await client.post("/v1/chat/completions", json={
                    "model": "target", "messages": prompt["messages"],
                    **sampling(temperature, top_p, top_k),
                    "max_tokens": max_tokens, "return_token_ids": True, **extra})
                if resp.status_code != 200:
                    raise EvaluationError(f"request for {prompt['id']} failed: HTTP "
                                          f"{resp.status_code}: {resp.text[:300]}")
                body = resp.json()
                return {"id": prompt["id"], "latency_s": time.perf_counter() - start,
                        "completion_tokens": body["usage"]["completion_tokens"],
                        "prompt_token_ids": body.get("prompt_token_ids"),
                        "token_ids": body["choices"][0].get("token_ids"),
                        "spec_decoding": _spec_counts(body)}
        return await asyncio.gather(*(one(p) for p in prompts))


# -- prompt sets and the sweep ---------------------------------------------------------------

HELD_OUT = "heldout"
MAX_BATCH = 1 << 16   # the last schedule range runs to here; vLLM caps it at max_num_seqs
# every answer of a speculative run carries its own spec-decode counts (vLLM's
# metrics.speculative_decoding; vLLM refuses the flag without a speculative config)
PER_REQUEST_METRICS = ["--per-request-spec-decode-metrics", "summary"]


def load_prompt_sets(ev: dict, held_out_path: str, train_path: str | None) -> tuple[dict, dict]:
    """The prompt sets to measure on, name -> prompts (each capped at ``max_prompts``), and
    what each is. The held-out split comes first; every configured set follows, less any
    prompt the drafter was trained on."""
    from eaglet.prompts import load_source

    train_ids = {p["id"] for p in read_jsonl(train_path)} if train_path else set()
    sets = {HELD_OUT: read_jsonl(held_out_path)}
    about = {HELD_OUT: {"source": "the held-out split of data.sources"}}
    for entry in ev["prompt_sets"]:
        name = entry["name"]
        if name in sets:
            raise EvaluationError(f"evaluate.prompt_sets: the name {name!r} is used twice "
                                  f"({HELD_OUT!r} is the held-out split's)")
        records, report = load_source(entry["source"])
        kept = [p for p in records if p["id"] not in train_ids]
        sets[name] = kept
        about[name] = {"source": report["label"], "rows": report["rows"], "bad": report["bad"],
                       "in_training_dropped": len(records) - len(kept)}
        if not kept:
            raise EvaluationError(f"evaluate.prompt_sets {name!r}: every prompt is also a "
                                  f"training prompt; measure on prompts the drafter has not seen")
    for name in sets:
        sets[name] = sets[name][:ev["max_prompts"]]
        about[name]["prompts"] = len(sets[name])
    return sets, about


def level_prompts(prompts: list[dict], concurrency: int, rounds: int) -> list[dict]:
    """What one concurrency level sends: ``rounds`` times as many prompts as it keeps in flight
    (the set's first ones), so every level runs at its concurrency for most of its time."""
    return prompts[:rounds * concurrency]


def drafted_k(run: dict, concurrency: int) -> int | None:
    """The k a run drafts at ``concurrency`` requests in flight: a schedule's k for that batch
    size (``num_speculative_tokens_per_batch_size``; 0 where it drafts nothing), else the
    run's own k (None for the target alone)."""
    ranges = (run.get("extra") or {}).get("num_speculative_tokens_per_batch_size")
    if not ranges:
        return run.get("k")
    return next((k for start, end, k in ranges if start <= concurrency <= end), ranges[-1][2])


def drafter_method(drafter_dir: str | os.PathLike | None) -> str:
    """The method the drafter in ``drafter_dir`` was trained with (``train.method``), as its
    exported config.json says: a P-EAGLE export carries ``parallel_drafting``
    (:func:`eaglet.peagle.export_peagle`). EAGLE-3 where no config.json is there yet (the
    plan of a run not trained yet)."""
    if drafter_dir is None or not (Path(drafter_dir) / "config.json").is_file():
        return "eagle3"
    return "peagle" if peagle.is_parallel(drafter_dir) else "eagle3"


def drafter_kind(drafter_dir: str | os.PathLike) -> tuple[str, str, str]:
    """The exported drafter's method, and its method and variant as a run-name label and in
    words: ``("peagle", "peagle", "P-EAGLE")``, ``("eagle3", "eagle31", "EAGLE-3.1")`` where
    its config.json carries the norms of train.drafter_variant eagle3.1, else
    ``("eagle3", "eagle3", "EAGLE-3")``."""
    from eaglet.drafter import DRAFTER_VARIANTS
    from eaglet.export import norm_flags

    method = drafter_method(drafter_dir)
    if method == "eagle3" and Path(drafter_dir, "config.json").is_file():
        flags = norm_flags(read_json(Path(drafter_dir, "config.json")))
        if all(flags[f] == v for f, v in DRAFTER_VARIANTS["eagle3.1"].items()):
            return method, "eagle31", "EAGLE-3.1"
    return method, method, peagle.METHOD_NAMES[method]


def is_drafter(run: dict) -> bool:
    """Whether ``run`` serves the trained drafter (any method), not vLLM's own speculation or
    the target alone."""
    return run["method"] in peagle.METHOD_NAMES


def speculative_config(run: dict) -> dict | None:
    if run["method"] == "baseline":
        return None
    if run["method"] == "peagle":
        # vLLM serves it as eagle3, with parallel_drafting in the speculative config itself
        return {**peagle.speculative_config(run["drafter"], run["k"]), **run.get("extra", {})}
    spec = {"method": run["method"], "num_speculative_tokens": run["k"]}
    if run["method"] == "eagle3":
        spec["model"] = run["drafter"]
    return {**spec, **run.get("extra", {})}


def _measure(url: str, prompts: list[dict], ev: dict, concurrency: int,
             template_kwargs: dict | None = None, temperature: float = 0.0) -> dict:
    before = spec_counters(read_metrics(url))
    start = time.perf_counter()
    answers = asyncio.run(_run_prompts(url, prompts, ev["max_tokens"], concurrency,
                                       ev["request_timeout_s"], template_kwargs, temperature,
                                       **cut(ev)))
    wall = time.perf_counter() - start
    delta = counter_delta(before, spec_counters(read_metrics(url)))
    tokens = sum(a["completion_tokens"] for a in answers)
    return {"concurrency": concurrency, "requests": len(answers), "output_tokens": tokens,
            "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
            "_delta": delta, "_answers": answers}


def _sum_deltas(deltas: list[dict]) -> dict:
    width = max((len(d["per_position"]) for d in deltas), default=0)
    return {**{key: sum(d[key] for d in deltas) for key in SPEC_COUNTERS},
            "per_position": [sum(d["per_position"][i] for d in deltas
                                 if i < len(d["per_position"])) for i in range(width)]}


def _start(cfg: dict, target_path: str, placed: list[tuple[contextlib.ExitStack, dict]],
           log_dir: str) -> dict[str, str]:
    """Start the servers of the runs in ``placed`` at once, each inside the stack beside it
    (:func:`eaglet.server.start_together`); their base URLs by run name."""
    servers = []
    for stack, run in placed:
        spec = speculative_config(run)
        log.info("%s: starting vLLM (%s)", run["name"],
                 json.dumps(spec) if spec else "no speculation")
        servers.append((stack, target_server(
            cfg, target_path, server_log(log_dir, run),
            ["--speculative-config", json.dumps(spec), *PER_REQUEST_METRICS]
            if spec is not None else [])))
    try:
        start_together(servers)
    except ServerError as exc:
        # waited for in order: the first without a ready time is the one that failed
        run = next(run for (_, run), (_, server) in zip(placed, servers)
                   if server.ready_after_s is None)
        what = "vLLM refused the drafter" if is_drafter(run) else "vLLM did not start"
        raise EvaluationError(f"{run['name']}: {what}.\n{exc}") from None
    return {run["name"]: server.url for (_, run), (_, server) in zip(placed, servers)}


def serving(cfg: dict, side_by_side: bool = False) -> dict:
    """The config evaluation servers start from: ``evaluate.memory_utilization`` and
    ``evaluate.kv_cache_gib`` (when set) in place of the server's, each on a free port when
    several are up at once."""
    server = dict(cfg["server"])
    for key in ("memory_utilization", "kv_cache_gib"):
        if cfg["evaluate"].get(key) is not None:
            server[key] = cfg["evaluate"][key]
    if side_by_side:
        server["port"] = 0
    return {**cfg, "server": server}


# -- the servers side by side, or one at a time ----------------------------------------------
#
# Interleaved, every engine run's server holds the target at once (three or more copies of
# it): right for a small target on a machine whose speed drifts, impossible for a target that
# fills its GPUs. evaluate.interleave auto decides from the target's size against the memory
# the servers would share; `eaglet status` plans the stage's time from the same decision.

# per server (per GPU of a GPU server): the engine process, its activations and buffers, the
# CUDA context, the drafter's one layer. On the CPU engine the embedded model's server process
# measured about 1.4 GB with its 0.5 GB of weights.
SERVER_OVERHEAD = 1 << 30
# share of the machine's RAM the servers (or the offline replay's forward) may hold together:
# the rest is the stage's own process, the OS and its page cache
HOST_USABLE = 0.8
VLLM_MEMORY_UTILIZATION = 0.9   # vLLM's default --gpu-memory-utilization


@dataclass
class Placement:
    """Whether evaluation's servers run side by side, and why (the log and status say it)."""

    together: bool
    reason: str
    fits: bool | None = None     # what the sizes say (None: unknown)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ServerMemory(NamedTuple):
    """One evaluation server's memory, the memory every server up at once shares, what that
    memory is, and what sizes the server (its own contents, or vLLM's share of the memory)."""

    each: int
    budget: int
    where: str
    sized_by: str


def server_memory(cfg: dict, weights: int, host_bytes: int | None = None) -> ServerMemory:
    """What one evaluation server holds with ``weights`` bytes of weights, against the memory
    every server up at once shares.

    GPUs (server.gpus): each server stacks on the same GPUs; vLLM asks its
    memory_utilization of each GPU free at start (whatever the KV cache's size), and holds
    the weights, its KV cache (evaluate.kv_cache_gib per GPU) and its overhead; plan.py's
    device of 141 GB, 95% usable. CPU: the weights, the KV cache (or, without a size, the
    memory_utilization share of the RAM vLLM's CPU engine reserves) and the overhead, within
    80% of the machine's RAM."""
    from eaglet.plan import GPU_BYTES, GPU_USABLE

    server = serving(cfg)["server"]
    util = server["memory_utilization"] or VLLM_MEMORY_UTILIZATION
    kv = server.get("kv_cache_gib")
    gpus = server["gpus"]
    contents = "weights, KV cache and engine" if kv is not None else "weights and engine"
    share = f"vLLM's memory_utilization {util} of the memory"
    if gpus:
        total = gpus * GPU_BYTES
        own = weights + gpus * (SERVER_OVERHEAD + (int(kv * 2**30) if kv is not None else 0))
        reserved = int(util * total)
        return ServerMemory(max(own, reserved), int(GPU_USABLE * total),
                            f"{GPU_USABLE:.0%} of {gpus} GPUs of {human_size(GPU_BYTES)}",
                            contents if own >= reserved else share)
    ram = host_bytes or host_memory_bytes()
    where = f"{HOST_USABLE:.0%} of the machine's {human_size(ram)} RAM"
    own = weights + SERVER_OVERHEAD
    if kv is not None:
        return ServerMemory(own + int(kv * 2**30), int(HOST_USABLE * ram), where, contents)
    # without a KV cache size the CPU engine reserves its memory_utilization share
    reserved = int(util * ram)
    return ServerMemory(max(own, reserved), int(HOST_USABLE * ram), where,
                        contents if own >= reserved else share)


def placement(cfg: dict, target_dir: str | os.PathLike | None, servers: int,
              host_bytes: int | None = None) -> Placement:
    """Whether the stage's ``servers`` engine runs serve side by side: evaluate.interleave
    true or false as set; auto: where they fit together (:func:`server_memory` of the
    target's size, :func:`target_size`), else one at a time. The run and `eaglet status`
    both ask here, so the plan and the run agree."""
    setting = cfg["evaluate"]["interleave"]
    size = target_size(target_dir, cfg["target"]["dtype"]) if target_dir else None
    if size is None:
        fits, sizes = None, (f"the target's size is unknown (no safetensors or config.json in "
                             f"{target_dir})" if target_dir else "the target is not prepared yet")
    else:
        memory = server_memory(cfg, size.served, host_bytes)
        fits = servers * memory.each <= memory.budget
        sizes = (f"{servers} servers of about {human_size(memory.each)} each ({memory.sized_by}; "
                 f"the target's weights {human_size(size.served)}, from {size.source}) "
                 f"{'fit within' if fits else 'need more than'} {human_size(memory.budget)}, "
                 f"{memory.where}")
    if setting != "auto":
        return Placement(bool(setting), f"evaluate.interleave: {str(setting).lower()}; {sizes}",
                         fits)
    return Placement(bool(fits), f"evaluate.interleave: auto; {sizes}", fits)


def recorded_target_dir(results: str | os.PathLike, spec: str) -> str | None:
    """The target's directory as prepare_target recorded it in ``results``, else the
    configured one where it is a local directory; None before a hub target is prepared."""
    try:
        return read_json(Path(results) / "target" / "target.json")["path"]
    except (OSError, ValueError, KeyError):
        return spec if Path(spec).is_dir() else None


def _merge(parts: list[dict]) -> dict:
    """One level's measurement from the measurements of its rounds, each round's tokens and
    wall time kept (``by_round``: the speedup's interval comes from them)."""
    answers = [a for p in parts for a in p["_answers"]]
    tokens, wall = sum(p["output_tokens"] for p in parts), sum(p["wall_s"] for p in parts)
    return {"concurrency": parts[0]["concurrency"], "requests": len(answers),
            "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "by_round": [{"output_tokens": p["output_tokens"], "wall_s": p["wall_s"]}
                         for p in parts],
            "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
            "_delta": _sum_deltas([p["_delta"] for p in parts]), "_answers": answers}


def server_log(log_dir: str, run: dict) -> str:
    return f"{log_dir}/evaluate.{run['name']}.server.log"


def engine_runs(cfg: dict, target_path: str, runs: list[dict], prompt_sets: dict[str, list[dict]],
                log_dir: str, progress: Progress | None = None) -> list[dict]:
    """Serve each of ``runs`` with its speculation and send every prompt set at every
    concurrency of the sweep and every temperature through that one server
    (:func:`measure_runs`; several runs: their servers side by side)."""
    served = serving(cfg, side_by_side=len(runs) > 1)
    with contextlib.ExitStack() as stack:
        urls = _start(served, target_path, [(stack, run) for run in runs], log_dir)
        return measure_runs(cfg, urls, runs, prompt_sets, log_dir, progress)


def measure_runs(cfg: dict, urls: dict[str, str], runs: list[dict],
                 prompt_sets: dict[str, list[dict]], log_dir: str,
                 progress: Progress | None = None) -> list[dict]:
    """Every prompt set at every concurrency of the sweep and every temperature through each
    run's server (``urls`` by run name); the measurements per level and in all, one result per
    run and temperature (:func:`at_temperature`), temperature by temperature.

    Each level is sent round by round (``concurrency`` prompts a round), so that every
    speedup has rounds to take its interval from (:func:`speedup_interval`): round r of every
    run sends the same prompts. Several runs: each round goes to every server in turn, the
    first server of each round rotating: a machine whose speed drifts while they run slows
    every run alike, so their speedups compare like with like."""
    ev = cfg["evaluate"]
    template_kwargs = cfg.get("generate", {}).get("chat_template_kwargs")
    names = " and ".join(run["name"] for run in runs)
    temps = temperatures(ev)
    order_of = [run["name"] for run in runs]
    levels: dict[tuple[str, float], list[dict]] = {(run["name"], t): [] for t in temps
                                                   for run in runs}
    for t in temps:
        at = f", {sampling_text(t, ev)}" if len(temps) > 1 or t else ""
        for concurrency in ev["concurrency"]:
            for set_name, prompts in prompt_sets.items():
                if progress is not None:
                    progress.enter_phase(f"{names} in vLLM: {set_name} at concurrency "
                                         f"{concurrency}{at}")
                sent = level_prompts(prompts, concurrency, ev["rounds"])
                rounds = [sent[i:i + concurrency] for i in range(0, len(sent), concurrency)]
                parts: dict[str, list[dict]] = {name: [] for name in order_of}
                for r, chunk in enumerate(rounds):
                    order = order_of[r % len(order_of):] + order_of[:r % len(order_of)]
                    for name in order:
                        # the chat template renders prompts as it did for the training data
                        parts[name].append(_measure(urls[name], chunk, ev, concurrency,
                                                    template_kwargs, t))
                for run in runs:
                    level = _merge(parts[run["name"]])
                    k = drafted_k(run, concurrency)
                    levels[(run["name"], t)].append(
                        {"set": set_name, "temperature": t, **level,
                         **acceptance(level["_delta"], k),
                         **per_request_acceptance(_answer_counts(level), k)})
    return [_run_result(at_temperature(run, t, ev), levels[(run["name"], t)], prompt_sets,
                        server_log(log_dir, run)) for t in temps for run in runs]


def temperatures(ev: dict) -> list[float]:
    """The temperatures every level is measured at (evaluate.temperature); the last is the
    one served."""
    return [float(t) for t in ev.get("temperature") or [0.0]]


def at_temperature(run: dict, temperature: float, ev: dict | None = None) -> dict:
    """An engine run as measured at ``temperature``: above 0 its name says it
    (``eagle3_k3_T1``), so each (run, temperature) has a name of its own in
    acceptance.json, summary.csv and the figures; at 0 the name is the run's. ``sampling``:
    how its requests were sampled, in words (the run's top-p and top-k with the temperature)."""
    name = f"{run['name']}_T{temperature:g}" if temperature else run["name"]
    return {**run, "name": name, "temperature": temperature,
            "sampling": sampling_text(temperature, ev or {})}


def _run_result(run: dict, levels: list[dict], prompt_sets: dict, log_path: str) -> dict:
    name, spec = run["name"], speculative_config(run)

    def pooled(chosen: list[dict]) -> dict:
        return {**acceptance(_sum_deltas([lv["_delta"] for lv in chosen]), run.get("k")),
                **per_request_acceptance([c for lv in chosen for c in _answer_counts(lv)],
                                         run.get("k"))}

    result = {"name": name, "method": run["method"], "k": run.get("k"),
              "temperature": run.get("temperature", 0.0),
              **({"sampling": run["sampling"]} if run.get("sampling") else {}),
              "schedule": bool(run.get("schedule")), "speculative_config": spec, "levels": levels,
              "sets": {s: pooled([lv for lv in levels if lv["set"] == s]) for s in prompt_sets},
              "output_tokens": sum(lv["output_tokens"] for lv in levels), **pooled(levels),
              **({"drafter": run["drafter"]} if run.get("drafter") else {}),
              # served beside this run's drafter for comparison only (compare_runs)
              **({"compare": True, "kind": run["kind"]} if run.get("compare") else {})}
    if spec is not None and not result["drafts"]:
        if run["method"] == "ngram":  # proposes only where an n-gram of the context recurs
            log.warning("%s: ngram proposed no draft on these prompts (no n-gram of a prompt "
                        "or answer recurred in it)", name)
        else:  # a drafter model proposes at every step it is given
            raise EvaluationError(
                f"{name}: vLLM served without drafting anything (no spec-decode drafts in "
                f"/metrics): the speculative config was not applied. Server log: {log_path}")
    if spec is not None and result["drafts"] and result["requests_drafted"] is None:
        log.warning("%s: vLLM returned no per-request spec-decode counts (its answers have no "
                    "metrics.speculative_decoding; %s needs a vLLM that knows it, as 0.32 "
                    "does): the acceptance length per request is left empty", name,
                    PER_REQUEST_METRICS[0])
    for lv in levels:
        log.info("%s: %s at concurrency %d: %d tokens in %.1f s (%.1f tok/s)%s%s", name,
                 lv["set"], lv["concurrency"], lv["output_tokens"], lv["wall_s"],
                 lv["output_tokens_per_s"],
                 f", AL {lv['acceptance_length']:.3f}" if lv["acceptance_length"] else "",
                 f" ({lv['acceptance_length_per_request']:.3f} per request)"
                 if lv.get("acceptance_length_per_request") else "")
    return result


# two-sided 95%: the share of Student's t distribution within +-t
CONFIDENCE = 0.95


def _t_within(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` degrees of freedom, in closed form for whole df
    (Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for j in range(2, df - 1, 2):
            term *= cos2 * (j - 1) / j
            total += term
        return math.sin(theta) * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = math.cos(theta)
    for j in range(3, df - 1, 2):
        term *= cos2 * (j - 1) / j
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * total)


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The t with ``confidence`` of Student's t distribution (``df`` degrees of freedom)
    within +-t: 12.71 at df 1, 2.78 at 4, 1.96 as df grows."""
    low, high = 0.0, 1e4
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_within(mid, df) < confidence else (low, mid)
    return (low + high) / 2


def speedup_interval(speedup: float, ratios: list[float]) -> dict:
    """``speedup_low`` and ``speedup_high`` of a speedup measured in rounds: the speedup
    (pooled tokens/s over the target alone's) +- t(0.975, n-1) s/sqrt(n), with s the standard
    deviation of the n rounds' own speedups (each round's tokens/s over the target alone's in
    the same round, on the same prompts): a 95% interval, taking the rounds as independent
    repeats. Side by side, a round's two runs share the machine's state at that time; one at a
    time they share the prompts only, so a machine that drifts between the runs moves every
    round's ratio alike, which no interval shows. None with fewer than two rounds (a level of
    one round: the prompt set held no more than ``concurrency`` prompts)."""
    n = len(ratios)
    if n < 2:
        return {"speedup_low": None, "speedup_high": None}
    mean = sum(ratios) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return {"speedup_low": speedup - half, "speedup_high": speedup + half}


def _round_ratios(levels: list[dict], refs: list[dict]) -> list[float]:
    """The speedup round by round of ``levels`` (one, or every set's at one concurrency)
    over the target alone's same rounds ``refs``: round r's tokens over its wall time, pooled
    over the levels as the speedup itself is, against the target alone's round r."""
    def per_round(chosen: list[dict]) -> list[float]:
        tokens: dict[int, float] = defaultdict(float)
        wall: dict[int, float] = defaultdict(float)
        for lv in chosen:
            for r, part in enumerate(lv.get("by_round") or []):
                tokens[r] += part["output_tokens"]
                wall[r] += part["wall_s"]
        return [tokens[r] / wall[r] for r in sorted(wall)]
    return [mine / theirs for mine, theirs in zip(per_round(levels), per_round(refs))]


def add_speedups(runs: list[dict], concurrencies: list[int], base: dict | None = None) -> None:
    """Speedup of every level over the baseline's same set and concurrency, and per
    concurrency over all sets together (tokens over wall time, pooled), each with its 95%
    interval from the rounds (:func:`speedup_interval`; per concurrency, round r of every set
    pooled). ``base``: the baseline measured beside these runs (default: the first run). A
    baseline other than the first run is kept in each run (``baseline_levels``), so its
    speedups can be read back."""
    kept = None
    if base is not None:
        kept = [{k: lv[k] for k in ("set", "concurrency", "output_tokens", "wall_s",
                                    "output_tokens_per_s", "by_round", "mean_latency_s")
                 if k in lv}
                for lv in base["levels"]]
    base = base or runs[0]
    ref_levels = {(lv["set"], lv["concurrency"]): lv for lv in base["levels"]}
    base_pooled = _pooled(base, concurrencies)
    for run in runs:
        if kept is not None:
            run["baseline_levels"] = kept
        for lv in run["levels"]:
            ref = ref_levels[(lv["set"], lv["concurrency"])]
            lv["speedup"] = lv["output_tokens_per_s"] / ref["output_tokens_per_s"]
            lv.update(speedup_interval(lv["speedup"], _round_ratios([lv], [ref])))
            lv["latency_ratio"] = lv["mean_latency_s"] / ref["mean_latency_s"]
        run["by_concurrency"] = []
        for c, tps in _pooled(run, concurrencies).items():
            mine = [lv for lv in run["levels"] if lv["concurrency"] == c]
            refs = [ref_levels[(lv["set"], c)] for lv in mine]
            run["by_concurrency"].append(
                {"concurrency": c, "output_tokens_per_s": tps, "speedup": tps / base_pooled[c],
                 **speedup_interval(tps / base_pooled[c], _round_ratios(mine, refs))})


def step_ms(levels: list[dict]) -> float | None:
    """Milliseconds per decoding step of one request, over ``levels`` at one concurrency:
    wall time over the steps each request in flight took. A step of a drafting run is one
    draft and its verification (vLLM's drafts counter counts one per request and step); the
    target alone's step is one token. Prefill is spread over the steps, alike in every run.
    Beside the target alone's at the same concurrency, the difference is what drafting and
    verifying k tokens costs per step on this machine."""
    steps = sum((lv.get("drafts") or lv["output_tokens"]) / lv["concurrency"] for lv in levels)
    return 1000 * sum(lv["wall_s"] for lv in levels) / steps if steps else None


def methods_table(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """Every drafter served at one fixed k, this run's and those compared with it
    (:func:`compare_runs`), side by side from one temperature's runs (the target alone first,
    their speedups added): acceptance length pooled and per request, acceptance per position,
    and at each concurrency the speedup with its interval and the time per step beside the
    target alone's; the minutes its training took where its directory says
    (``stats.json``)."""
    base = runs[0]
    alone = {c: step_ms([lv for lv in base["levels"] if lv["concurrency"] == c])
             for c in concurrencies}
    rows = []
    for run in runs:
        if not is_drafter(run) or run.get("schedule"):
            continue
        by_c = []
        for c in concurrencies:
            entry = at_concurrency(run, c) if run.get("by_concurrency") else {}
            mine = step_ms([lv for lv in run["levels"] if lv["concurrency"] == c])
            by_c.append({"concurrency": c,
                         **{key: entry.get(key) for key in ("speedup", "speedup_low",
                                                              "speedup_high")},
                         "step_ms": mine, "target_step_ms": alone[c],
                         "step_over_target_ms": (mine - alone[c]) if mine and alone[c]
                         else None})
        stats = Path(run.get("drafter") or ".", "stats.json")
        elapsed = read_json(stats).get("elapsed_s") if stats.is_file() else None
        rows.append({"name": run["name"], "method": run["method"],
                     "kind": run.get("kind") or (drafter_kind(run["drafter"])[2]
                                                 if run.get("drafter")
                                                 else peagle.METHOD_NAMES[run["method"]]),
                     "drafter": run.get("drafter"),
                     "compared": bool(run.get("compare")), "k": run["k"],
                     "temperature": run.get("temperature", 0.0),
                     "acceptance_length": run["acceptance_length"],
                     "acceptance_length_per_request": run.get("acceptance_length_per_request"),
                     "per_position_rate": run["per_position_rate"],
                     "by_concurrency": by_c,
                     "training_minutes": elapsed / 60 if elapsed else None})
    return rows


def _pooled(run: dict, concurrencies: list[int]) -> dict[int, float]:
    out = {}
    for c in concurrencies:
        levels = [lv for lv in run["levels"] if lv["concurrency"] == c]
        out[c] = sum(lv["output_tokens"] for lv in levels) / sum(lv["wall_s"] for lv in levels)
    return out


def at_concurrency(run: dict, concurrency: int) -> dict:
    """A run's ``by_concurrency`` entry: its speedup over all sets there, with the interval."""
    return next(e for e in run["by_concurrency"] if e["concurrency"] == concurrency)


def speedup_at(run: dict, concurrency: int) -> float:
    return at_concurrency(run, concurrency)["speedup"]


FASTER, SLOWER, NO_DIFFERENCE = "faster", "slower", "no measurable difference"


def _interval(entry: dict) -> tuple[float, float]:
    """A speedup's interval; the speedup alone where the rounds gave none (one round)."""
    low, high = entry.get("speedup_low"), entry.get("speedup_high")
    if low is None or high is None:
        return entry["speedup"], entry["speedup"]
    return low, high


def _order(a: tuple[float, float], b: tuple[float, float]) -> str:
    return FASTER if a[0] > b[1] else SLOWER if a[1] < b[0] else NO_DIFFERENCE


def against_target(entry: dict) -> str:
    """Whether a speedup (a level or a ``by_concurrency`` entry) is measurably faster or
    slower than the target alone, or no measurable difference: its interval holds 1.0.
    Without an interval the speedup alone decides, as before intervals were measured."""
    return _order(_interval(entry), (1.0, 1.0))


def against_each_other(a: dict, b: dict) -> str:
    """Whether ``a`` serves measurably faster or slower than ``b`` (two speedups at the same
    concurrency), or no measurable difference: their intervals overlap."""
    return _order(_interval(a), _interval(b))


def _speed(entry: dict) -> str:
    """A speedup in words, with its interval where the rounds gave one: 1.14x [1.05, 1.23]."""
    text = f"{entry['speedup']:.2f}x"
    if entry.get("speedup_low") is not None and entry.get("speedup_high") is not None:
        text += f" [{entry['speedup_low']:.2f}, {entry['speedup_high']:.2f}]"
    return text


# -- the k schedule --------------------------------------------------------------------------

def fixed_k_runs(runs: list[dict]) -> list[dict]:
    """The runs of this run's drafter at one fixed k each (not the schedule, not a drafter
    served only for comparison: :func:`compare_runs`), whatever its method."""
    return [r for r in runs if is_drafter(r) and not r.get("schedule") and not r.get("compare")]


def best_k_by_concurrency(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """Per concurrency, the fixed-k drafter run that served fastest, or k 0 (no speculation)
    where none was faster than the target alone."""
    fixed = fixed_k_runs(runs)
    choice = []
    for c in concurrencies:
        best = max(fixed, key=lambda r: speedup_at(r, c))
        pays = speedup_at(best, c) > 1.0
        choice.append({"concurrency": c, "k": best["k"] if pays else 0,
                       "best_run": best["name"], "best_speedup": speedup_at(best, c)})
    return choice


def schedule_ranges(choice: list[dict]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from the per-concurrency choice: each
    measured concurrency covers the batch sizes nearest to it on a log scale (the ranges
    split at geometric midpoints), the first from 1, the last to any size; equal neighbours
    merge."""
    ordered = sorted(choice, key=lambda e: e["concurrency"])
    ranges: list[list[int]] = []
    for i, entry in enumerate(ordered):
        start = ranges[-1][1] + 1 if ranges else 1
        if i + 1 < len(ordered):
            end = max(start, int((entry["concurrency"] * ordered[i + 1]["concurrency"]) ** 0.5))
        else:
            end = MAX_BATCH
        if ranges and ranges[-1][2] == entry["k"]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, entry["k"]])
    return ranges


def schedule_run(choice: list[dict], drafter_dir: str) -> dict | None:
    """The engine run that serves the schedule, or None when it is one fixed k already
    measured (or no speculation at all: the baseline)."""
    ranges = schedule_ranges(choice)
    if len(ranges) == 1:
        return None
    k = max(r[2] for r in ranges)
    method = drafter_method(drafter_dir)
    return {"name": f"{method}_schedule", "method": method, "k": k, "drafter": drafter_dir,
            "schedule": True, "extra": {"num_speculative_tokens_per_batch_size": ranges}}


def serve_recommendation(choice: list[dict], runs: list[dict], drafter_dir: str) -> dict:
    """What ``serve.json`` holds: the speculative config to serve with, where it comes from,
    and how it did at every concurrency against the target alone (with the interval from the
    rounds); ``never_slower_than_target``: measurably slower nowhere (:func:`against_target`).
    Served without speculation, nothing was measured: speedup 1.0, no interval."""
    ranges = schedule_ranges(choice)
    fixed = fixed_k_runs(runs)
    checked = next((r for r in runs if r.get("schedule")), None)
    if checked is None and ranges[0][2]:
        checked = next(r for r in fixed if r["k"] == ranges[0][2])
    spec = checked["speculative_config"] if checked else None
    by_c = []
    for e in choice:
        measured = (at_concurrency(checked, e["concurrency"]) if checked
                    else {"speedup": 1.0, "speedup_low": None, "speedup_high": None})
        by_c.append({"concurrency": e["concurrency"], "k": e["k"],
                     **{key: measured.get(key) for key in ("speedup", "speedup_low",
                                                           "speedup_high")}})
    out = {"speculative_config": spec,
           "vllm_args": ["--speculative-config", json.dumps(spec)] if spec else [],
           # the drafter's method (train.method): a P-EAGLE spec says parallel_drafting
           "method": fixed[0]["method"] if fixed else None,
           "checked_by": checked["name"] if checked else "baseline",
           "by_concurrency": by_c,
           "never_slower_than_target": all(against_target(e) != SLOWER for e in by_c)}
    if spec is None:
        out["note"] = ("no draft length was faster than the target alone at any measured "
                       "concurrency: serve without speculation")
    return out


def run_plan(ev: dict, drafter_dir: str | None = None) -> tuple[list[dict], int]:
    """The stage's engine runs in order (the baseline first, which the others are measured
    against) and how many offline replays follow them (one per fixed-k drafter run and
    temperature). The drafter's runs are named by its method (:func:`drafter_method`:
    ``eagle3_k3``, ``peagle_k3``). A run serving the derived k schedule may follow these, once
    the sweep has chosen it."""
    plan = [{"name": "baseline", "method": "baseline"}]
    if ev["ngram"]:
        plan.append({"name": f"ngram_k{ev['ngram_k']}", "method": "ngram", "k": ev["ngram_k"],
                     "extra": ev["ngram_config"]})
    method = drafter_method(drafter_dir)
    plan += [{"name": f"{method}_k{k}", "method": method, "k": k, "drafter": drafter_dir}
             for k in ev["num_speculative_tokens"]]
    plan += compare_runs(ev, method)
    # every drafter's fixed-k runs at every temperature, this run's and the compared ones
    replays = (len(fixed_k_runs(plan) + [r for r in plan if r.get("compare")])
               * len(temperatures(ev)) if ev["offline"] else 0)
    return plan, replays


def compare_runs(ev: dict, own_method: str = "eagle3") -> list[dict]:
    """The engine runs of the drafters named in ``evaluate.compare_drafters`` (exported drafter
    directories, such as another run's ``drafter/``), each at every k of the sweep beside this
    run's drafter, so that two methods or recipes are measured on the same prompts, the same
    rounds and the same machine moments. Each is named by its method, numbered where two
    drafters share one (``peagle_k3`` and ``eagle31_k3`` (EAGLE-3.1) beside ``eagle3_k3``;
    ``eagle3_2_k3`` for a second EAGLE-3). They
    are measured and tabled (acceptance.json ``methods``), never chosen: the verdict, the k
    schedule and serve.json judge this run's drafter only."""
    dirs = [str(d) for d in ev.get("compare_drafters") or []]
    kinds = [drafter_kind(d) for d in dirs]
    taken = [own_method] + [label for _, label, _ in kinds]
    runs = []
    for i, (d, (method, label, words)) in enumerate(zip(dirs, kinds)):
        name = label if taken.count(label) == 1 else f"{label}_{i + 2}"
        runs += [{"name": f"{name}_k{k}", "method": method, "k": k, "drafter": d,
                  "compare": True, "kind": words} for k in ev["num_speculative_tokens"]]
    return runs


def check_compare_drafters(ev: dict) -> None:
    """Refuse, before any server starts, a comparison drafter that is not an exported drafter
    directory."""
    for d in ev.get("compare_drafters") or []:
        missing = [f for f in ("config.json", "model.safetensors") if not Path(d, f).is_file()]
        if missing:
            raise EvaluationError(
                f"evaluate.compare_drafters: {d} has no {' or '.join(missing)}: name an exported "
                f"drafter directory (another run's results/drafter), or remove it from the list")


# -- the verdict -----------------------------------------------------------------------------

LOW_ACCEPTANCE = 0.3   # share of draft tokens accepted below which a drafter is suspect
DISAGREEMENT = 0.15    # relative AL gap between the held-out split and another set


def verdict(runs: list[dict], concurrencies: list[int], serve: dict | None = None) -> dict:
    """Whether the drafter speeds serving up here, per concurrency and prompt set.

    A speedup whose interval holds 1.0 is no measurable difference, neither a win nor a loss
    (:func:`against_target`), and two runs whose intervals overlap serve alike
    (:func:`against_each_other`): ``speeds_up_serving`` is true where the best k is measurably
    faster than the target alone, ``difference_by_concurrency`` says which of the three each
    concurrency is, and the warnings name only what was measurably slower."""
    ngram = next((r for r in runs if r["method"] == "ngram"), None)
    drafts = fixed_k_runs(runs)
    warnings = [w for r in drafts for w in _run_warnings(r, drafts, concurrencies)]
    warnings += _disagreements(drafts, concurrencies)
    temperature = runs[0].get("temperature", 0.0) if runs else 0.0
    out: dict[str, Any] = {"concurrency": concurrencies, "temperature": temperature,
                           "warnings": warnings}
    if not drafts:
        return out
    choice = best_k_by_concurrency(runs, concurrencies)
    best = max(drafts, key=lambda r: r["acceptance_length"] or 0)
    measured = {str(e["concurrency"]): at_concurrency(
        next(r for r in drafts if r["name"] == e["best_run"]), e["concurrency"]) for e in choice}
    difference = {c: against_target(entry) for c, entry in measured.items()}
    out.update({
        "method": best["method"],
        "best_k_by_concurrency": choice,
        "speeds_up_serving": {c: d == FASTER for c, d in difference.items()},
        "difference_by_concurrency": difference,
        "acceptance_length": best["acceptance_length"],
        "acceptance_length_per_request": best.get("acceptance_length_per_request"),
        "best": best["name"], "ceiling": best["k"] + 1,
        "share_of_ceiling": (best["acceptance_length"] or 1) / (best["k"] + 1),
        **_by_concurrency(measured),
    })
    if ngram is not None and ngram["acceptance_length"]:
        out["ngram_acceptance_length"] = ngram["acceptance_length"]
        out["ngram_acceptance_length_per_request"] = ngram.get("acceptance_length_per_request")
        out["beats_ngram"] = (best["acceptance_length"] or 1) > ngram["acceptance_length"]
        ngram_measured = {str(c): at_concurrency(ngram, c) for c in concurrencies}
        out.update({f"ngram_{key}": value
                    for key, value in _by_concurrency(ngram_measured).items()})
        out["against_ngram_by_concurrency"] = {
            c: against_each_other(measured[c], ngram_measured[c]) for c in measured}
    if serve is not None:
        out["serve_never_slower_than_target"] = serve["never_slower_than_target"]
        if not serve["never_slower_than_target"]:
            slower = [e for e in serve["by_concurrency"] if against_target(e) == SLOWER]
            slow = ", ".join(f"{_speed(e)} at concurrency {e['concurrency']}" for e in slower)
            text = (f"SERVE CONFIG SLOWER THAN NO DRAFTER: {serve['checked_by']} (serve.json) "
                    f"measured {slow}.")
            if any(e["k"] == 0 for e in slower):
                # vLLM runs the drafter's forward pass on every step to keep its KV cache in
                # sync, drafting or not
                text += (" k 0 is not free: vLLM still runs the drafter's forward pass every "
                         "step. Where this concurrency is what you serve, serve without "
                         "--speculative-config.")
            warnings.append(text)
    said = runs[0].get("sampling") or f"temperature {temperature:g}"
    out["summary"] = (f"At {said}: " if temperature else "") + _summary(
        best, choice, measured, ngram)
    return out


def _by_concurrency(measured: dict[str, dict]) -> dict:
    """Speedups and their intervals by concurrency, as the verdict keeps them."""
    return {f"{key}_by_concurrency": {c: entry.get(key) for c, entry in measured.items()}
            for key in ("speedup", "speedup_low", "speedup_high")}


def _run_warnings(run: dict, drafts: list[dict], concurrencies: list[int]) -> list[str]:
    warnings = []
    slow = [e for e in run["by_concurrency"] if against_target(e) == SLOWER]
    if slow:
        where = "; ".join(
            f"{_speed(e)} at concurrency {e['concurrency']} ("
            + ", ".join(f"{lv['set']} {_speed(lv)}" for lv in run["levels"]
                        if lv["concurrency"] == e["concurrency"]) + ")" for e in slow)
        warnings.append(
            f"SLOWER THAN NO DRAFTER: {run['name']} serves {where} of the target alone's "
            f"tokens/s (acceptance rate {_pct(run['acceptance_rate'])}): the drafts cost more "
            f"than they save there. Serve serve.json's schedule (k 0 where no k pays), and "
            f"check the training curves (acc_0), the vocabulary coverage and the aux layer ids.")
    if run["acceptance_rate"] is not None and run["acceptance_rate"] < LOW_ACCEPTANCE:
        others = [o for o in drafts if (o["acceptance_rate"] or 0) >= LOW_ACCEPTANCE]
        hint = (f"serve a smaller k ({others[-1]['name']} accepts "
                f"{_pct(others[-1]['acceptance_rate'])})" if others
                else "train on more and broader data, or longer")
        warnings.append(
            f"LOW ACCEPTANCE: {run['name']} accepts {_pct(run['acceptance_rate'])} of its draft "
            f"tokens; at this rate speculation slows serving down as soon as the target's "
            f"step is not far costlier than the drafter's (higher concurrency, GPUs): {hint}.")
    return warnings


def _disagreements(drafts: list[dict], concurrencies: list[int]) -> list[str]:
    """Warn where the held-out split (the training distribution) flatters the drafter
    against the other prompt sets: their acceptance lengths differ, or the drafter pays on
    one and not the other at some concurrency, measurably (their speedups' intervals apart)."""
    warnings = []
    for run in drafts:
        ref = run["sets"].get(HELD_OUT, {}).get("acceptance_length")
        levels = {(lv["set"], lv["concurrency"]): lv for lv in run["levels"]}
        for name, acc in run["sets"].items():
            other = acc.get("acceptance_length")
            if name == HELD_OUT or not ref or not other:
                continue
            flips = [c for c in concurrencies
                     if (levels[(HELD_OUT, c)]["speedup"] >= 1.0)
                     != (levels[(name, c)]["speedup"] >= 1.0)
                     and against_each_other(levels[(HELD_OUT, c)], levels[(name, c)])
                     != NO_DIFFERENCE]
            if abs(ref - other) > DISAGREEMENT * ref or flips:
                text = (f"IN-DOMAIN AND OTHER PROMPTS DISAGREE: {run['name']} reaches AL "
                        f"{ref:.2f} on the held-out split but {other:.2f} on {name!r}")
                if flips:
                    text += (" and pays on one but not the other at concurrency "
                             + ", ".join(map(str, flips)))
                warnings.append(text + ": judge it on the prompts your users send.")
    return warnings


def _summary(best: dict, choice: list[dict], measured: dict[str, dict],
             ngram: dict | None) -> str:
    parts, difference = [], {}
    for e in choice:
        c = e["concurrency"]
        entry = measured[str(c)]
        difference[c] = against_target(entry)
        text = f"at concurrency {c}: {e['best_run']} {_speed(entry)}"
        if ngram:
            other = at_concurrency(ngram, c)
            text += f" (ngram {_speed(other)}{_versus_ngram(entry, other)})"
        if difference[c] == NO_DIFFERENCE:
            text += ", no measurable difference from no drafter" + (
                "" if e["k"] else " (serve.json drafts none there)")
        elif not e["k"]:
            text += ", slower than no drafter: serve without speculation there"
        parts.append(text)
    sets = ", ".join(f"{s} {a['acceptance_length']:.2f}" for s, a in best["sets"].items()
                     if a["acceptance_length"])
    ngram_al = (f"; ngram AL {ngram['acceptance_length']:.2f}"
                if ngram and ngram["acceptance_length"] else "")
    per_request = best.get("acceptance_length_per_request")
    al = f"AL {best['acceptance_length']:.2f}" + (f" ({per_request:.2f} per request)"
                                                  if per_request else "")
    return (f"{peagle.METHOD_NAMES[best['method']]} ({best['name']}) reaches {al} of a "
            f"possible {best['k'] + 1} ({sets}){ngram_al}. Speedup over the target alone "
            + "; ".join(parts) + ". " + _ending(difference))


def _versus_ngram(entry: dict, other: dict) -> str:
    """The best k against ngram at one concurrency, where both speedups have intervals to
    decide it (else the two speedups stand side by side, unjudged)."""
    if None in (entry.get("speedup_low"), other.get("speedup_low")):
        return ""
    versus = against_each_other(entry, other)
    return (": no measurable difference from ngram" if versus == NO_DIFFERENCE
            else f": measurably {versus} than ngram")


def _ending(difference: dict[int, str]) -> str:
    """The summary's last sentence: where the drafter measurably speeds serving up."""
    def listed(kind):
        return ", ".join(str(c) for c, d in difference.items() if d == kind)

    wins, ties = listed(FASTER), listed(NO_DIFFERENCE)
    if all(d == FASTER for d in difference.values()):
        return "It speeds serving up at every measured concurrency."
    if all(d == NO_DIFFERENCE for d in difference.values()):
        return "It makes no measurable difference to serving at any measured concurrency."
    tied = f" (no measurable difference at concurrency {ties})" if ties else ""
    if not wins:
        return f"It does NOT speed serving up at any measured concurrency{tied}."
    return f"It speeds serving up only at concurrency {wins}{tied}."


def _al_text(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def _pct(rate: float | None) -> str:
    return "?" if rate is None else f"{rate:.0%}"


# -- the stage -------------------------------------------------------------------------------

def run_stage(cfg: dict, target_json: str, drafter_dir: str, prompts_path: str,
              out_path: str, log_dir: str, progress_path: str | None = None,
              log_path: str | None = None, serve_path: str | None = None,
              train_prompts_path: str | None = None,
              held_out_paths: list[str] | None = None) -> dict:
    """The stage: every engine run in vLLM, the k schedule, the offline replay (from the
    held-out shards ``held_out_paths`` where they store the answers' states), the verdict."""
    from eaglet.target import read_target

    ev = cfg["evaluate"]
    target = read_target(target_json)
    prompt_sets, about = load_prompt_sets(ev, prompts_path, train_prompts_path)
    check_compare_drafters(ev)
    plan, replays = run_plan(ev, drafter_dir)
    place = placement(cfg, target["path"], len(plan))
    log.info("evaluation servers %s: %s", "side by side" if place.together else "one at a time",
             place.reason)
    if place.together and place.fits is False:
        log.warning("evaluate.interleave is true but the servers may not fit together: set "
                    "evaluate.interleave auto (or false) to run them one at a time")
    progress = Progress("evaluate", total=len(plan) + replays, path=progress_path,
                        log_path=log_path, unit="runs", interval_s=0.0)
    # the servers take a minute or more to start: the stage runs from now, and says so
    progress.enter_phase(f"starting vLLM for {', '.join(run['name'] for run in plan)}")
    concurrencies = ev["concurrency"]

    temps = temperatures(ev)
    served_at = temps[-1]   # the verdict, the schedule and serve.json are taken there

    def advanced(measured: list[dict]) -> list[dict]:
        # a unit is one engine run (its server), whatever the temperatures it was measured at
        progress.advance(done=len(measured) // len(temps),
                         tokens=sum(r["output_tokens"] for r in measured))
        return measured

    with contextlib.ExitStack() as baseline:
        if place.together:
            # every run's server side by side; the target alone's stays up for the schedule
            served = serving(cfg, side_by_side=True)
            with contextlib.ExitStack() as others:
                started = time.monotonic()
                urls = _start(served, target["path"], [(baseline, plan[0])]
                              + [(others, run) for run in plan[1:]], log_dir)
                # for status: how long this many servers took to start up together here
                rates.record("evaluate", target["spec"], sweep_servers=len(plan),
                             sweep_start_s=time.monotonic() - started)
                measured = advanced(measure_runs(cfg, urls, plan, prompt_sets, log_dir,
                                                 progress))
        else:
            measured = [r for run in plan for r in advanced(
                engine_runs(cfg, target["path"], [run], prompt_sets, log_dir, progress))]
        # each temperature's runs apart, the target alone first, as the plan orders them
        runs_at = {t: [r for r in measured if r["temperature"] == t] for t in temps}
        for group in runs_at.values():
            add_speedups(group, concurrencies)
        choice = best_k_by_concurrency(runs_at[served_at], concurrencies)
        extra = schedule_run(choice, drafter_dir) if ev["schedule"] else None
        if extra is not None:
            progress.total += 1
            # said at once: until the total grows, the progress file reads as a sweep that
            # finished with no check to run (`eaglet status` would plan none)
            progress.enter_phase(f"{extra['name']}: starting vLLM to check the k schedule")
            if place.together:
                # measured beside the target alone once more, like the sweep
                with contextlib.ExitStack() as check:
                    urls.update(_start(served, target["path"], [(check, extra)], log_dir))
                    again = measure_runs(cfg, urls, [plan[0], extra], prompt_sets, log_dir,
                                         progress)
                progress.advance(done=1, tokens=sum(r["output_tokens"] for r in again
                                                    if r.get("schedule")))
                bases = {r["temperature"]: r for r in again if not r.get("schedule")}
                checks = [r for r in again if r.get("schedule")]
            else:
                bases = {t: group[0] for t, group in runs_at.items()}
                checks = advanced(engine_runs(cfg, target["path"], [extra], prompt_sets,
                                              log_dir, progress))
            for checked in checks:
                add_speedups([checked], concurrencies, bases[checked["temperature"]])
                runs_at[checked["temperature"]].append(checked)
    runs = [r for t in temps for r in runs_at[t]]
    rates.record("evaluate", target["spec"], settings=rates.evaluate_settings(cfg),
                 baseline_tokens_per_s=_pooled(runs[0], concurrencies)[concurrencies[0]])
    # greedy speculative decoding reproduces the target's answers; sampled answers differ
    mismatched = _greedy_divergence(runs_at[0.0]) if 0.0 in runs_at else {}
    offline = replayed = expected = None
    expected_compared: dict = {}
    if ev["offline"]:
        others = list(dict.fromkeys(r["drafter"] for r in plan if r.get("compare")))
        # every replay of this evaluation loads the target once, and each greedy answer's
        # states are computed once for all the drafters replayed on it
        shared: dict = {}
        held = held_out_paths or []
        if 0.0 in runs_at:
            offline, replayed = offline_check(cfg, target["path"], drafter_dir, runs_at[0.0],
                                              progress, held, shared=shared)
            # each drafter served beside it, replayed on the same answers as its own
            for other in others:
                offline.update(offline_check(cfg, target["path"], other, runs_at[0.0],
                                             progress, held, compared=True, shared=shared)[0])
        # every drafter's sampled runs, checked alike; the compared drafters' are tabled,
        # never judged
        checked = {(name, compared): entry for t in temps if t
                   for drafter, compared in [(drafter_dir, False)] + [(o, True) for o in others]
                   for name, entry in expected_check(cfg, target["path"], drafter, runs_at[t],
                                                     progress, held, compared=compared,
                                                     shared=shared).items()}
        expected = {name: e for (name, compared), e in checked.items() if not compared}
        expected_compared = {name: e for (name, compared), e in checked.items() if compared}
    progress.report("finished")
    recommendation = {**serve_recommendation(choice, runs_at[served_at], drafter_dir),
                      "temperature": served_at, **(cut(ev) if served_at else {})}
    verdicts = {t: verdict(runs_at[t], concurrencies,
                           recommendation if t == served_at else None) for t in temps}
    verdicts[served_at]["warnings"] += expected_warnings(expected or {}, offline, cfg)
    for entry in (expected or {}).values():
        note = top_token_note(entry)
        if note and entry["temperature"] in verdicts:
            verdicts[entry["temperature"]]["summary"] += " " + note
    result = {"prompt_sets": about, "max_tokens": ev["max_tokens"], "rounds": ev["rounds"],
              "concurrency": concurrencies, "temperature": temps, **cut(ev),
              "target": target["path"], "drafter": drafter_dir,
              "runs": [_public(r) for r in runs],
              "methods": [row for t in temps for row in methods_table(runs_at[t],
                                                                      concurrencies)],
              "outputs_differ_from_baseline": mismatched, "offline": offline,
              "offline_replay": replayed,
              **({"offline_expected": {**expected, **expected_compared}}
                 if expected or expected_compared else {}),
              "servers": {"side_by_side": place.together, "why": place.reason},
              "serve": recommendation,
              "verdict": verdicts[served_at],
              **({"verdict_by_temperature": {f"{t:g}": v for t, v in verdicts.items()}}
                 if len(temps) > 1 else {})}
    for row in result["methods"]:
        # greedy: the replay's AL on the same answers; sampled: the expected AL of the run's
        # own answers; and whether vLLM's agrees
        check = ((offline or {}).get(row["name"])
                 or result.get("offline_expected", {}).get(row["name"]))
        if check:
            row.update(offline_acceptance_length=check["acceptance_length"],
                       offline_agrees=check["agrees"])
    if serve_path:
        write_json(serve_path, recommendation)
    write_json(out_path, result)
    side_by_side = any(r["compared"] for r in result["methods"])
    for row in result["methods"] if side_by_side else ():
        log.info("side by side: %s at temperature %g: AL %s; %s", row["name"],
                 row["temperature"], _al_text(row["acceptance_length"]), "; ".join(
                     f"concurrency {e['concurrency']}: "
                     + (_speed(e) if e["speedup"] is not None else "?")
                     + (f", {e['step_ms']:.1f} ms/step ({e['step_over_target_ms']:+.1f})"
                        if e["step_over_target_ms"] is not None else "")
                     for e in row["by_concurrency"]))
    for warning in result["verdict"]["warnings"]:
        log.warning(warning)
    if "summary" in result["verdict"]:
        log.info(result["verdict"]["summary"])
    return result


def _public(run: dict) -> dict:
    """A run as acceptance.json keeps it: without the answers and raw counter deltas."""
    levels = [{k: v for k, v in lv.items() if not k.startswith("_")} for lv in run["levels"]]
    return {**run, "levels": levels}


def _replayed_levels(run: dict) -> list[dict]:
    """The levels the offline replay checks: the lowest concurrency (requests one at a time,
    so vLLM's greedy answers are exactly the baseline's)."""
    lowest = min(lv["concurrency"] for lv in run["levels"])
    return [lv for lv in run["levels"] if lv["concurrency"] == lowest]


def served_dtype(cfg: dict, target_dir: str) -> str:
    """The dtype vLLM serves the target in: target.dtype, or with auto the checkpoint's own
    (its config.json's torch_dtype; bfloat16 where it names none)."""
    dtype = cfg["target"]["dtype"]
    if dtype != "auto":
        return dtype
    try:
        config = read_json(Path(target_dir) / "config.json")
    except (OSError, ValueError):
        return "bfloat16"
    text = config.get("text_config") or config
    name = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
               or config.get("dtype") or "bfloat16").removeprefix("torch.")
    return name if name in SERVED_BYTES else "bfloat16"


def target_loader(cfg: dict, target_dir: str, host_bytes: int | None = None):
    """A loader of the target for the offline replay's forward (transformers, float32, on the
    CPU) and None; or None and why it cannot be loaded: its float32 weights
    (:func:`target_size`) would not fit in 80% of the machine's RAM (a 1T model: about 4 TB),
    or its size is unknown."""
    size = target_size(target_dir, cfg["target"]["dtype"])
    if size is None:
        return None, f"the target's size is unknown (no safetensors or config.json in {target_dir})"
    ram = host_bytes or host_memory_bytes()
    if size.float32 > HOST_USABLE * ram:
        return None, (f"a float32 forward of the target needs about {human_size(size.float32)} "
                      f"(from {size.source}), more than {HOST_USABLE:.0%} of the machine's "
                      f"{human_size(ram)} RAM")

    def load():
        import torch
        from transformers import AutoModelForCausalLM

        log.info("loading the target (float32, %s) for the offline replay's forward",
                 human_size(size.float32))
        return AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=torch.float32,
            trust_remote_code=cfg["target"].get("trust_remote_code", False)).eval()
    return load, None


def stored_states(paths: list[str], layer_ids: list[int]):
    """The held-out shards' stored states (:class:`eaglet.offline_eval.StoredStates`) and
    None; or None and why they cannot serve the drafter's replay."""
    from eaglet.offline_eval import StoredStates

    if not paths:
        return None, "no held-out shard given"
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        return None, f"the held-out shard {missing[0]} is missing"
    try:
        stored = StoredStates(paths)
    except (ValueError, OSError) as exc:
        return None, f"the held-out shards cannot be read ({exc})"
    if stored.aux_layer_ids != list(layer_ids):
        return None, (f"the held-out shards store aux layers {stored.aux_layer_ids}, the "
                      f"drafter reads {list(layer_ids)}")
    return stored, None


def _states_label(sources: dict) -> str:
    """Where one prompt set's replayed states came from, in words for acceptance.json."""
    stored, forward = sources["stored"], sources["forward"]
    if stored and forward:
        return "stored states and forward"
    return "stored states" if stored else "forward" if forward else "not replayed"


def offline_check(cfg: dict, target_path: str, drafter_dir: str, runs: list[dict],
                  progress: Progress, held_out_paths: list[str] = (),
                  compared: bool = False, shared: dict | None = None) -> tuple[dict, dict]:
    """Replay each fixed-k drafter run offline on the baseline's greedy answers at the lowest
    concurrency, every prompt set, and compare the acceptance lengths with vLLM's on the same
    requests, per set and over the sets replayed.

    The target's states of an answer are the held-out shards' where extraction stored that
    very sequence (or a longer one it begins), else a forward of the target where it can be
    loaded (:func:`target_loader`), else the answer is left out and counted: the other sets
    (which no shard stores) are then not replayed. Where the shards round the states more than
    the server does (bfloat16 or fp8 beside float32) a loadable target is run instead.

    Returns the comparison per run (acceptance.json ``offline``) and where each set's states
    came from (``offline_replay``). ``compared``: replay the runs of ``drafter_dir`` served
    for comparison (:func:`compare_runs`) instead of this run's drafter's. ``shared``: what
    the replays of one evaluation share (:func:`_replay_inputs`)."""
    from eaglet.offline_eval import coarser

    fixed = _checked_runs(runs, drafter_dir, compared)
    ks = sorted({run["k"] for run in fixed})
    drafter, features, stored, no_stored, served = _replay_inputs(cfg, target_path, drafter_dir,
                                                                  held_out_paths, shared=shared)
    by_set: dict[str, list] = defaultdict(list)
    for lv in _replayed_levels(runs[0]):
        by_set[lv["set"]] += [(a["prompt_token_ids"], a["token_ids"]) for a in lv["_answers"]
                              if a["prompt_token_ids"] and a["token_ids"]]
    replayed = {}
    for name, sequences in by_set.items():
        progress.enter_phase(f"offline replay of {name}: {len(sequences)} answers at k "
                             f"{', '.join(map(str, ks))}")
        replayed[name] = got = replay_sequences(drafter, sequences, ks, features)
        _log_sources(name, got["sources"])
    progress.advance(done=len(fixed))
    out = {run["name"]: _compare(run, replayed) for run in fixed}
    report = {"served_dtype": served, "stored_dtype": stored.dtype if stored else None,
              "stored_states": "read" if stored else no_stored,
              "forward": "loaded" if features.loaded else features.no_forward or "not needed",
              "sets": {name: {"states": _states_label(got["sources"]), **got["sources"]}
                       for name, got in replayed.items()}}
    if stored is not None and any(got["sources"]["stored"] for got in replayed.values()) \
            and coarser(stored.dtype, served):
        report["note"] = (f"replayed from states stored in {stored.dtype} while vLLM serves in "
                          f"{served}: the drafter read rounded inputs, so the replay may differ "
                          f"from vLLM by a little (tests/test_offline_eval.py measures it)")
        log.warning("offline replay: %s", report["note"])
    return out, report


def _replay_inputs(cfg: dict, target_path: str, drafter_dir: str, held_out_paths,
                   final: bool = False, shared: dict | None = None):
    """What an offline replay reads: the drafter, where each answer's states come from
    (:class:`eaglet.offline_eval.Features`; ``final``: the final-norm states too), the stored
    states or why there are none, and the dtype vLLM serves in. ``shared``: what the
    replays of one evaluation share (the target's forwards, loaded once)."""
    from eaglet.offline_eval import Features, TargetForwards, coarser

    drafter = load_for_replay(drafter_dir, target_path)
    layer_ids = drafter.config.aux_layer_ids
    stored, no_stored = stored_states(list(held_out_paths), layer_ids)
    load, no_forward = target_loader(cfg, target_path)
    served = served_dtype(cfg, target_path)
    prefer_forward = stored is not None and coarser(stored.dtype, served)
    forwards = None
    if load is not None and shared is not None:
        forwards = shared.setdefault("forwards", TargetForwards(load))
    features = Features(layer_ids, stored, load, prefer_forward, no_forward, final=final,
                        forwards=forwards)
    return drafter, features, stored, no_stored, served


def load_for_replay(drafter_dir: str, target_path: str):
    """The exported drafter, ready to replay as vLLM drafts with it: EAGLE-3's chain
    (:func:`eaglet.export.load_drafter`) or P-EAGLE's parallel forward
    (:func:`eaglet.peagle.load_peagle`), by :func:`drafter_method`."""
    if drafter_method(drafter_dir) == "peagle":
        return peagle.load_peagle(drafter_dir, target_path)
    from eaglet.export import load_drafter
    return load_drafter(drafter_dir, target_path)


def replay_sequences(drafter, sequences: list[tuple[list[int], list[int]]], ks: list[int],
                     features, temperature: float = 0.0, head=None, top_p: float = 1.0,
                     top_k: int = 0) -> dict:
    """:func:`eaglet.offline_eval.replay_sequences` with the drafts the drafter makes in
    vLLM: EAGLE-3's chain of k forwards, or a P-EAGLE drafter's one parallel forward per
    round (:func:`eaglet.peagle.replay_counts`, :func:`eaglet.peagle.expected_counts`), with
    the same counts, per-sequence counts and sources."""
    from eaglet import offline_eval

    if not isinstance(drafter, peagle.PEagleDrafter):
        return offline_eval.replay_sequences(drafter, sequences, ks, features, temperature, head,
                                             top_p=top_p, top_k=top_k)
    return offline_eval.replay_sequences(drafter, sequences, ks, features, temperature, head,
                                         greedy_counts=peagle.replay_counts,
                                         sampled_counts=peagle.expected_counts,
                                         top_p=top_p, top_k=top_k)


# the offline replay agrees with vLLM within: greedy, where it replays vLLM's answers exactly;
# sampled, where it gives the expected acceptance of answers vLLM sampled
GREEDY_TOLERANCE = 0.01
EXPECTED_TOLERANCE = 0.03
# a sampled run's count farther from its expectation than this many standard errors is no
# longer chance (1 in 370 where it is); how many steps a 3% check needs depends on how sure
# the drafts are: Kimi-K2.5's rehearsal (a sharpened miniature) had a standard error of
# 0.025 over 40 drafting steps, 1% of its AL 2.55
NOISE_ERRORS = 3.0


def _checked_runs(runs: list[dict], drafter_dir: str, compared: bool) -> list[dict]:
    """The runs an offline check replays: this run's drafter's fixed-k runs, or (``compared``)
    those of ``drafter_dir`` served beside it for comparison."""
    if not compared:
        return fixed_k_runs(runs)
    return [r for r in runs if r.get("compare") and r.get("drafter") == drafter_dir]


def expected_check(cfg: dict, target_path: str, drafter_dir: str, runs: list[dict],
                   progress: Progress, held_out_paths: list[str] = (),
                   compared: bool = False, shared: dict | None = None) -> dict:
    """The offline check of runs measured at one temperature above 0 (``runs``): each
    fixed-k drafter run's own sampled answers at the lowest concurrency, every prompt set,
    replayed for their expected acceptance at that temperature
    (:func:`eaglet.offline_eval.expected_replay`) and compared with vLLM's counters of the
    same requests (agreement: within EXPECTED_TOLERANCE). ``matched_acceptance_length``
    beside it: the drafts their tokens took, which is vLLM's own count wherever it sampled
    as the replay assumes. States come as for the greedy check (:func:`offline_check`), the
    final-norm ones with them; a sampled answer is rarely the one stored, so the replay
    mostly needs the target's forward. Returns the comparison per run (acceptance.json
    ``offline_expected``); {} where the target's lm_head cannot be read. ``compared``: check
    the runs of ``drafter_dir`` served for comparison (:func:`compare_runs`) instead of this
    run's drafter's, as :func:`offline_check` does."""
    import torch

    from eaglet.target import TargetError, load_target_lm_head

    fixed = _checked_runs(runs, drafter_dir, compared)
    if not fixed:
        return {}
    drafter, features, *_ = _replay_inputs(cfg, target_path, drafter_dir, held_out_paths,
                                           final=True, shared=shared)
    try:
        # the target's next-token distribution: its final-norm state through its lm_head
        head = load_target_lm_head(target_path,
                                   torch.arange(drafter.config.vocab_size)).float()
    except (TargetError, OSError, KeyError) as exc:
        log.warning("no expected acceptance at temperature %g: the target's lm_head cannot be "
                    "read (%s)", fixed[0]["temperature"], exc)
        progress.advance(done=len(fixed))
        return {}
    out = {}
    for run in fixed:
        t, k = run["temperature"], run["k"]
        by_set: dict[str, list] = defaultdict(list)
        for lv in _replayed_levels(run):
            by_set[lv["set"]] += [(a["prompt_token_ids"], a["token_ids"])
                                  for a in lv["_answers"]
                                  if a["prompt_token_ids"] and a["token_ids"]]
        replayed = {}
        for name, sequences in by_set.items():
            progress.enter_phase(f"expected acceptance of {run['name']} on {name}: "
                                 f"{len(sequences)} answers sampled at "
                                 f"{sampling_text(t, cfg['evaluate'])}")
            replayed[name] = got = replay_sequences(drafter, sequences, [k], features, t, head,
                                                    **cut(cfg["evaluate"]))
            _log_sources(f"{name} ({run['name']})", got["sources"])
        out[run["name"]] = {**_compare(run, replayed, EXPECTED_TOLERANCE),
                            "states": {name: {"states": _states_label(got["sources"]),
                                              **got["sources"]}
                                       for name, got in replayed.items()}}
        progress.advance(done=1)
    return out


def expected_warnings(expected: dict, offline: dict | None, cfg: dict) -> list[str]:
    """The verdict's warnings where a sampled run's acceptance in vLLM is not the expected
    one (:func:`expected_check`), with what the replay of vLLM's own answers and the greedy
    check (``offline``) say about why; a note instead where the difference is within the
    sampling noise of the steps measured and vLLM's answers took the drafts as it counted."""
    warnings = []
    for name, entry in expected.items():
        if entry.get("agrees") is not False:
            continue
        t, vllm, mine = entry["temperature"], entry["vllm_acceptance_length"], \
            entry["acceptance_length"]
        matched = entry.get("matched_acceptance_length")
        taken = matched and within(vllm, matched, entry.get("matched_acceptance_length_high"),
                                   GREEDY_TOLERANCE)
        if entry.get("within_noise") and taken:
            # vLLM's answers took the drafts as it counted, and its count is where chance
            # puts it: too few drafting steps to hold the check to its tolerance
            warnings.append(
                f"Sampled acceptance unresolved: {name}: vLLM counted AL {vllm:.3f} at "
                f"temperature {t:g}, {mine:.3f} expected (ratio "
                f"{entry['ratio_offline_over_vllm']:.3f}), a difference within the sampling "
                f"noise of its {entry['drafts']} drafting steps (standard error "
                f"{entry['standard_error']:.3f}); about {entry['drafts_for_tolerance']} steps "
                f"would hold the check to {entry['tolerance']:.0%}: evaluate more prompts.")
            continue
        greedy = (offline or {}).get(name.rsplit("_T", 1)[0], {}).get("agrees")
        text = (f"SAMPLED ACCEPTANCE DISAGREES: {name}: vLLM counted AL {vllm:.3f} at "
                f"temperature {t:g}, where the target's distribution at that temperature and "
                f"the drafter's drafts give {mine:.3f} in expectation (ratio "
                f"{entry['ratio_offline_over_vllm']:.3f}, beyond {entry['tolerance']:.0%})")
        sampler = False
        if taken:
            # the drafts are the replay's and vLLM's answers took them as often as it
            # counted: what differs is the distribution the answers were sampled from
            sampler = True
            text += (f". vLLM's own answers took the replay's drafts as often as it counted "
                     f"(AL {matched:.3f}): the drafts are right, and vLLM sampled from "
                     f"another distribution than softmax(logits / {t:g})")
        elif matched and greedy:
            # greedy drafts: a draft is accepted exactly where the emitted token is the draft
            sampler = True
            text += (f". The greedy replay agrees with vLLM, so the drafts are right, but "
                     f"vLLM's answers took them at AL {matched:.3f} while it counted "
                     f"{vllm:.3f}: with greedy drafts these are one event (a rejected "
                     f"draft is never the token emitted), so vLLM's rejection sampler did "
                     f"not verify as it should")
        else:
            text += (f"; on vLLM's own answers the replay's drafts were taken at AL "
                     f"{matched:.3f}" if matched else "") + (
                ": check the export (the greedy replay's agreement) or measure more prompts "
                f"({entry['drafts']} drafting steps replayed)")
        if sampler and not cfg["server"].get("gpus"):
            text += (". vLLM's CPU engine 0.32 does so unless eaglet's vLLM plugin fixed its "
                     "rejection sampler's expand (its CPU fallback leaves the per-token "
                     "temperatures uninitialized): the server log says 'eaglet: replaced' "
                     "where it did; without that line reinstall eaglet (pip install -e .), "
                     "with it this disagreement has another cause")
        warnings.append(text + ".")
    return warnings


def top_token_note(entry: dict) -> str:
    """The verdict's sentence that reads a sampled run's AL against the drafts of the
    target's own most likely token on the same answers (:func:`expected_check`'s
    ``top_token_acceptance_length``): at T > 0 even those are rejected where the target
    samples another token, so the AL a drafter can reach falls with the temperature."""
    top, mine = entry.get("top_token_acceptance_length"), entry.get("acceptance_length")
    if not (top and mine and entry.get("temperature")):
        return ""
    return (f"On the same answers, drafts of the target's own most likely token would reach "
            f"AL {top:.2f} at k {entry['k']} and temperature {entry['temperature']:g} "
            f"(this drafter {mine:.2f} expected): what a drafter that always guessed the "
            f"target's top token would get here.")


def _log_sources(name: str, sources: dict) -> None:
    missed = ", ".join(f"{sources[key]} {key.replace('_', ' ')}" for key in
                       ("differs", "longer_than_stored", "not_stored") if sources.get(key))
    text = (f"offline replay of {name}: {sources['sequences']} answers, {sources['stored']} from "
            f"stored states, {sources['forward']} from the target's forward, "
            f"{sources['left_out']} left out" + (f" (against the stored answers: {missed})"
                                                 if missed else ""))
    (log.warning if sources["left_out"] else log.info)(text)


def _per_request_al(counts: list[dict | None], k: int) -> float | None:
    return per_request_acceptance(counts, k)["acceptance_length_per_request"]


def _compare(run: dict, replayed: dict, tolerance: float = GREEDY_TOLERANCE) -> dict:
    """One run's offline acceptance beside vLLM's, per set and over the sets replayed
    (vLLM's counters of those sets' requests at the lowest concurrency), pooled and per
    request (the replay's per sequence beside vLLM's per answer); ``agrees``: their ratio
    within ``tolerance`` of 1."""
    from eaglet.offline_eval import add_counts, empty_counts, summarize

    k = run["k"]
    total, deltas, sequences, answers, sets, partial = empty_counts(k), [], [], [], {}, False
    for name, got in replayed.items():
        levels = [lv for lv in _replayed_levels(run) if lv["set"] == name]
        mine = [lv["_delta"] for lv in levels]
        theirs = [c for lv in levels for c in _answer_counts(lv)]
        offline = summarize(got["counts"][k], k)
        vllm = acceptance(_sum_deltas(mine), k)["acceptance_length"] if mine else None
        sets[name] = {"acceptance_length": offline["acceptance_length"],
                      **({"matched_acceptance_length": offline["matched_acceptance_length"]}
                         if "matched_acceptance_length" in offline else {}),
                      "acceptance_length_per_request": _per_request_al(
                          got["per_sequence"][k], k),
                      "drafts": offline["drafts"], "vllm_acceptance_length": vllm,
                      "vllm_acceptance_length_per_request": _per_request_al(theirs, k),
                      "ratio_offline_over_vllm": _ratio(offline["acceptance_length"], vllm)}
        if got["sources"]["stored"] + got["sources"]["forward"]:
            add_counts(total, got["counts"][k])
            deltas += mine
            sequences += got["per_sequence"][k]
            answers += theirs
            partial = partial or bool(got["sources"]["left_out"])
    offline = summarize(total, k)
    vllm = acceptance(_sum_deltas(deltas), k)["acceptance_length"] if deltas else None
    ratio = _ratio(offline["acceptance_length"], vllm)
    log.info("%s: offline AL %.3f%s, vLLM AL %.3f (ratio %.3f)", run["name"],
             offline["acceptance_length"] or 0,
             f" expected (the answers' own tokens took {offline['matched_acceptance_length']:.3f})"
             if offline.get("matched_acceptance_length") else "", vllm or 0, ratio or 0)
    if ratio is not None and abs(ratio - 1) > 0.05 and not run.get("temperature"):
        log.warning("%s: offline and vLLM acceptance lengths differ by %.1f%%: check the "
                    "exported layer ids, the d2t map and the dtype%s", run["name"],
                    100 * abs(ratio - 1),
                    " (some answers were left out of the replay; vLLM's counters hold them)"
                    if partial else "")
    return {**offline, "acceptance_length_per_request": _per_request_al(sequences, k),
            "vllm_acceptance_length": vllm,
            "vllm_acceptance_length_per_request": _per_request_al(answers, k),
            "ratio_offline_over_vllm": ratio, "temperature": run.get("temperature", 0.0),
            "tolerance": tolerance,
            "agrees": None if ratio is None else within(
                vllm, offline["acceptance_length"], offline.get("acceptance_length_high"),
                tolerance),
            **_noise(offline, vllm, tolerance),
            "sets_compared": [name for name, got in replayed.items()
                              if got["sources"]["stored"] + got["sources"]["forward"]],
            "every_request_replayed": not partial, "sets": sets}


def within(vllm: float, low: float, high: float | None, tolerance: float) -> bool:
    """Whether vLLM's acceptance length is the replay's within ``tolerance`` (their ratio
    within it of 1), where the replay's is the range [``low``, ``high``]: ``high`` counts
    every draft past an answer's end accepted, as vLLM may (:mod:`eaglet.offline_eval`)."""
    return low / (1 + tolerance) <= vllm <= (high or low) / (1 - tolerance)


def _noise(offline: dict, vllm: float | None, tolerance: float) -> dict:
    """For an expected replay (one with a ``standard_error``): whether vLLM's acceptance
    length lies within NOISE_ERRORS standard errors of the expected one, and about how many
    drafting steps would bring NOISE_ERRORS of them down to ``tolerance`` of the AL (what a
    check at that tolerance needs to tell a real difference from chance)."""
    error, mine = offline.get("standard_error"), offline.get("acceptance_length")
    if error is None or vllm is None or mine is None:
        return {}
    drafts = offline["drafts"]
    needed = math.ceil(drafts * (NOISE_ERRORS * error / (tolerance * vllm)) ** 2)
    high = offline.get("acceptance_length_high") or mine  # drafts past an answer's end
    return {"within_noise": mine - NOISE_ERRORS * error <= vllm <= high + NOISE_ERRORS * error,
            "drafts_for_tolerance": max(needed, 1)}


def _ratio(offline: float | None, vllm: float | None) -> float | None:
    return offline / vllm if offline and vllm else None


def _greedy_divergence(runs: list[dict]) -> dict:
    """Per run, how many answers differ from the baseline's at the same level: greedy
    speculative decoding should reproduce them (float ties aside), so many differences
    point at a bug."""
    def answers(run):
        return {(lv["set"], lv["concurrency"], a["id"]): a["token_ids"]
                for lv in run["levels"] for a in lv["_answers"]}
    base = answers(runs[0])
    return {r["name"]: sum(1 for key, ids in answers(r).items() if ids != base.get(key))
            for r in runs[1:]}
