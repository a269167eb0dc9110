"""`eaglet rehearse`: the user's own run config, end to end on a miniature of their target,
before the real run spends GPU-hours.

The target's config and tokenizer files (kilobytes: from a local directory, or from the hub
without weights) become a miniature of the same architecture (``eaglet.tools.miniature``), taught
the target's chat format. The workflow then runs on it with the user's config: the same
reasoning parser, template variables, trust_remote_code, extraction backend and storage
dtype, aux layers chosen as vLLM would, the drafter settings, evaluation with vLLM's spec
decode and the offline replay. Only what cannot run here is scaled down (sizes, GPUs,
tensor parallelism, prompt counts), each such change listed. Then it prints, stage by
stage, what held and what would have failed, with the setting to change.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eaglet.core import methods
from eaglet.core.config import ConfigError, read_config_file, validate
from eaglet.core.io import read_json, read_jsonl, write_json
from eaglet.core.layout import (
    ACCEPTANCE,
    DRAFTER_STATS,
    DRAFTER_WEIGHTS,
    HIDDEN_EVAL,
    MANIFEST,
    PROGRESS,
    REPO,
    SYNTHETIC_STATS,
    shard_name,
)
from eaglet.core.methods import default_aux_layer_ids
from eaglet.data import shards
from eaglet.engine.support import ask_in_subprocess, refusal
from eaglet.model.config import DrafterConfig
from eaglet.model.sizes import shape_from_target_config
from eaglet.stages.evaluate.offline import GREEDY_TOLERANCE, NOISE_ERRORS, within
from eaglet.target.checkpoint import TargetError, check_run_fits, local_dir, snapshot, text_config
from eaglet.tools.memory_plan import plan
from eaglet.tools.miniature import SHARPEN, TEACH_BATCH, TEACH_STEPS, build
from eaglet.tools.plan import render

log = logging.getLogger("eaglet.tools.rehearse")


# What the rehearsal scales down, and why: sizes that fit 2 CPU cores in minutes. Everything
# else in the user's config is rehearsed as it is.
SCALE = {
    "target.dtype": ("float32", "the CPU engine computes in float32 (bf16 is emulated)"),
    "target.max_model_len": (1024, "the miniature's answers are short"),
    "server.gpus": (0, "the CPU engine"),
    "server.tensor_parallel_size": (1, "one CPU process (tensor parallelism not rehearsed)"),
    "server.enforce_eager": (True, "no graph capture on the CPU engine"),
    "server.memory_utilization": (None, "the KV cache is given a size"),
    "server.kv_cache_gib": (0.5, "the miniature's KV cache"),
    "server.url": (None, "the rehearsal starts its own server"),
    "server.env": ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, "compute on every core"),
    "generate.max_tokens": (64, "short answers"),
    "generate.concurrency": (8, "the miniature's prompts"),
    "extract.gpus": (0, "CPU"),
    "extract.num_shards": (2, "the miniature's data"),
    "extract.max_len": (1024, "the miniature's answers are short"),
    "extract.concurrency": (8, "the miniature's prompts"),
    "extract.aux_layer_ids": (
        None,
        "vLLM's default for the miniature's depth (the run's "
        "own ids are checked against the target's depth)",
    ),
    "train.gpus": (0, "CPU"),
    "train.epochs": (2, "minutes, not hours"),
    "train.max_tokens_per_batch": (512, "the miniature's data"),
    "train.max_len": (None, "the miniature's data"),
    "train.stream_kv_cache_gib": (None, "server.kv_cache_gib's, the miniature's"),
    "train.lr": (2e-3, "a few dozen steps must teach the drafter something to measure"),
    "train.warmup_steps": (2, "a few dozen steps"),
    "evaluate.max_prompts": (4, "minutes, not hours"),
    "evaluate.max_tokens": (32, "minutes, not hours"),
    "evaluate.concurrency": ([1, 4], "the sweep's ends, scaled"),
    "evaluate.rounds": (4, "the offline replay compares the answers of concurrency 1"),
    "evaluate.kv_cache_gib": (0.25, "the miniature's KV cache"),
    "evaluate.schedule": (
        False,
        "one engine run less (the schedule check is a rerun of the same engine path)",
    ),
    "evaluate.prompt_sets": ([], "the held-out split only"),
    "evaluate.ngram": (False, "one server less: ngram is vLLM's, not the run's"),
}
DRAFT_VOCAB = 1024  # at most: the miniature's answers use a few thousand distinct tokens


class RehearsalError(RuntimeError):
    pass


@dataclass
class Check:
    stage: str
    ok: bool | None  # None: not shown here (why in ``detail``)
    detail: str
    fix: str = ""


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    scaled: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    plan: str = ""
    capture: dict = field(default_factory=dict)

    def add(self, stage: str, ok: bool | None, detail: str, fix: str = "") -> None:
        self.checks.append(Check(stage, ok, detail, fix))
        mark = {True: "held", False: "FAILED", None: "not shown"}[ok]
        log.info("%s: %s: %s%s", stage, mark, detail, f" ({fix})" if fix else "")

    @property
    def passed(self) -> bool:
        return all(c.ok is not False for c in self.checks)


# -- the target's files -----------------------------------------------------------------------


def target_files(spec: str, given: str | None, out: Path) -> Path:
    """A directory with the target's config and tokenizer files: ``given``, the target
    itself when it is a local directory, or the hub's files of ``spec`` (no weights)."""

    if given:
        path = Path(given)
    elif spec.startswith("embedded:"):
        raise RehearsalError(
            f"target.model {spec} is the embedded demo target, which runs "
            f"for real: `make demo` is its rehearsal"
        )
    else:
        try:
            path = local_dir(spec) or Path(snapshot(spec, weights=False))
        except TargetError as error:
            raise RehearsalError(str(error)) from None
    if not (path / "config.json").exists():
        raise RehearsalError(
            f"{path} has no config.json: pass --target-files with a directory "
            f"of the target's config and tokenizer files"
        )
    return path


