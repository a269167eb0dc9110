"""The verdict: does the drafter speed up serving?

For each engine run (the target alone, vLLM's ``ngram`` speculation, and the trained
EAGLE-3 drafter at every ``num_speculative_tokens`` k), start vLLM, send the held-out prompts
greedily at a fixed concurrency, read the spec-decode Prometheus counters before and after
(``/metrics`` deltas), and stop the server. Acceptance length is ``1 + accepted/drafts``,
acceptance rate ``accepted/draft_tokens``, per-position rate ``per_pos[i]/drafts``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.request
from collections import defaultdict
from typing import Any

import httpx

from eaglet import rates
from eaglet.io import read_jsonl, write_json
from eaglet.progress import Progress
from eaglet.server import ServerError, VLLMServer, server_args

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
    """Acceptance length, rate and per-position rates from counter deltas."""
    drafts, draft_tokens, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted"]
    if not drafts:
        return {"k": k, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                "acceptance_length": None, "acceptance_rate": None, "per_position_rate": []}
    return {
        "k": k, "drafts": int(drafts), "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "per_position_rate": [p / drafts for p in delta["per_position"]],
    }


def read_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


async def _run_prompts(url: str, prompts: list[dict], max_tokens: int, concurrency: int,
                       timeout: float) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(prompt: dict) -> dict:
            async with gate:
                start = time.perf_counter()
                resp = await client.post("/v1/chat/completions", json={
                    "model": "target", "messages": prompt["messages"], "temperature": 0.0,
                    "max_tokens": max_tokens, "seed": 0, "return_token_ids": True})
                if resp.status_code != 200:
                    raise EvaluationError(f"request for {prompt['id']} failed: HTTP "
                                          f"{resp.status_code}: {resp.text[:300]}")
                body = resp.json()
                return {"id": prompt["id"], "latency_s": time.perf_counter() - start,
                        "completion_tokens": body["usage"]["completion_tokens"],
                        "prompt_token_ids": body.get("prompt_token_ids"),
                        "token_ids": body["choices"][0].get("token_ids")}
        return await asyncio.gather(*(one(p) for p in prompts))


def speculative_config(run: dict) -> dict | None:
    if run["method"] == "baseline":
        return None
    spec = {"method": run["method"], "num_speculative_tokens": run["k"]}
    if run["method"] == "eagle3":
        spec["model"] = run["drafter"]
    return {**spec, **run.get("extra", {})}


def engine_run(cfg: dict, target_path: str, run: dict, prompts: list[dict],
               log_path: str) -> dict:
    """Serve once with ``run``'s speculation, send every prompt, return its measurements."""
    ev, server_cfg = cfg["evaluate"], cfg["server"]
    args = server_args(cfg["target"], server_cfg, served_model_name="target")
    spec = speculative_config(run)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    server = VLLMServer(model=target_path, log_path=log_path, args=args,
                        port=server_cfg["port"], startup_timeout_s=server_cfg["startup_timeout_s"],
                        shutdown_grace_s=server_cfg["shutdown_grace_s"])
    name = run["name"]
    log.info("%s: starting vLLM (%s)", name, json.dumps(spec) if spec else "no speculation")
    try:
        server.__enter__()
    except ServerError as exc:
        what = "vLLM refused the drafter" if run["method"] == "eagle3" else "vLLM did not start"
        raise EvaluationError(f"{name}: {what}.\n{exc}") from None
    try:
        before = spec_counters(read_metrics(server.url))
        start = time.perf_counter()
        answers = asyncio.run(_run_prompts(server.url, prompts, ev["max_tokens"],
                                           ev["concurrency"], ev["request_timeout_s"]))
        wall = time.perf_counter() - start
        after = spec_counters(read_metrics(server.url))
    finally:
        server.__exit__(None, None, None)
    tokens = sum(a["completion_tokens"] for a in answers)
    result = {"name": name, "method": run["method"], "concurrency": ev["concurrency"],
              "requests": len(answers), "output_tokens": tokens, "wall_s": wall,
              "output_tokens_per_s": tokens / wall,
              "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
              **acceptance(counter_delta(before, after), run.get("k"))}
    if spec is not None and not result["drafts"]:
        raise EvaluationError(
            f"{name}: vLLM served without drafting anything (no spec-decode drafts in "
            f"/metrics): the speculative config was not applied. Server log: {log_path}")
    log.info("%s: %d tokens in %.1f s (%.1f tok/s)%s", name, tokens, wall,
             result["output_tokens_per_s"],
             f", AL {result['acceptance_length']:.3f}" if result["acceptance_length"] else "")
    result["_answers"] = answers
    return result


