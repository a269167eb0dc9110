"""One run of the sweep, torch-free: its sampling, the prompt sets and levels it is sent,
the drafter it serves (method, variant, speculative config) and its temperatures."""

from __future__ import annotations

import os
from pathlib import Path

from eaglet.core import methods
from eaglet.core.io import read_json, read_jsonl
from eaglet.core.layout import START_RECORD_NAME
from eaglet.data.prompts import load_source
from eaglet.model.config import norm_flags

# the runs of train.init_from's starting drafter, served as published beside the fine-tuned one
START_LABEL = "start"


class EvaluationError(RuntimeError):
    pass


# Sampling pinned to the softmax at the request's temperature, cut only by the run's
# evaluate.top_p and top_k: without these, vLLM fills them from the target's
# generation_config.json (Qwen3's top_k 20 and top_p 0.95, say), and the offline replay's
# target distribution would not be the one vLLM verified against.
PLAIN_SAMPLING = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


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
            [f"top-k {c['top_k']}"] if c["top_k"] else []
        )
    return ", ".join(parts)


HELD_OUT = "heldout"
MAX_BATCH = 1 << 16  # the last schedule range runs to here; vLLM caps it at max_num_seqs
# every answer of a speculative run carries its own spec-decode counts (vLLM's
# metrics.speculative_decoding; vLLM refuses the flag without a speculative config)
PER_REQUEST_METRICS = ["--per-request-spec-decode-metrics", "summary"]


def load_prompt_sets(ev: dict, held_out_path: str, train_path: str | None) -> tuple[dict, dict]:
    """The prompt sets to measure on, name -> prompts (each capped at ``max_prompts``), and
    what each is. The held-out split comes first; every configured set follows, less any
    prompt the drafter was trained on."""

    train_ids = {p["id"] for p in read_jsonl(train_path)} if train_path else set()
    sets = {HELD_OUT: read_jsonl(held_out_path)}
    about = {HELD_OUT: {"source": "the held-out split of data.sources"}}
    for entry in ev["prompt_sets"]:
        name = entry["name"]
        if name in sets:
            raise EvaluationError(
                f"evaluate.prompt_sets: the name {name!r} is used twice "
                f"({HELD_OUT!r} is the held-out split's)"
            )
        records, report = load_source(entry["source"])
        kept = [p for p in records if p["id"] not in train_ids]
        sets[name] = kept
        about[name] = {
            "source": report["label"],
            "rows": report["rows"],
            "bad": report["bad"],
            "in_training_dropped": len(records) - len(kept),
        }
        if not kept:
            raise EvaluationError(
                f"evaluate.prompt_sets {name!r}: every prompt is also a "
                f"training prompt; measure on prompts the drafter has not seen"
            )
    for name in sets:
        sets[name] = sets[name][: ev["max_prompts"]]
        about[name]["prompts"] = len(sets[name])
    return sets, about


def level_prompts(prompts: list[dict], concurrency: int, rounds: int) -> list[dict]:
    """What one concurrency level sends: ``rounds`` times as many prompts as it keeps in flight
    (the set's first ones), so every level runs at its concurrency for most of its time."""
    return prompts[: rounds * concurrency]


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
    exported config.json says (:func:`eaglet.core.methods.exported`: DFlash's architecture,
    P-EAGLE's ``parallel_drafting``). EAGLE-3 where no config.json is there yet (the plan of a
    run not trained yet)."""
    return methods.exported(drafter_dir).name


def drafter_kind(drafter_dir: str | os.PathLike) -> tuple[str, str, str]:
    """The exported drafter's method, and its method and variant as a run-name label and in
    words: ``("peagle", "peagle", "P-EAGLE")``, ``("dflash", "dflash", "DFlash, 2 layers")``,
    ``("eagle3", "eagle31", "EAGLE-3.1")`` where
    its config.json carries the norms of train.drafter_variant eagle3.1, else
    ``("eagle3", "eagle3", "EAGLE-3")``."""

    method = methods.exported(drafter_dir)
    if Path(drafter_dir, START_RECORD_NAME).is_file():  # train.init_from's, as published
        return method.name, START_LABEL, f"{_kind(drafter_dir, method)[1]}, as published"
    return (method.name, *_kind(drafter_dir, method))


def _kind(drafter_dir: str | os.PathLike, method: methods.Method) -> tuple[str, str]:
    """(run-name label, words) of the drafter exported in ``drafter_dir``."""
    config_path = Path(drafter_dir, "config.json")
    config = read_json(config_path) if config_path.is_file() else {}
    if method.block:  # its depth (train.dflash_layers) in words
        return method.name, (f"{method.words}, {method.depth(config.get('num_hidden_layers', 1))}")
    variant = methods.variant_of(norm_flags(config)) if config else methods.EAGLE3_LAYER
    if len(method.variants) > 1 and variant.flags:  # a variant of the EAGLE-3 layer
        return variant.label, variant.words
    return method.name, method.words


def is_drafter(run: dict) -> bool:
    """Whether ``run`` serves the trained drafter (any method), not vLLM's own speculation or
    the target alone."""
    return run["method"] in methods.METHODS


def is_untrained(run: dict) -> bool:
    """Whether ``run`` serves vLLM's own speculation (ngram, suffix, the target's MTP layers):
    a baseline to compare with, which the evaluation reports as not measured where vLLM
    cannot serve it, and the drafter's verdict comes out all the same."""
    return run["method"] in methods.SPECULATIONS


def not_measured(run: dict, reason: str) -> dict:
    """The record of an engine run that was not measured, and why (acceptance.json's
    ``not_measured``, the verdict's words)."""
    return {"name": run["name"], "method": run["method"], "k": run.get("k"), "reason": reason}


def speculative_config(run: dict) -> dict | None:
    """vLLM's ``--speculative-config`` of ``run``: its drafter's (served as its method's record
    says: :meth:`eaglet.core.methods.Method.speculative_config`), or vLLM's own speculation;
    None for the target alone."""
    if run["method"] == "baseline":
        return None
    if is_drafter(run):
        spec = methods.method(run["method"]).speculative_config(run["drafter"], run["k"])
    else:
        spec = {"method": run["method"], "num_speculative_tokens": run["k"]}
    return {**spec, **run.get("extra", {})}


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
    return {
        **run,
        "name": name,
        "temperature": temperature,
        "sampling": sampling_text(temperature, ev or {}),
    }
