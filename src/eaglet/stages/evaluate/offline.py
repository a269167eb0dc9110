"""The offline check of the sweep: eaglet's own replay of the drafter on the answers vLLM
gave, held to vLLM's counters (exactly at T 0, by expectation above), and its warnings."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from functools import partial
from pathlib import Path

from eaglet.core.io import human_size, read_json
from eaglet.core.progress import Progress
from eaglet.engine.grammar import draft_filter
from eaglet.model import methods
from eaglet.model import replay as offline_eval
from eaglet.model.replay import (
    Features,
    StoredStates,
    TargetForwards,
    add_counts,
    coarser,
    empty_counts,
    summarize,
)
from eaglet.model.sizes import SERVED_BYTES, target_size
from eaglet.stages.evaluate.metrics import (
    _answer_counts,
    _sum_deltas,
    acceptance,
    per_request_acceptance,
)
from eaglet.stages.evaluate.placement import HOST_USABLE, host_memory_bytes
from eaglet.stages.evaluate.runs import cut, drafter_method, sampling_text
from eaglet.stages.evaluate.schedule import fixed_k_runs
from eaglet.target.checkpoint import TargetError, load_target_lm_head

log = logging.getLogger("eaglet.stages.evaluate.offline")


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
    name = str(
        text.get("torch_dtype")
        or text.get("dtype")
        or config.get("torch_dtype")
        or config.get("dtype")
        or "bfloat16"
    ).removeprefix("torch.")
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
        return None, (
            f"a float32 forward of the target needs about {human_size(size.float32)} "
            f"(from {size.source}), more than {HOST_USABLE:.0%} of the machine's "
            f"{human_size(ram)} RAM"
        )

    def load():
        import torch
        from transformers import AutoModelForCausalLM

        log.info(
            "loading the target (float32, %s) for the offline replay's forward",
            human_size(size.float32),
        )
        return AutoModelForCausalLM.from_pretrained(
            target_dir,
            dtype=torch.float32,
            trust_remote_code=cfg["target"].get("trust_remote_code", False),
        ).eval()

    return load, None


def stored_states(paths: list[str], layer_ids: list[int]):
    """The held-out shards' stored states (:class:`eaglet.model.replay.StoredStates`) and
    None; or None and why they cannot serve the drafter's replay."""

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
        return None, (
            f"the held-out shards store aux layers {stored.aux_layer_ids}, the "
            f"drafter reads {list(layer_ids)}"
        )
    return stored, None


def _states_label(sources: dict) -> str:
    """Where one prompt set's replayed states came from, in words for acceptance.json."""
    stored, forward = sources["stored"], sources["forward"]
    if stored and forward:
        return "stored states and forward"
    return "stored states" if stored else "forward" if forward else "not replayed"


def offline_check(
    cfg: dict,
    target_path: str,
    drafter_dir: str,
    runs: list[dict],
    progress: Progress,
    held_out_paths: list[str] = (),
    compared: bool = False,
    shared: dict | None = None,
) -> tuple[dict, dict]:
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

    fixed = _checked_runs(runs, drafter_dir, compared)
    ks = sorted({run["k"] for run in fixed})
    drafter, features, stored, no_stored, served = _replay_inputs(
        cfg, target_path, drafter_dir, held_out_paths, shared=shared
    )
    by_set: dict[str, list] = defaultdict(list)
    for lv in _replayed_levels(runs[0]):
        by_set[lv["set"]] += [
            (a["prompt_token_ids"], a["token_ids"])
            for a in lv["_answers"]
            if a["prompt_token_ids"] and a["token_ids"]
        ]
    replayed = {}
    keep_for = server_filter(cfg, target_path, shared)
    for name, sequences in by_set.items():
        progress.enter_phase(
            f"offline replay of {name}: {len(sequences)} answers at k {', '.join(map(str, ks))}"
        )
        replayed[name] = got = replay_sequences(drafter, sequences, ks, features, keep_for=keep_for)
        _log_sources(name, got["sources"])
    progress.advance(done=len(fixed))
    out = {run["name"]: _compare(run, replayed) for run in fixed}
    report = {
        "served_dtype": served,
        "stored_dtype": stored.dtype if stored else None,
        "stored_states": "read" if stored else no_stored,
        "forward": "loaded" if features.loaded else features.no_forward or "not needed",
        "sets": {
            name: {"states": _states_label(got["sources"]), **got["sources"]}
            for name, got in replayed.items()
        },
    }
    if (
        stored is not None
        and any(got["sources"]["stored"] for got in replayed.values())
        and coarser(stored.dtype, served)
    ):
        report["note"] = (
            f"replayed from states stored in {stored.dtype} while vLLM serves in "
            f"{served}: the drafter read rounded inputs, so the replay may differ "
            f"from vLLM by a little (tests/test_offline_eval.py measures it)"
        )
        log.warning("offline replay: %s", report["note"])
    return out, report


