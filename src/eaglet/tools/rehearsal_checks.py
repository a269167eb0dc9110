"""The checks of `eaglet rehearse` (:mod:`eaglet.tools.rehearse`), and the report they fill.

:class:`Report` collects a :class:`Check` per finding: held, failed (with the setting to
change) or not shown here. Before the miniature is built, the real target's own files are
checked: vLLM serves a drafter for it (:func:`check_serving`), the draft vocabulary and aux
layers fit it, the run's drafter can be built for it (:func:`check_drafter`) and its memory
plan is read from its real shape (:func:`check_target`). After the workflow has run on the
miniature, each stage's own checks are read from its outputs (:func:`check_results`,
:func:`expected_line`), and the captured states are compared with a transformers forward of
the same weights (:func:`check_capture`).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.core import methods
from eaglet.core.config import validate
from eaglet.core.io import read_json, read_jsonl
from eaglet.core.layout import (
    ACCEPTANCE,
    DRAFTER_STATS,
    DRAFTER_WEIGHTS,
    HIDDEN_EVAL,
    MANIFEST,
    SYNTHETIC_STATS,
    shard_name,
)
from eaglet.core.methods import default_aux_layer_ids
from eaglet.data import shards
from eaglet.engine.support import (
    ask_in_subprocess,
    mtp_note,
    refusal,
    template_kwargs_refusal,
)
from eaglet.model.config import DrafterConfig
from eaglet.model.sizes import shape_from_target_config
from eaglet.stages.evaluate.offline import GREEDY_TOLERANCE, NOISE_ERRORS, within
from eaglet.stages.evaluate.runs import is_untrained
from eaglet.target.checkpoint import TargetError, check_run_fits, text_config
from eaglet.tools.memory_plan import plan
from eaglet.tools.plan import render

# the rehearsal's log: a check's line reads as the command's, as before the checks had a module
log = logging.getLogger("eaglet.tools.rehearse")


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


def _get(cfg: dict, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


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
    refused = template_kwargs_refusal(files, cfg["generate"].get("chat_template_kwargs"))
    if refused:
        report.add("serving", False, refused, "remove generate.chat_template_kwargs")
        return False
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
    mtp = mtp_note(files, cfg["evaluate"].get("mtp", True))
    if mtp is not None:
        report.add("mtp layers", *mtp)
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


# -- each stage's checks, read from its outputs -----------------------------------------------


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
    # vLLM's own speculation beside the drafter: served, or not measured and why
    for run in acceptance.get("runs") or []:
        if is_untrained(run) and not run.get("temperature"):
            report.add(
                "baseline",
                True,
                f"{run['name']}: vLLM served it, AL "
                f"{run.get('acceptance_length')} over {run.get('drafts')} drafts",
            )
    for run in acceptance.get("not_measured") or []:
        report.add("baseline", None, f"{run['name']} not measured: {run['reason']}")


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