def _sha(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


# -- the rehearsal's config -------------------------------------------------------------------


def _get(cfg: dict, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def rehearsal_config(
    user: dict, miniature: Path, results: Path, target_text: dict | None = None
) -> tuple[dict, list[str]]:
    """The user's config (as written) with the target swapped for its miniature and the
    sizes scaled to minutes on the CPU; and a line for each scaled value that differs.
    ``target_text``: the target's (language model) config, whose attention decides the
    drafter kind the CPU engine can serve beside it."""

    cfg = copy.deepcopy(user)
    full = validate(copy.deepcopy(user))  # what the run gets where its config says nothing
    scaled = []
    for dotted, (value, why) in SCALE.items():
        was = _get(full, dotted)
        if was != value:
            scaled.append(f"{dotted}: {was!r} -> {value!r} ({why})")
        _set(cfg, dotted, value)
    vocab = _get(full, "vocab.draft_vocab_size")
    if vocab > DRAFT_VOCAB:
        _set(cfg, "vocab.draft_vocab_size", DRAFT_VOCAB)
        scaled.append(f"vocab.draft_vocab_size: {vocab!r} -> {DRAFT_VOCAB} (the miniature's data)")
    method = methods.method(_get(full, "train.method"))
    if (target_text or {}).get("kv_lora_rank") and not method.cpu_beside_mla:
        # its layers' attention, which the CPU engine cannot serve beside MLA
        _set(cfg, "train.method", methods.DEFAULT.name)
        scaled.append(
            f"train.method: {method.name!r} -> {methods.DEFAULT.name!r} (vLLM's CPU "
            f"engine cannot serve a {method.words} drafter beside an MLA target: its "
            f"attention finds no KV block size common with MLA's; GPUs serve it. The "
            f"rehearsal shows the data, states and serving path with an MLA "
            f"{methods.DEFAULT.words} drafter; the check on the real target says "
            f"whether {method.words} can be built for it)"
        )
    if (target_text or {}).get("kv_lora_rank") and _get(cfg, "train.drafter_attention") != "mla":
        # vLLM's CPU engine finds no KV block size common to its MLA and its attention backends
        _set(cfg, "train.drafter_attention", "mla")
        scaled.append(
            f"train.drafter_attention: {_get(full, 'train.drafter_attention')!r} -> "
            "'mla' (vLLM's CPU engine serves only an MLA drafter beside an MLA target: "
            "no KV block size common to both backends; GPUs serve either)"
        )
    ks = _get(full, "evaluate.num_speculative_tokens")
    if len(ks) > 1:  # each k is one more server; the path a drafter takes is the same
        _set(cfg, "evaluate.num_speculative_tokens", [min(ks)])
        scaled.append(f"evaluate.num_speculative_tokens: {ks} -> {[min(ks)]} (one server per k)")
    temps = _get(full, "evaluate.temperature")
    kept = [0] + [t for t in temps[-1:] if t]  # 0 (the exact check) and the served one
    if temps != kept:  # each temperature repeats every level's requests
        _set(cfg, "evaluate.temperature", kept)
        scaled.append(f"evaluate.temperature: {temps} -> {kept} (0 and the served temperature)")
    turns = max((s.get("max_turns", 1) for s in _get(user, "data.sources") or []), default=1)
    # ShareGPT first turns answered by the miniature (the user's sources may need the network
    # or be large); a later turn where the run asks for them, so the template's history is
    # rehearsed too
    cfg["data"] = {
        "sources": [
            {
                "type": "sharegpt",
                "limit": 96,
                "max_prompt_chars": 300,
                **({"max_turns": 2} if turns > 1 else {}),
            }
        ],
        "eval_fraction": 0.25,
    }
    scaled.append(
        "data.sources: ShareGPT chats answered by the miniature (96 rows"
        + (", 2 turns" if turns > 1 else "")
        + ")"
    )
    cfg["results_dir"] = str(results)
    _set(cfg, "target.model", str(miniature))
    return cfg, scaled


# -- checks on the target's own files ---------------------------------------------------------


def check_drafter(config: dict, cfg: dict, report: Report) -> bool:
    """Whether the drafter the run's train settings name can be built for the target as
    train.py builds it (``DrafterConfig.from_target``, ``methods.make_drafter``) and so served
    by vLLM: ``drafter_attention: mla`` is the target's own MLA (deepseek_eagle3 reads its
    kv_lora_rank, qk_nope/qk_rope/v_head_dim and loads the drafter only with a q_lora_rank);
    a target without it cannot have one, while ``llama`` fits any target (GPUs serve it
    beside an MLA one)."""

    tr = cfg["train"]
    attention, variant, method = tr["drafter_attention"], tr["drafter_variant"], tr["method"]
    settings = f"train.drafter_attention {attention}, drafter_variant {variant}, method {method}"
    fix = "set train.drafter_attention: llama" if attention == "mla" else "see the setting it names"
    try:
        aux = (
            cfg["extract"]["aux_layer_ids"]  # only their count shapes the drafter
            or default_aux_layer_ids(text_config(config)["num_hidden_layers"])
        )
        DrafterConfig.from_target(config, cfg["vocab"]["draft_vocab_size"], aux, attention, variant)
    except ValueError as error:
        report.add("drafter", False, f"{settings}: {error}", fix)
        return False
    except KeyError as error:
        report.add(
            "drafter",
            False,
            f"{settings}: the target's config.json gives no {error}, "
            f"which the drafter's shape is read from",
            "pass the target's own config.json",
        )
        return False
    record = methods.method(method)
    refused = record.refusal(attention, variant)
    if refused:
        report.add(
            "drafter",
            False,
            f"{settings}: {refused}",
            f"set {record.takes()}, or another train.method",
        )
        return False
    kind = (
        f"{record.depth(tr['dflash_layers'], kind=True)} drafting a block in one forward "
        f"({record.architecture}, served with method {record.served_as})"
        if record.block
        else "the target's multi-head latent attention (Eagle3DeepseekV2ForCausalLM)"
        if attention == "mla"
        else "Llama attention (LlamaForCausalLMEagle3)"
    )
    report.add("drafter", True, f"{settings}: a drafter with {kind} can be built for this target")
    return True


def check_serving(files: Path, cfg: dict, report: Report) -> bool:
    """Whether the installed vLLM serves the run's drafter for the real target: its model
    class for the target's architecture must implement vLLM's EAGLE-3 interface (asked of
    vLLM itself, :mod:`eaglet.engine.support`); a target it cannot serve one for is refused
    here, before the miniature is built or any server starts."""
    answers = ask_in_subprocess(files / "config.json")
    method = methods.words(cfg["train"]["method"])
    refused = refusal(answers, method, str(cfg["target"]["model"]))
    if refused:
        report.add(
            "serving",
            False,
            refused,
            "choose a target vLLM serves a drafter for, or "
            "deploy one of the options above without training",
        )
        return False
    if answers.get("supports_eagle3") is None:
        report.add(
            "serving",
            None,
            f"vLLM could not be asked about this target's class here "
            f"({answers.get('error')}); the miniature's server is the check",
        )
    else:
        report.add(
            "serving",
            True,
            f"vLLM {answers['vllm_version']} serves "
            f"{answers['architecture']} with {answers['model_class']}, which gives the "
            f"aux hidden states {method} drafters read",
        )
    return True


def check_target(files: Path, user: dict, report: Report) -> None:
    """What the real target's config says about the run: draft vocabulary and aux layers
    that fit it, a drafter of the run's kind (:func:`check_drafter`), and the memory plan of
    its real shape."""

    config = json.loads((files / "config.json").read_text())
    text = text_config(config)
    info = {
        "spec": _get(user, "target.model"),
        "vocab_size": text.get("vocab_size"),
        "num_hidden_layers": text.get("num_hidden_layers"),
    }
    try:
        check_run_fits(
            info, _get(user, "vocab.draft_vocab_size"), _get(user, "extract.aux_layer_ids")
        )
        report.add(
            "target",
            True,
            f"{config.get('architectures')} with "
            f"{text.get('num_hidden_layers')} layers and a vocabulary of "
            f"{text.get('vocab_size')}: the draft vocabulary and aux layers fit it",
        )
    except TargetError as error:
        report.add("target", False, str(error), "see the setting it names")
    cfg = validate(copy.deepcopy(user))
    ext, tr = cfg["extract"], cfg["train"]
    buildable = check_drafter(config, cfg, report)
    try:
        # the run's drafter; where it cannot be built (reported above), a Llama-attention one
        shape = shape_from_target_config(
            config,
            cfg["vocab"]["draft_vocab_size"],
            str(cfg["target"]["model"]),
            tr["drafter_attention"] if buildable else "llama",
            tr["drafter_variant"],
            tr["method"],
            tr["dflash_layers"],
        )
        tokens = tr["max_tokens_per_batch"]
        numbers = plan(
            shape,
            tokens=tokens,
            max_len=tr["max_len"] or tokens,
            steps=tr["ttt_steps"],
            batch_tokens=ext["batch_tokens"],
            extract_max_len=ext["max_len"],
            target_dtype=cfg["target"]["dtype"],
            store_dtype=ext["dtype"],
            shard_tokens=1_000_000,
            precision="bfloat16" if tr["precision"] == "auto" else tr["precision"],
            attention=tr["attention"],
            fused_loss=tr["fused_loss"],
        )
        report.plan = render(numbers, ext["dtype"])
        report.add(
            "plan",
            True,
            "eaglet plan read the target's real shape "
            f"({numbers['target_params'] / 1e9:.1f}B parameters, drafter "
            f"{numbers['drafter_params'] / 1e6:.0f}M): see rehearsal.json",
        )
    except Exception as error:  # the plan is advice: its failure is reported, not fatal
        report.add(
            "plan",
            False,
            f"eaglet plan could not read this target: {type(error).__name__}: {error}",
        )


# -- running the workflow ---------------------------------------------------------------------


def run_workflow(config_path: Path, results: Path, cores: int, log_path: Path) -> int:
    """Snakemake on the rehearsal config; its output goes to ``log_path``."""
    snakemake = Path(sys.executable).parent / "snakemake"
    cmd = [
        str(snakemake),
        "--cores",
        str(cores),
        "--workflow-profile",
        str(REPO / "profiles" / "default"),
        "--configfile",
        str(config_path),
        "--config",
        f"results_dir={results}",
    ]
    log.info("running the workflow on the miniature: %s (log: %s)", " ".join(cmd), log_path)
    with open(log_path, "w") as handle:
        return subprocess.run(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT).returncode


def stage_times(results: Path) -> dict[str, float]:
    """Seconds each stage ran, from its progress file."""
    out = {}
    for path in sorted((results / PROGRESS).glob("*.json")):
        data = read_json(path)
        if data.get("elapsed_s") is not None:
            out[path.stem] = float(data["elapsed_s"])
    return out


def failed_rule(log_path: Path) -> str | None:
    """The first rule Snakemake reports as failed, and its error's last lines."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    marker = "Error in rule "
    if marker not in text:
        return None
    tail = text.split(marker, 1)[1]
    rule = tail.split(":", 1)[0]
    # the stage's own exception (its log is inlined above the marker): the line that names it
    # and its message, not a server's log lines about its own shutdown that follow it
    raised = [
        line
        for line in text.split(marker, 1)[1].splitlines() + text.splitlines()
        if re.match(r"[\w.]*(Error|Exception): \S", line)
    ]
    if raised:
        return f"{rule}: {raised[0]}"
    lines = [line for line in text.splitlines() if "Error" in line or "error:" in line]
    return f"{rule}: " + " | ".join(lines[-3:])


def check_results(results: Path, cfg: dict, report: Report) -> None:
    """Each stage's own checks, read from its outputs."""
    stats = _read(results / SYNTHETIC_STATS)
    if stats is None:
        report.add("generate", False, "no synthetic/stats.json: generation did not finish")
        return
    template = stats.get("template_check") or {}
    mismatched = template.get("mismatched", 0)
    differs = template.get("template_differs") or 0
    report.add(
        "generate",
        mismatched == 0,
        f"{template.get('checked', 0)} samples checked (prompt ids as the server renders "
        f"them, completion ids holding the parser's reasoning and content in their "
        f"wrappers), {mismatched} mismatched"
        + (
            f"; the server renders {differs} prompts otherwise than the chat template "
            f"(the server's are trained on): "
            f"{(template.get('template_first_difference') or {}).get('difference')}"
            if differs
            else ""
        ),
        "" if not mismatched else "see synthetic/stats.json for the first differing token",
    )
    records = [
        r
        for split in ("train", "eval")
        for r in read_jsonl(results / "synthetic" / f"{split}.jsonl")
        if r.get("model") != "dataset"
    ]
    if cfg["server"].get("reasoning_parser"):
        split = sum(bool(r.get("reasoning")) and bool(r.get("content")) for r in records)
        share = split / len(records) if records else 0.0
        report.add(
            "reasoning",
            share >= 0.9,
            f"the {cfg['server']['reasoning_parser']} parser split reasoning and answer in "
            f"{split} of {len(records)} samples ({share:.0%})",
            ""
            if share >= 0.9
            else "server.reasoning_parser must match the template's wrapper tokens",
        )
    manifest = _read(results / MANIFEST)
    if manifest is None:
        report.add("extract", False, "no hidden/manifest.json")
        return
    streamed = cfg["train"].get("data") == "stream"
    report.add(
        "extract",
        True,
        (f"{len(manifest.get('eval_shards', []))} held-out shard(s) only (train.data stream)")
        if streamed
        else f"{len(manifest.get('shards', []))} shards, teacher agreement "
        f"{manifest.get('teacher_agreement', manifest.get('agreement'))}",
    )
    if not (results / DRAFTER_WEIGHTS).exists():
        report.add("train", False, "no drafter/model.safetensors")
        return
    stream = (_read(results / DRAFTER_STATS) or {}).get("stream") or {}
    agreement = stream.get("teacher_agreement")
    report.add(
        "train",
        True,
        "drafter trained and exported"
        + (
            f" on streamed states: {stream.get('requests')} prefill requests to its own capture "
            f"server, {stream.get('saved_files')} files saved by generation, teacher agreement "
            + (f"{agreement:.3f}" if isinstance(agreement, float) else f"{agreement}")
            if streamed
            else ""
        ),
    )
    acceptance = _read(results / ACCEPTANCE)
    if acceptance is None:
        report.add("evaluate", False, "no eval/acceptance.json")
        return
    offline = acceptance.get("offline") or {}
    for name, row in offline.items():
        ratio = row.get("ratio_offline_over_vllm")
        ok = bool(row.get("agrees"))  # within 1% (of the range drafts past an end allow)
        high = row.get("acceptance_length_high")
        report.add(
            "evaluate",
            ok,
            f"{name}: vLLM AL {row.get('vllm_acceptance_length')}, "
            f"offline replay AL {row.get('acceptance_length')}"
            + (
                f" to {high} with the {row.get('past_end')} drafts past an answer's "
                "end that vLLM verifies and the answer cannot show"
                if high
                else ""
            )
            + f" (ratio {ratio})",
            "" if ok else "the export, aux layer ids or d2t disagree with vLLM",
        )
    if not offline:
        report.add("evaluate", False, "no offline replay in acceptance.json")
    for name, row in (acceptance.get("offline_expected") or {}).items():
        report.add("evaluate", *expected_line(name, row))


def expected_line(name: str, row: dict) -> tuple[bool, str, str]:
    """The check of a run sampled at a temperature (acceptance.json ``offline_expected``):
    the replay's drafts on vLLM's own answers must be taken exactly as vLLM counted (within
    the greedy 1%: a draft is accepted where the answer's token is the draft), and vLLM's
    acceptance length must be the expected one within the tolerance or, on a rehearsal's
    few prompts, within the sampling noise (evaluate.NOISE_ERRORS standard errors)."""

    vllm, mine, matched = (
        row.get(key)
        for key in ("vllm_acceptance_length", "acceptance_length", "matched_acceptance_length")
    )
    if not (vllm and mine and matched):
        return False, f"{name}: no expected acceptance to compare", ""
    taken = within(vllm, matched, row.get("matched_acceptance_length_high"), GREEDY_TOLERANCE)
    expected = bool(row.get("agrees") or row.get("within_noise"))
    high = row.get("matched_acceptance_length_high")
    text = (
        f"{name} at temperature {row.get('temperature'):g}: vLLM AL {vllm:.3f}, its answers "
        f"took the replay's drafts at AL {matched:.3f}"
        + (
            f" to {high:.3f} with the {row.get('past_end')} drafts past an answer's end"
            if high
            else ""
        )
        + f", expected {mine:.3f} (ratio "
        f"{row.get('ratio_offline_over_vllm'):.3f}, standard error "
        f"{row.get('standard_error') or 0:.3f} over {row.get('drafts')} drafting steps)"
    )
    why = (
        ""
        if taken and expected
        else "the drafts differ from vLLM's: the export, aux layer ids or d2t"
        if not taken
        else f"vLLM's count is beyond {row.get('tolerance', 0):.0%} and {NOISE_ERRORS:g} standard "
        f"errors of the expected one: vLLM sampled from another distribution than the "
        f"run's temperature, top-p and top-k give"
    )
    return taken and expected, text, why


# Relative error per row the stored states may have against a float32 forward: float32 is
# the engine's arithmetic against transformers' (6e-7 measured on the embedded target), the
# others add their storage rounding (bf16 and fp16 keep 8 and 11 significant bits, fp8 e4m3 3)
CAPTURE_TOLERANCE = {"float32": 1e-3, "float16": 2e-3, "bfloat16": 1e-2, "fp8": 8e-2}
CAPTURE_SAMPLES = 8
# logits: closer top-two logits are a tie, left out of the argmax check; the storage's rounding
# (CAPTURE_TOLERANCE of the state) moves a logit by up to about that share of it, so the margin
# grows with it (fp8 storage beside a sharpened miniature flipped 2 of 198 argmaxes whose top
# two logits were 0.01 to 1 apart)
ARGMAX_MARGIN = 0.01


def check_capture(results: Path, miniature: Path, trust_remote_code: bool, report: Report) -> None:
    """The held-out shard's states, as the engine computed and stored them, against a
    transformers float32 forward of the same weights: relative error per row of every aux
    layer, and the teacher's argmax at every position."""
    import torch
    from transformers import AutoModelForCausalLM

    path = results / HIDDEN_EVAL / shard_name(0)
    if not path.exists():
        report.add("capture", False, "no held-out shard to compare")
        return
    shard = shards.load(path)
    model = AutoModelForCausalLM.from_pretrained(
        miniature, dtype=torch.float32, trust_remote_code=trust_remote_code
    ).eval()
    worst, rows, agree, positions = 0.0, 0, 0, 0
    offsets = shard.offsets.tolist()
    with torch.inference_mode():
        for i in range(min(CAPTURE_SAMPLES, shard.num_samples)):
            lo, hi = offsets[i], offsets[i + 1]
            out = model(shard.input_ids[lo:hi][None], output_hidden_states=True)
            forward = torch.cat([out.hidden_states[a][0] for a in shard.aux_layer_ids], -1)
            stored = shard.aux_hidden[lo:hi].float()
            width = forward.shape[-1] // len(shard.aux_layer_ids)
            for j in range(len(shard.aux_layer_ids)):  # each layer's row on its own scale
                f, s_ = (
                    forward[:, j * width : (j + 1) * width],
                    stored[:, j * width : (j + 1) * width],
                )
                error = (s_ - f).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-12)
                worst = max(worst, float(error.max()))
            # the teacher's argmax is stored for answer positions (-1 elsewhere); a near-tie
            # of the top two logits (a miniature taught a pool of answers has them where an
            # answer starts) flips with the engine's rounding, and says nothing of the capture
            top = out.logits[0].float().topk(2, dim=-1)
            teacher = shard.teacher_argmax[lo:hi]
            margin = ARGMAX_MARGIN + CAPTURE_TOLERANCE[shard.dtype] * top.values[:, 0].abs()
            decisive = (teacher >= 0) & (top.values[:, 0] - top.values[:, 1] > margin)
            agree += int((top.indices[:, 0] == teacher)[decisive].sum())
            rows += int(decisive.sum())
            positions += hi - lo
    tolerance = CAPTURE_TOLERANCE[shard.dtype]
    share = agree / rows if rows else 0.0
    ok = worst <= tolerance and share >= 0.99
    report.capture = {
        "dtype": shard.dtype,
        "positions": positions,
        "worst_relative_error": worst,
        "tolerance": tolerance,
        "argmax_rows": rows,
        "argmax_agreement": share,
    }
    report.add(
        "capture",
        ok,
        f"the engine's stored states of {positions} positions against a "
        f"transformers float32 forward: worst relative error per row {worst:.2e} "
        f"({shard.dtype} storage, at most {tolerance:g}); the same argmax at {share:.1%} "
        f"of {rows} answer positions without a near-tie",
        ""
        if ok
        else "the captured layers are not the forward's: check "
        "extract.aux_layer_ids and the engine's aux-state capture for this model",
    )


def _read(path: Path):
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


# -- the command ------------------------------------------------------------------------------


def render_report(report: Report) -> str:
    mark = {True: "ok  ", False: "FAIL", None: "n/a "}
    lines = ["", "Rehearsal:"]
    for check in report.checks:
        lines.append(f"  {mark[check.ok]} {check.stage:<10} {check.detail}")
        if check.fix:
            lines.append(f"       {'':<10} -> {check.fix}")
    if report.times:
        lines.append(
            "  stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in report.times.items())
        )
    if report.scaled:
        lines.append("  scaled down for the rehearsal (not rehearsed at the run's value):")
        lines += [f"    {line}" for line in report.scaled]
    lines.append(
        "REHEARSAL PASSED"
        if report.passed
        else "REHEARSAL FAILED: fix the settings above before the real run"
    )
    return "\n".join(lines)


def rehearse(
    config_file: str, target_files_dir: str | None, out: Path, cores: int, teach_seconds: float
) -> Report:

    started = time.monotonic()
    user = read_config_file(config_file)
    validate(copy.deepcopy(user))  # a wrong setting is said before anything runs
    report = Report()
    spec = _get(user, "target.model") or ""
    files = target_files(spec, target_files_dir, out / "target-files")
    stage = "target"
    try:
        if check_serving(files, validate(copy.deepcopy(user)), report):
            check_target(files, user, report)
            stage = "miniature"
            _rehearse_on_miniature(user, files, out, cores, teach_seconds, report)
    except Exception as error:  # the report is the product: a failure is its FAIL line
        log.debug("the rehearsal stopped", exc_info=True)
        if stage == "miniature" and any(c.stage == "miniature" for c in report.checks):
            stage = "workflow"  # the miniature was built: what failed came after it
        report.add(stage, False, f"{type(error).__name__}: {error}")
    report.times["total"] = time.monotonic() - started
    write_json(
        out / "rehearsal.json",
        {
            "passed": report.passed,
            "checks": [c.__dict__ for c in report.checks],
            "scaled": report.scaled,
            "times_s": report.times,
            "capture": report.capture,
            "plan": report.plan,
        },
    )
    return report


def _rehearse_on_miniature(
    user: dict, files: Path, out: Path, cores: int, teach_seconds: float, report: Report
) -> None:
    """Build (or reuse) the miniature, run the workflow on it, and read each stage's checks."""
    miniature = out / "miniature"
    stamp = {
        "files_sha256": _sha(files),
        "teach_seconds": teach_seconds,
        "teach_steps": [TEACH_STEPS, TEACH_BATCH],
        "sharpen": SHARPEN,
        "lr_decay": "linear",
        "template_kwargs": _get(user, "generate.chat_template_kwargs") or {},
        "reasoning_parser": _get(user, "server.reasoning_parser"),
        "answers": "composed from the format (miniature.answer_text), checked learned",
    }
    if _read(miniature / "built.json") != stamp:
        t0 = time.monotonic()
        info = build(
            files,
            miniature,
            trust_remote_code=bool(_get(user, "target.trust_remote_code")),
            template_kwargs=stamp["template_kwargs"],
            reasoning_parser=stamp["reasoning_parser"],
            teach_seconds=teach_seconds,
        )
        write_json(miniature / "built.json", stamp)
        report.times["miniature"] = time.monotonic() - t0
    info = read_json(miniature / "miniature.json")
    taught = info["taught"]
    learned = taught["learned"]
    whole = learned["in_format"] == learned["answers"]
    failure = learned["first_failure"] or {}
    report.add(
        "miniature",
        whole,
        f"{info['architecture']}, {info['parameters'] / 1e6:.1f}M "
        f"parameters; taught the chat format ({taught['format']}) for {taught['steps']} "
        f"steps (loss {taught['loss_first']} -> {taught['loss_last']}): "
        f"{learned['in_format']} of {learned['answers']} greedy and sampled answers "
        f"closed their reasoning and ended their turn"
        + (
            ""
            if whole
            else f"; the first that did not ("
            f"{'sampled' if failure.get('sampled') else 'greedy'}, "
            f"{'no end of turn' if not failure.get('ended_turn') else 'reasoning not closed'}): "
            f"{failure.get('answer')!r}"
        ),
        "" if whole else "give the miniature more time: eaglet rehearse --teach-seconds",
    )
    if info.get("wrapper"):
        report.add(
            "wrapper",
            None,
            f"{info['wrapper']} served as its language model: the "
            "CPU engine cannot load a multimodal wrapper's processors",
        )

    results = out / "results"
    cfg, report.scaled = rehearsal_config(
        user, miniature, results, text_config(json.loads((files / "config.json").read_text()))
    )
    report.scaled += [
        f"target's config: {change} (the miniature is float32 and unquantized on "
        f"the CPU engine; eaglet plan sizes the real one)"
        for change in info.get("changes", [])
        if change.endswith(" dropped")
    ]
    config_path = out / "rehearsal.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    code = run_workflow(config_path, results, cores, out / "snakemake.log")
    report.times.update(stage_times(results))
    check_results(results, validate(copy.deepcopy(cfg)), report)
    if (results / MANIFEST).exists():
        check_capture(results, miniature, bool(_get(user, "target.trust_remote_code")), report)
    if code != 0:
        report.add(
            "workflow",
            False,
            failed_rule(out / "snakemake.log") or f"snakemake exited {code}",
            f"see {out / 'snakemake.log'}",
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet rehearse", description=__doc__.splitlines()[0])
    parser.add_argument("--configfile", required=True, help="the real run's config")
    parser.add_argument(
        "--target-files",
        help="a directory of the target's config and "
        "tokenizer files (default: target.model's, from the hub without weights)",
    )
    parser.add_argument("--out", help="where the rehearsal writes (default rehearsal/<config>)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--teach-seconds",
        type=float,
        default=150.0,
        help="how long the miniature learns the chat format",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    out = Path(args.out or Path("rehearsal") / Path(args.configfile).stem).resolve()
    out.mkdir(parents=True, exist_ok=True)

    try:
        report = rehearse(args.configfile, args.target_files, out, args.cores, args.teach_seconds)
    except (RehearsalError, ConfigError) as error:
        print(f"eaglet rehearse: {error}", file=sys.stderr)
        return 2
    print(render_report(report))
    return 0 if report.passed else 1
