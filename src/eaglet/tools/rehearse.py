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

This module holds the command: the target's files, the rehearsal's config (:data:`SCALE`,
:func:`rehearsal_config`), the miniature, running the workflow and the printed report. The
checks, and the :class:`~eaglet.tools.rehearsal_checks.Report` they fill, are
:mod:`eaglet.tools.rehearsal_checks`.
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
from pathlib import Path

import yaml

from eaglet.core import methods
from eaglet.core.config import ConfigError, read_config_file, validate
from eaglet.core.io import read_json, write_json
from eaglet.core.layout import MANIFEST, PROGRESS, REPO
from eaglet.target.checkpoint import TargetError, local_dir, snapshot, text_config
from eaglet.tools.miniature import SHARPEN, TEACH_BATCH, TEACH_STEPS, build
from eaglet.tools.rehearsal_checks import (
    Report,
    _get,
    _read,
    check_capture,
    check_results,
    check_serving,
    check_target,
)

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
    if (info.get("mtp") or {}).get("why"):
        report.add(
            "mtp layers",
            None,
            f"the miniature carries no MTP layer: {info['mtp']['why']}; its evaluation reports "
            "the mtp baseline as not measured, which the real target's may be",
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
