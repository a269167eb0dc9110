"""The ``generate`` stage: serve the target (or use ``server.url``), answer every prompt of
every split, check the chat-template round trip, and write the records and their stats.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eaglet.core import rates
from eaglet.core.io import hold_directory, read_jsonl, write_json, write_jsonl
from eaglet.core.progress import Progress
from eaglet.data.prompts import RECORDED_ANSWER
from eaglet.data.template_check import answer_format, check_records, enforce
from eaglet.engine.capture import capture_args, capture_layer_ids
from eaglet.engine.server import target_server
from eaglet.stages.generate.answers import (
    Sampling,
    answer_settings,
    drop_stale,
    read_partial,
    turn_ids,
    turns_left,
)
from eaglet.stages.generate.rendering import (
    apply_server_prompts,
    check_renderable,
    dataset_records,
    end_of_turn_ids,
    load_tokenizer,
    render_on_server,
    rendered_path,
    too_long_check,
)
from eaglet.stages.generate.run import (
    collect,
    engine_seeding,
    generate,
    prefill_recorded,
    settings_from_config,
)
from eaglet.target.checkpoint import read_target, read_target_config, text_config
from eaglet.target.states import resolve_aux_layer_ids  # torch-heavy, needed only here

log = logging.getLogger("eaglet.stages.generate")


def capture_options(cfg: dict[str, Any], model_path: str, capture_dir: str) -> list[str]:
    """Server arguments that save every request's hidden states (the aux layers of
    ``extract.aux_layer_ids`` and the last layer's output) under ``capture_dir``."""

    num_layers = text_config(read_target_config(model_path))["num_hidden_layers"]
    aux = resolve_aux_layer_ids(cfg["extract"]["aux_layer_ids"], num_layers)
    Path(capture_dir).mkdir(parents=True, exist_ok=True)
    return capture_args(capture_layer_ids(aux, num_layers), Path(capture_dir).resolve())


def run_stage(
    cfg: dict[str, Any],
    target_json: str,
    prompts: dict[str, str],
    outputs: dict[str, str],
    stats_path: str,
    partial_path: str,
    progress_path: str | None,
    log_path: str | None,
    server_log_path: str,
    capture_dir: str | None = None,
) -> dict:
    """The ``generate`` rule: serve the target (or use ``server.url``), answer every prompt of
    every split (``prompts`` and ``outputs`` map a split name to its file), check the
    chat-template round trip, and write the records and their stats.

    With ``capture_dir`` (``generate.capture_hidden_states``) the server runs with the
    capture options (:mod:`eaglet.engine.capture`) and saves the hidden states of every
    answer there, named by :func:`eaglet.core.io.request_path`, for the extraction stage to pack."""
    # the partial file: a generation still running (a killed Snakemake's orphan) and its
    # rerun would append to it at once
    with hold_directory(Path(partial_path).parent, "generate"):
        return _run_stage(
            cfg,
            target_json,
            prompts,
            outputs,
            stats_path,
            partial_path,
            progress_path,
            log_path,
            server_log_path,
            capture_dir,
        )