def _replay_inputs(
    cfg: dict,
    target_path: str,
    drafter_dir: str,
    held_out_paths,
    final: bool = False,
    shared: dict | None = None,
):
    """What an offline replay reads: the drafter, where each answer's states come from
    (:class:`eaglet.model.replay.Features`; ``final``: the final-norm states too), the stored
    states or why there are none, and the dtype vLLM serves in. ``shared``: what the
    replays of one evaluation share (the target's forwards, loaded once)."""

    drafter = load_for_replay(drafter_dir, target_path)
    layer_ids = drafter.config.aux_layer_ids
    stored, no_stored = stored_states(list(held_out_paths), layer_ids)
    load, no_forward = target_loader(cfg, target_path)
    served = served_dtype(cfg, target_path)
    prefer_forward = stored is not None and coarser(stored.dtype, served)
    forwards = None
    if load is not None and shared is not None:
        forwards = shared.setdefault("forwards", TargetForwards(load))
    features = Features(
        layer_ids, stored, load, prefer_forward, no_forward, final=final, forwards=forwards
    )
    return drafter, features, stored, no_stored, served


def server_filter(cfg: dict, target_path: str, shared: dict | None = None):
    """What the run's server keeps of each draft, where its reasoning parser holds every
    answer to a grammar (:func:`eaglet.engine.grammar.draft_filter`); None where it does not.
    Asked once per evaluation (``shared``)."""
    if shared is not None and "server_filter" in shared:
        return shared["server_filter"]
    found = draft_filter(
        target_path,
        cfg["server"].get("reasoning_parser"),
        cfg["target"].get("trust_remote_code", False),
    )
    if shared is not None:
        shared["server_filter"] = found
    return found


def load_for_replay(drafter_dir: str, target_path: str):
    """The exported drafter, whatever its method (:func:`drafter_method`), ready to replay as
    vLLM drafts with it (:func:`eaglet.model.methods.load`)."""
    return methods.load(drafter_dir, target_path, method=drafter_method(drafter_dir))


def replay_sequences(
    drafter,
    sequences: list[tuple[list[int], list[int]]],
    ks: list[int],
    features,
    temperature: float = 0.0,
    head=None,
    top_p: float = 1.0,
    top_k: int = 0,
    keep_for=None,
) -> dict:
    """:func:`eaglet.model.replay.replay_sequences` with the drafts the drafter makes in
    vLLM (:func:`eaglet.model.methods.draft_function`: EAGLE-3's chain of k forwards, or the
    one forward per round of P-EAGLE and DFlash), kept as the server keeps them
    (``keep_for``: :func:`server_filter`), with the same counts, per-sequence counts and
    sources."""
    draft = methods.draft_function(drafter)
    return offline_eval.replay_sequences(
        drafter,
        sequences,
        ks,
        features,
        temperature,
        head,
        greedy_counts=partial(offline_eval.replay_counts, draft=draft),
        sampled_counts=partial(offline_eval.expected_counts, draft=draft),
        top_p=top_p,
        top_k=top_k,
        keep_for=keep_for,
    )


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


