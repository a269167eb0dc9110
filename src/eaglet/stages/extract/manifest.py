"""The extraction stage's last step, over the shards of either backend: every shard verified
(hash, aux layers, dtype, target), the ones that fail extracted again by the configured backend
(:mod:`eaglet.stages.extract.hf` or :mod:`eaglet.stages.extract.vllm`), and
``hidden/manifest.json`` written: per shard its samples, tokens, bytes, digest and teacher
agreement, and how the states were computed (:func:`computed_by`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from eaglet.core.io import read_json, read_jsonl, write_json
from eaglet.core.layout import server_log
from eaglet.data import shards
from eaglet.stages.extract import vllm
from eaglet.stages.extract.hf import extract_shard, hidden_size_of, load_target
from eaglet.target.checkpoint import load_text_config, read_target
from eaglet.target.states import (
    BACKEND_ENGINES,
    Target,
    check_disk,
    enforce_agreement,
    estimate_bytes,
    resolve_aux_layer_ids,
    shard_problem,
    shard_records,
    target_identity,
)

log = logging.getLogger("eaglet.stages.extract.manifest")


def build_manifest(
    cfg: dict,
    target_json: str,
    data_path: str,
    num_shards: int,
    hidden_dir: str,
    manifest_path: str,
    eval_data_path: str | None = None,
    num_eval_shards: int = 1,
) -> dict:
    """Verify every shard (hash, layers, dtype, target), re-extract the ones that fail, and
    write ``manifest.json``. With ``eval_data_path`` the ``num_eval_shards`` held-out shards
    (``eval/`` beside the training shards) are verified too and listed under
    ``eval_shards``."""

    ext = cfg["extract"]
    info = read_target(target_json)
    num_layers = load_text_config(info["path"])["num_hidden_layers"]
    expected = {
        "aux_layer_ids": resolve_aux_layer_ids(ext["aux_layer_ids"], num_layers),
        "dtype": ext["dtype"],
        "target": target_identity(info),
    }
    jobs = [(Path(hidden_dir), data_path, num_shards, index) for index in range(num_shards)]
    if eval_data_path is not None:
        jobs += [
            (Path(hidden_dir) / "eval", eval_data_path, num_eval_shards, index)
            for index in range(num_eval_shards)
        ]
    target: Target | None = None
    records: dict[str, list[dict]] = {}
    problems = [
        shard_problem(
            shards.shard_path(d, i).with_suffix(".json"), shards.shard_path(d, i), expected
        )
        for d, _, _, i in jobs
    ]
    redo = [
        (data, count, index) for (_, data, count, index), problem in zip(jobs, problems) if problem
    ]
    if redo:  # before loading the model: the bytes of every shard to extract again
        for data, _, _ in redo:
            if data not in records:
                records[data] = read_jsonl(data)
        check_disk(
            Path(hidden_dir),
            sum(
                estimate_bytes(
                    shard_records(records[data], count, index),
                    ext["max_len"],
                    hidden_size_of(info),
                    ext["dtype"],
                )
                for data, count, index in redo
            ),
        )
    entries = []
    if redo and ext.get("backend") == "vllm":
        _reextract_with_vllm(
            cfg, info, [job for job, problem in zip(jobs, problems) if problem], records, hidden_dir
        )
        problems = [
            shard_problem(
                shards.shard_path(d, i).with_suffix(".json"), shards.shard_path(d, i), expected
            )
            for d, _, _, i in jobs
        ]
    for (directory, data, count, index), problem in zip(jobs, problems):
        shard_file = shards.shard_path(directory, index)
        meta_path = shard_file.with_suffix(".json")
        if problem:
            log.warning("shard %s cannot be used: %s; extracting it again", shard_file, problem)
            if target is None:
                target = load_target(
                    info["path"],
                    cfg["target"]["dtype"],
                    ext["device"],
                    cfg["target"].get("trust_remote_code", False),
                )
            extract_shard(
                target,
                shard_records(records[data], count, index),
                ext,
                expected["aux_layer_ids"],
                expected["target"],
                shard_file,
                meta_path,
            )
        entry = read_json(meta_path)
        enforce_agreement(entry, ext["min_teacher_agreement"])
        entries.append({**entry, "file": shard_file.relative_to(hidden_dir).as_posix()})
    manifest = summarize(entries[:num_shards], expected, ext)
    if eval_data_path is not None:
        manifest["eval_shards"] = summarize(entries[num_shards:], expected, ext)["shards"]
    manifest["computed_by"] = computed_by(entries)
    write_json(manifest_path, manifest)
    log.info(
        "manifest: %d shards, %d samples, %d tokens, %.1f MB, teacher agreement %s",
        manifest["num_shards"],
        manifest["num_samples"],
        manifest["tokens"],
        manifest["bytes"] / 1e6,
        manifest["teacher_agreement"],
    )
    return manifest


def _reextract_with_vllm(
    cfg: dict, info: dict, bad: list[tuple], records: dict[str, list[dict]], hidden_dir: str
) -> None:
    """Backend vllm: rewrite the shards that cannot be used (``bad``: (directory, data file,
    shards of its split, index)) with one server for all of them."""

    work = Path(hidden_dir) / "vllm"
    jobs = []
    for directory, data, count, index in bad:
        paths = [shards.shard_path(directory, i) for i in range(count)]
        split = "eval" if Path(directory).name == "eval" else "train"
        jobs.append(
            vllm.staged_shards(
                records[data],
                count,
                [str(p) for p in paths],
                [str(p.with_suffix(".json")) for p in paths],
                work,
                split,
            )[index]
        )
    vllm.capture_shards(
        cfg, info, jobs, work, Path(hidden_dir).parent / server_log("extract/manifest")
    )


def computed_by(entries: list[dict]) -> list[dict]:
    """How the states of the shards (``entries``, held-out ones too) were computed, one item
    per backend and engine version: ``backend`` (hf or vllm), ``engine`` and
    ``engine_version`` (transformers' or vLLM's), the ``shards`` and ``samples`` it made, and
    ``samples_captured_during_generation``: those whose states generation's own forward
    passes saved (``generate.capture_hidden_states``), the rest computed by extraction. A
    shard from an eaglet that did not record its engine counts with version None."""
    groups: dict[tuple, dict] = {}
    for entry in entries:
        backend = entry.get("backend", "hf")
        engine = entry.get("engine") or {"name": BACKEND_ENGINES[backend], "version": None}
        group = groups.setdefault(
            (backend, engine["name"], engine["version"]),
            {
                "backend": backend,
                "engine": engine["name"],
                "engine_version": engine["version"],
                "shards": 0,
                "samples": 0,
                "samples_captured_during_generation": 0,
            },
        )
        group["shards"] += 1
        group["samples"] += entry["num_samples"]
        group["samples_captured_during_generation"] += entry.get("captured_during_generation", 0)
    return list(groups.values())


def summarize(entries: list[dict], expected: dict, ext: dict) -> dict:
    positions = sum(e["teacher"]["positions"] for e in entries)

    def weighted(key):
        if not positions:
            return None
        return (
            sum((e["teacher"][key] or 0) * e["teacher"]["positions"] for e in entries) / positions
        )

    tokens = sum(e["tokens"] for e in entries)
    return {
        "format": shards.FORMAT,
        "target": expected["target"],
        "aux_layer_ids": expected["aux_layer_ids"],
        "dtype": expected["dtype"],
        "hidden_size": entries[0]["hidden_size"] if entries else None,
        "max_len": ext["max_len"],
        "num_shards": len(entries),
        "num_samples": sum(e["num_samples"] for e in entries),
        "tokens": tokens,
        "loss_tokens": sum(e["loss_tokens"] for e in entries),
        "truncated": sum(e["truncated"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "bytes_per_token": sum(e["bytes"] for e in entries) / tokens if tokens else None,
        # shards of recorded answers alone (answers: dataset) hold no answer of the target's
        "greedy": all(e["greedy"] for e in entries if e["teacher"]["positions"]),
        "recorded_answers": sum(e.get("recorded_answers", 0) for e in entries),
        "teacher_agreement": weighted("agreement"),
        "teacher_mean_logprob": weighted("mean_logprob"),
        "shards": [
            {
                k: e[k]
                for k in (
                    "file",
                    "sha256",
                    "bytes",
                    "samples",
                    "num_samples",
                    "tokens",
                    "loss_tokens",
                    "truncated",
                    "teacher",
                    "tokens_per_s",
                )
            }
            for e in entries
        ],
    }