LOW_ACCEPTANCE = 0.3   # share of draft tokens accepted below which a drafter is suspect


def verdict(runs: list[dict]) -> dict:
    """Whether the drafter speeds serving up here, against ngram and the k+1 ceiling."""
    baseline = next(r for r in runs if r["method"] == "baseline")
    ngram = next((r for r in runs if r["method"] == "ngram"), None)
    drafts = [r for r in runs if r["method"] == "eagle3"]
    best = max(drafts, key=lambda r: r["speedup"]) if drafts else None
    warnings = []
    for r in drafts:
        if r["speedup"] < 1.0:
            warnings.append(
                f"SLOWER THAN NO DRAFTER: {r['name']} serves {r['speedup']:.2f}x the baseline's "
                f"tokens/s (acceptance rate {_pct(r['acceptance_rate'])}): the drafts cost more "
                f"than they save. Check the training curves (acc_0), the vocabulary coverage, "
                f"and that the aux layer ids match between extraction and serving.")
        elif r["acceptance_rate"] is not None and r["acceptance_rate"] < LOW_ACCEPTANCE:
            others = [o for o in drafts if (o["acceptance_rate"] or 0) >= LOW_ACCEPTANCE]
            hint = (f"serve a smaller k ({others[-1]['name']} accepts "
                    f"{_pct(others[-1]['acceptance_rate'])})" if others
                    else "train on more data or longer")
            warnings.append(
                f"LOW ACCEPTANCE: {r['name']} accepts {_pct(r['acceptance_rate'])} of its draft "
                f"tokens. It still serves {r['speedup']:.2f}x the baseline here, where a draft "
                f"step is cheap next to the target's, but at this rate speculation usually slows "
                f"serving down where it is not (GPU serving at higher concurrency): {hint}.")
    out: dict[str, Any] = {"concurrency": baseline["concurrency"], "warnings": warnings}
    if best is not None:
        out.update({
            "best": best["name"], "speedup": best["speedup"],
            "speeds_up_serving": best["speedup"] > 1.0,
            "acceptance_length": best["acceptance_length"],
            "ceiling": best["k"] + 1,
            "share_of_ceiling": (best["acceptance_length"] or 1) / (best["k"] + 1),
        })
        if ngram is not None and ngram["acceptance_length"]:
            out["ngram_acceptance_length"] = ngram["acceptance_length"]
            out["beats_ngram"] = (best["acceptance_length"] or 1) > ngram["acceptance_length"]
            out["ngram_speedup"] = ngram["speedup"]
            out["faster_than_ngram"] = best["speedup"] > ngram["speedup"]
        out["summary"] = (
            f"EAGLE-3 ({best['name']}) reaches AL {best['acceptance_length']:.2f} of a possible "
            f"{best['k'] + 1} and {best['speedup']:.2f}x the baseline's tokens/s at concurrency "
            f"{baseline['concurrency']}"
            + (_ngram_clause(best, ngram) if ngram and ngram["acceptance_length"] else "")
            + (". It speeds serving up on this machine." if best["speedup"] > 1.0
               else ". It does NOT speed serving up on this machine."))
    return out


def _pct(rate: float | None) -> str:
    return "?" if rate is None else f"{rate:.0%}"


def _ngram_clause(best: dict, ngram: dict) -> str:
    """ngram drafts only where the text repeats the prompt, so its AL (over its own drafts)
    can be higher while it serves fewer tokens per second: say which one wins on each."""
    text = f"; ngram reaches AL {ngram['acceptance_length']:.2f} and {ngram['speedup']:.2f}x"
    higher_al = ngram["acceptance_length"] > (best["acceptance_length"] or 1)
    faster = best["speedup"] > ngram["speedup"]
    if higher_al and faster:
        text += (f" (a higher AL over fewer drafts: {ngram.get('drafts', '?')} against "
                 f"{best.get('drafts', '?')}; EAGLE-3 is faster)")
    elif not higher_al and not faster:
        text += " (EAGLE-3 drafts better but ngram is faster here)"
    return text