def expected_check(
    cfg: dict,
    target_path: str,
    drafter_dir: str,
    runs: list[dict],
    progress: Progress,
    held_out_paths: list[str] = (),
    compared: bool = False,
    shared: dict | None = None,
) -> dict:
    """The offline check of runs measured at one temperature above 0 (``runs``): each
    fixed-k drafter run's own sampled answers at the lowest concurrency, every prompt set,
    replayed for their expected acceptance at that temperature
    (:func:`eaglet.model.replay.expected_replay`) and compared with vLLM's counters of the
    same requests (agreement: within EXPECTED_TOLERANCE). ``matched_acceptance_length``
    beside it: the drafts their tokens took, which is vLLM's own count wherever it sampled
    as the replay assumes. States come as for the greedy check (:func:`offline_check`), the
    final-norm ones with them; a sampled answer is rarely the one stored, so the replay
    mostly needs the target's forward. Returns the comparison per run (acceptance.json
    ``offline_expected``); {} where the target's lm_head cannot be read. ``compared``: check
    the runs of ``drafter_dir`` served for comparison (:func:`compare_runs`) instead of this
    run's drafter's, as :func:`offline_check` does."""
    import torch

    fixed = _checked_runs(runs, drafter_dir, compared)
    if not fixed:
        return {}
    drafter, features, *_ = _replay_inputs(
        cfg, target_path, drafter_dir, held_out_paths, final=True, shared=shared
    )
    try:
        # the target's next-token distribution: its final-norm state through its lm_head
        head = load_target_lm_head(target_path, torch.arange(drafter.config.vocab_size)).float()
    except (TargetError, OSError, KeyError) as exc:
        log.warning(
            "no expected acceptance at temperature %g: the target's lm_head cannot be read (%s)",
            fixed[0]["temperature"],
            exc,
        )
        progress.advance(done=len(fixed))
        return {}
    out = {}
    keep_for = server_filter(cfg, target_path, shared)
    for run in fixed:
        t, k = run["temperature"], run["k"]
        by_set: dict[str, list] = defaultdict(list)
        for lv in _replayed_levels(run):
            by_set[lv["set"]] += [
                (a["prompt_token_ids"], a["token_ids"])
                for a in lv["_answers"]
                if a["prompt_token_ids"] and a["token_ids"]
            ]
        replayed = {}
        for name, sequences in by_set.items():
            progress.enter_phase(
                f"expected acceptance of {run['name']} on {name}: "
                f"{len(sequences)} answers sampled at "
                f"{sampling_text(t, cfg['evaluate'])}"
            )
            replayed[name] = got = replay_sequences(
                drafter,
                sequences,
                [k],
                features,
                t,
                head,
                **cut(cfg["evaluate"]),
                keep_for=keep_for,
            )
            _log_sources(f"{name} ({run['name']})", got["sources"])
        out[run["name"]] = {
            **_compare(run, replayed, EXPECTED_TOLERANCE),
            "states": {
                name: {"states": _states_label(got["sources"]), **got["sources"]}
                for name, got in replayed.items()
            },
        }
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
        t, vllm, mine = (
            entry["temperature"],
            entry["vllm_acceptance_length"],
            entry["acceptance_length"],
        )
        matched = entry.get("matched_acceptance_length")
        taken = matched and within(
            vllm, matched, entry.get("matched_acceptance_length_high"), GREEDY_TOLERANCE
        )
        if entry.get("within_noise") and taken:
            # vLLM's answers took the drafts as it counted, and its count is where chance
            # puts it: too few drafting steps to hold the check to its tolerance
            warnings.append(
                f"Sampled acceptance unresolved: {name}: vLLM counted AL {vllm:.3f} at "
                f"temperature {t:g}, {mine:.3f} expected (ratio "
                f"{entry['ratio_offline_over_vllm']:.3f}), a difference within the sampling "
                f"noise of its {entry['drafts']} drafting steps (standard error "
                f"{entry['standard_error']:.3f}); about {entry['drafts_for_tolerance']} steps "
                f"would hold the check to {entry['tolerance']:.0%}: evaluate more prompts."
            )
            continue
        greedy = (offline or {}).get(name.rsplit("_T", 1)[0], {}).get("agrees")
        text = (
            f"SAMPLED ACCEPTANCE DISAGREES: {name}: vLLM counted AL {vllm:.3f} at "
            f"temperature {t:g}, where the target's distribution at that temperature and "
            f"the drafter's drafts give {mine:.3f} in expectation (ratio "
            f"{entry['ratio_offline_over_vllm']:.3f}, beyond {entry['tolerance']:.0%})"
        )
        sampler = False
        if taken:
            # the drafts are the replay's and vLLM's answers took them as often as it
            # counted: what differs is the distribution the answers were sampled from
            sampler = True
            text += (
                f". vLLM's own answers took the replay's drafts as often as it counted "
                f"(AL {matched:.3f}): the drafts are right, and vLLM sampled from "
                f"another distribution than softmax(logits / {t:g})"
            )
        elif matched and greedy:
            # greedy drafts: a draft is accepted exactly where the emitted token is the draft
            sampler = True
            text += (
                f". The greedy replay agrees with vLLM, so the drafts are right, but "
                f"vLLM's answers took them at AL {matched:.3f} while it counted "
                f"{vllm:.3f}: with greedy drafts these are one event (a rejected "
                f"draft is never the token emitted), so vLLM's rejection sampler did "
                f"not verify as it should"
            )
        else:
            text += (
                f"; on vLLM's own answers the replay's drafts were taken at AL {matched:.3f}"
                if matched
                else ""
            ) + (
                ": check the export (the greedy replay's agreement) or measure more prompts "
                f"({entry['drafts']} drafting steps replayed)"
            )
        if sampler and not cfg["server"].get("gpus"):
            text += (
                ". vLLM's CPU engine 0.32 does so unless eaglet's vLLM plugin fixed its "
                "rejection sampler's expand (its CPU fallback leaves the per-token "
                "temperatures uninitialized): the server log says 'eaglet: replaced' "
                "where it did; without that line reinstall eaglet (pip install -e .), "
                "with it this disagreement has another cause"
            )
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
    return (
        f"On the same answers, drafts of the target's own most likely token would reach "
        f"AL {top:.2f} at k {entry['k']} and temperature {entry['temperature']:g} "
        f"(this drafter {mine:.2f} expected): what a drafter that always guessed the "
        f"target's top token would get here."
    )