def _run_stage(
    cfg,
    target_json,
    prompts,
    outputs,
    stats_path,
    partial_path,
    progress_path,
    log_path,
    server_log_path,
    capture_dir,
) -> dict:
    target = read_target(target_json)
    by_split = {split: read_jsonl(path) for split, path in prompts.items()}
    gen = cfg["generate"]
    tokenizer = load_tokenizer(target["path"], cfg["target"].get("trust_remote_code", False))
    too_long = too_long_check(
        tokenizer, cfg["target"]["max_model_len"], gen["chat_template_kwargs"]
    )
    # answers: dataset: the recorded answer is the sample (held-out prompts carry none)
    recorded = dataset_records(
        [p for ps in by_split.values() for p in ps if "answer" in p],
        tokenizer,
        gen,
        end_of_turn_ids(tokenizer, target["path"]),
        too_long,
    )
    everything = [
        p for split_prompts in by_split.values() for p in split_prompts if p["id"] not in recorded
    ]
    server_prompts = rendered_path(partial_path)
    if recorded:
        log.info(
            "%d prompts answered by their recorded answers (answers: dataset), %d to ask "
            "the target; %d of their prompts as the server rendered them before",
            len(recorded),
            len(everything),
            apply_server_prompts(recorded, server_prompts),
        )
    check_renderable(everything, gen["system_prompt"], tokenizer, gen["chat_template_kwargs"])
    requests = sum(len(turn_ids(p)) for p in everything)
    plan = {
        "kind": "decode",
        "servers": 1,
        "prompts": len(everything),
        "requests": requests,
        "max_tokens": gen["max_tokens"],
        "concurrency": gen["concurrency"],
    }
    progress = Progress(
        "generate", total=requests, path=progress_path, log_path=log_path, plan=plan
    )
    server_cfg = cfg["server"]
    records = drop_stale(
        read_partial(partial_path),
        answer_settings(
            Sampling.from_config(gen),
            gen["chat_template_kwargs"],
            capture_dir is not None,
            gen["system_prompt"],
        ),
    )
    if not any(turns_left(p, records) for p in everything):
        log.info("every prompt already has an answer in %s; no server needed", partial_path)
        progress.restart(already_done=requests)
    elif server_cfg["url"]:
        if capture_dir:
            raise RuntimeError(
                "generate.capture_hidden_states needs the server eaglet starts "
                "with its capture options; set server.url: null"
            )
        log.info("using the running server at %s", server_cfg["url"])
        settings = settings_from_config(cfg, server_cfg["url"].rstrip("/"))
        records = generate(everything, settings, partial_path, progress, too_long=too_long)
        render_on_server(settings.base_url, recorded, server_prompts, gen, settings.model_name)
    else:
        progress.enter_phase("starting the vLLM server")
        capture = capture_options(cfg, target["path"], capture_dir) if capture_dir else []
        per_request, seed_args = engine_seeding(cfg)
        with target_server(cfg, target["path"], server_log_path, capture + seed_args) as server:
            settings = settings_from_config(cfg, server.url)
            settings.seed_per_request = per_request
            if capture_dir:
                settings.capture_dir = str(Path(capture_dir).resolve())
            records = generate(
                everything,
                settings,
                partial_path,
                progress,
                health_check=server.check_alive,
                too_long=too_long,
            )
            render_on_server(
                server.url, recorded, server_prompts, gen, health_check=server.check_alive
            )
            if capture_dir and recorded:
                progress.enter_phase(
                    f"prefilling {len(recorded)} recorded answers for their hidden states"
                )
                prefill_recorded(
                    server.url,
                    list(recorded.values()),
                    settings.capture_dir,
                    cfg,
                    health_check=server.check_alive,
                )
                progress.enter_phase(None)
        rates.record(rates.GENERATE, target["spec"], server_start_s=server.ready_after_s)
    run = progress.report("finished")
    if run["done"] > run["resumed_from"]:
        rates.record(
            rates.GENERATE,
            target["spec"],
            settings=rates.generate_settings(cfg),
            completion_tokens_per_s=run["tokens_per_s"],
        )

    records = {**records, **recorded}
    kept = {}
    stats: dict[str, Any] = {"splits": {}, "dataset_answers": len(recorded)}
    for split, split_prompts in by_split.items():
        kept[split], stats["splits"][split] = collect(split_prompts, records, gen["keep_truncated"])
    counts = stats["splits"]
    failed = sum(c["failed"] for c in counts.values())
    if failed / max(requests, 1) > gen["max_failed_rate"]:
        failures = [f for c in counts.values() for f in c["failures"]]
        examples = "; ".join(f"{f['id']}: {f['error'][:200]}" for f in failures[:3])
        raise RuntimeError(
            f"{failed} of {requests} requests failed for good (more than "
            f"generate.max_failed_rate={gen['max_failed_rate']}): {examples}. The answers so far "
            f"are kept in {partial_path}; fix the cause and rerun to retry only the failed prompts."
        )

    fmt = answer_format(
        tokenizer,
        server_cfg["reasoning_parser"],
        end_of_turn_ids(tokenizer, target["path"]),
        gen["chat_template_kwargs"],
    )
    # the server's rendering is the prompts' reference: the ids it recorded for its answers,
    # its rendering of the recorded answers' prompts (the chat template's where it gave none)
    template = check_records(
        tokenizer,
        [r for split in kept.values() for r in split],
        fmt=fmt,
        reference=lambda r: (
            r["prompt_token_ids"]
            if r.get("model") != RECORDED_ANSWER or r.get("prompt_rendered_by") == "server"
            else None
        ),
    )
    if template["template_differs"]:
        first = template["template_first_difference"]
        log.warning(
            "the server renders %d of %d prompts otherwise than the target's chat "
            "template (first: %s, %s); training uses the server's, which serving will "
            "see",
            template["template_differs"],
            template["checked"],
            first["id"],
            first["difference"],
        )
    stats.update(
        {
            "template_check": template,
            "this_run": {
                "generated": run["done"] - run["resumed_from"],
                "failed": run["failed"],
                "resumed_from": run["resumed_from"],
                "wall_s": run["elapsed_s"],
                "requests_per_s": run["rate_per_s"],
                "completion_tokens_per_s": run["tokens_per_s"],
            },
            "sampling": Sampling.from_config(gen).settings(),
            "target": target["path"],
        }
    )
    for split, c in counts.items():
        log.info(
            "%s: %d samples (%d failed, %d truncated%s, %d too long to ask), %d completion tokens",
            split,
            c["samples"],
            c["failed"],
            c["truncated"],
            ", dropped" if c["truncated_dropped"] else "",
            c["too_long"],
            c["completion_tokens"],
        )
    log.info(
        "template check: %d of %d mismatched, %d retokenized",
        template["mismatched"],
        template["checked"],
        template["retokenized"],
    )
    enforce(template, gen["max_template_mismatch_rate"])
    for split, path in outputs.items():
        write_jsonl(path, kept[split])
    write_json(stats_path, stats)
    return stats