def run_plan(ev: dict, drafter_dir: str | None = None) -> tuple[list[dict], int]:
    """The stage's engine runs in order (the baseline first, which the others are measured
    against) and how many offline replays follow them (one per EAGLE-3 run)."""
    plan = [{"name": "baseline", "method": "baseline"}]
    if ev["ngram"]:
        plan.append({"name": f"ngram_k{ev['ngram_k']}", "method": "ngram", "k": ev["ngram_k"],
                     "extra": ev["ngram_config"]})
    plan += [{"name": f"eagle3_k{k}", "method": "eagle3", "k": k, "drafter": drafter_dir}
             for k in ev["num_speculative_tokens"]]
    replays = sum(run["method"] == "eagle3" for run in plan) if ev["offline"] else 0
    return plan, replays


def run_stage(cfg: dict, target_json: str, drafter_dir: str, prompts_path: str,
              out_path: str, log_dir: str, progress_path: str | None = None,
              log_path: str | None = None) -> dict:
    from eaglet.target import read_target

    ev = cfg["evaluate"]
    target = read_target(target_json)
    prompts = read_jsonl(prompts_path)
    if ev["max_prompts"]:
        prompts = prompts[:ev["max_prompts"]]
    plan, replays = run_plan(ev, drafter_dir)
    progress = Progress("evaluate", total=len(plan) + replays, path=progress_path,
                        log_path=log_path, unit="runs", interval_s=0.0)
    runs = []
    for run in plan:
        progress.enter_phase(f"{run['name']} in vLLM")
        runs.append(engine_run(cfg, target["path"], run, prompts,
                               f"{log_dir}/evaluate.{run['name']}.server.log"))
        progress.advance(done=1, tokens=runs[-1]["output_tokens"])
    base = runs[0]
    for r in runs:
        r["speedup"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["latency_ratio"] = r["mean_latency_s"] / base["mean_latency_s"]
    rates.record("evaluate", target["spec"], baseline_tokens_per_s=base["output_tokens_per_s"])
    mismatched = _greedy_divergence(runs)
    offline = offline_check(target["path"], drafter_dir, runs, progress) if ev["offline"] else None
    progress.report("finished")
    result = {"prompts": len(prompts), "max_tokens": ev["max_tokens"],
              "concurrency": ev["concurrency"], "target": target["path"], "drafter": drafter_dir,
              "runs": [{k: v for k, v in r.items() if k != "_answers"} for r in runs],
              "outputs_differ_from_baseline": mismatched, "offline": offline,
              "verdict": verdict(runs)}
    write_json(out_path, result)
    for warning in result["verdict"]["warnings"]:
        log.warning(warning)
    if "summary" in result["verdict"]:
        log.info(result["verdict"]["summary"])
    return result


def offline_check(target_path: str, drafter_dir: str, runs: list[dict],
                  progress: Progress) -> dict:
    """Replay each EAGLE-3 run offline on the baseline's greedy answers and compare the
    acceptance lengths with vLLM's."""
    import torch
    from transformers import AutoModelForCausalLM

    from eaglet.export import load_drafter
    from eaglet.offline_eval import offline_acceptance

    base = runs[0]["_answers"]
    sequences = [(a["prompt_token_ids"], a["token_ids"]) for a in base
                 if a["prompt_token_ids"] and a["token_ids"]]
    progress.enter_phase("loading the target for the offline replays")
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    drafter = load_drafter(drafter_dir, target_path)
    out = {}
    for run in runs:
        if run["method"] != "eagle3":
            continue
        progress.enter_phase(f"{run['name']} replayed offline")
        offline = offline_acceptance(model, drafter, sequences, run["k"])
        ratio = (offline["acceptance_length"] / run["acceptance_length"]
                 if offline["acceptance_length"] and run["acceptance_length"] else None)
        out[run["name"]] = {**offline, "vllm_acceptance_length": run["acceptance_length"],
                            "ratio_offline_over_vllm": ratio}
        progress.advance(done=1)
        log.info("%s: offline AL %.3f, vLLM AL %.3f (ratio %.3f)", run["name"],
                 offline["acceptance_length"] or 0, run["acceptance_length"] or 0, ratio or 0)
        if ratio is not None and abs(ratio - 1) > 0.05:
            log.warning("%s: offline and vLLM acceptance lengths differ by %.1f%%: check the "
                        "exported layer ids, the d2t map and the dtype", run["name"],
                        100 * abs(ratio - 1))
    return out


def _greedy_divergence(runs: list[dict]) -> dict:
    """Per run, how many answers differ from the baseline's: greedy speculative decoding
    should reproduce them (float ties aside), so many differences point at a bug."""
    base = {a["id"]: a["token_ids"] for a in runs[0]["_answers"]}
    return {r["name"]: sum(1 for a in r["_answers"] if a["token_ids"] != base.get(a["id"]))
            for r in runs[1:]}