def _log_sources(name: str, sources: dict) -> None:
    missed = ", ".join(
        f"{sources[key]} {key.replace('_', ' ')}"
        for key in ("differs", "longer_than_stored", "not_stored")
        if sources.get(key)
    )
    text = (
        f"offline replay of {name}: {sources['sequences']} answers, {sources['stored']} from "
        f"stored states, {sources['forward']} from the target's forward, "
        f"{sources['left_out']} left out"
        + (f" (against the stored answers: {missed})" if missed else "")
    )
    (log.warning if sources["left_out"] else log.info)(text)


def _per_request_al(counts: list[dict | None], k: int) -> float | None:
    return per_request_acceptance(counts, k)["acceptance_length_per_request"]


def _compare(run: dict, replayed: dict, tolerance: float = GREEDY_TOLERANCE) -> dict:
    """One run's offline acceptance beside vLLM's, per set and over the sets replayed
    (vLLM's counters of those sets' requests at the lowest concurrency), pooled and per
    request (the replay's per sequence beside vLLM's per answer); ``agrees``: their ratio
    within ``tolerance`` of 1."""

    k = run["k"]
    total, deltas, sequences, answers, sets, partial = empty_counts(k), [], [], [], {}, False
    for name, got in replayed.items():
        levels = [lv for lv in _replayed_levels(run) if lv["set"] == name]
        mine = [lv["_delta"] for lv in levels]
        theirs = [c for lv in levels for c in _answer_counts(lv)]
        offline = summarize(got["counts"][k], k)
        vllm = acceptance(_sum_deltas(mine), k)["acceptance_length"] if mine else None
        sets[name] = {
            "acceptance_length": offline["acceptance_length"],
            **(
                {"matched_acceptance_length": offline["matched_acceptance_length"]}
                if "matched_acceptance_length" in offline
                else {}
            ),
            "acceptance_length_per_request": _per_request_al(got["per_sequence"][k], k),
            "drafts": offline["drafts"],
            "vllm_acceptance_length": vllm,
            "vllm_acceptance_length_per_request": _per_request_al(theirs, k),
            "ratio_offline_over_vllm": _ratio(offline["acceptance_length"], vllm),
        }
        if got["sources"]["stored"] + got["sources"]["forward"]:
            add_counts(total, got["counts"][k])
            deltas += mine
            sequences += got["per_sequence"][k]
            answers += theirs
            partial = partial or bool(got["sources"]["left_out"])
    offline = summarize(total, k)
    vllm = acceptance(_sum_deltas(deltas), k)["acceptance_length"] if deltas else None
    ratio = _ratio(offline["acceptance_length"], vllm)
    log.info(
        "%s: offline AL %.3f%s, vLLM AL %.3f (ratio %.3f)",
        run["name"],
        offline["acceptance_length"] or 0,
        f" expected (the answers' own tokens took {offline['matched_acceptance_length']:.3f})"
        if offline.get("matched_acceptance_length")
        else "",
        vllm or 0,
        ratio or 0,
    )
    if ratio is not None and abs(ratio - 1) > 0.05 and not run.get("temperature"):
        log.warning(
            "%s: offline and vLLM acceptance lengths differ by %.1f%%: check the "
            "exported layer ids, the d2t map and the dtype%s",
            run["name"],
            100 * abs(ratio - 1),
            " (some answers were left out of the replay; vLLM's counters hold them)"
            if partial
            else "",
        )
    return {
        **offline,
        "acceptance_length_per_request": _per_request_al(sequences, k),
        "vllm_acceptance_length": vllm,
        "vllm_acceptance_length_per_request": _per_request_al(answers, k),
        "ratio_offline_over_vllm": ratio,
        "temperature": run.get("temperature", 0.0),
        "tolerance": tolerance,
        "agrees": None
        if ratio is None
        else within(
            vllm, offline["acceptance_length"], offline.get("acceptance_length_high"), tolerance
        ),
        **_noise(offline, vllm, tolerance),
        "sets_compared": [
            name
            for name, got in replayed.items()
            if got["sources"]["stored"] + got["sources"]["forward"]
        ],
        "every_request_replayed": not partial,
        "sets": sets,
    }


def within(vllm: float, low: float, high: float | None, tolerance: float) -> bool:
    """Whether vLLM's acceptance length is the replay's within ``tolerance`` (their ratio
    within it of 1), where the replay's is the range [``low``, ``high``]: ``high`` counts
    every draft past an answer's end accepted, as vLLM may (:mod:`eaglet.model.replay`)."""
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
    return {
        "within_noise": mine - NOISE_ERRORS * error <= vllm <= high + NOISE_ERRORS * error,
        "drafts_for_tolerance": max(needed, 1),
    }


def _ratio(offline: float | None, vllm: float | None) -> float | None:
    return offline / vllm if offline and vllm else None


def _greedy_divergence(runs: list[dict]) -> dict:
    """Per run, how many answers differ from the baseline's at the same level: greedy
    speculative decoding should reproduce them (float ties aside), so many differences
    point at a bug."""

    def answers(run):
        return {
            (lv["set"], lv["concurrency"], a["id"]): a["token_ids"]
            for lv in run["levels"]
            for a in lv["_answers"]
        }

    base = answers(runs[0])
    return {
        r["name"]: sum(1 for key, ids in answers(r).items() if ids != base.get(key))
        for r in runs[1:]
    }
