"""Hidden-state extraction: run the target over every training sequence and keep what the
drafter learns from.

One Snakemake job per shard. Only the layers the drafter reads are captured, with forward
pre-hooks (aux id ``i`` is the *input* of decoder layer ``i``, i.e. HF ``hidden_states[i]``),
plus the final-norm output that the target's lm_head reads. Sequences are the exact
``prompt_token_ids + completion_token_ids`` the server saw and emitted, run in token-budget
batches sorted by length, and packed into the shard without padding.

Every shard is checked against the server: the teacher's argmax, computed from the stored
(cast) final state, must reproduce the greedy tokens the server generated.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet import rates, shards
from eaglet.io import read_json, read_jsonl, write_json
from eaglet.progress import Progress

log = logging.getLogger("eaglet.extract")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExtractionError(RuntimeError):
    pass


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers: early, middle and late."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise ExtractionError(f"extract.aux_layer_ids needs 3 layer ids (EAGLE-3 fuses three), got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ExtractionError(f"aux layer ids {bad} are outside 0..{num_layers - 1}: id i is the "
                              f"input of decoder layer i of the target's {num_layers} layers")
    return ids


def shard_bounds(num_samples: int, num_shards: int, index: int) -> tuple[int, int]:
    """Contiguous, balanced block of sample indices for shard ``index`` of ``num_shards``."""
    return index * num_samples // num_shards, (index + 1) * num_samples // num_shards


def sequence(record: dict, max_len: int) -> tuple[list[int], list[int], bool]:
    """Token ids and loss mask (1 on completion tokens) of one sample, cut at ``max_len``."""
    prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
    ids = list(prompt) + list(completion)
    mask = [0] * len(prompt) + [1] * len(completion)
    truncated = len(ids) > max_len
    return ids[:max_len], mask[:max_len], truncated


def token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that (longest in batch) x (batch size) <= batch_tokens, longest
    first; a sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a causal LM (``model.model.layers`` for Llama-like models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ExtractionError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


class AuxCapture:
    """Forward pre-hooks that keep the input hidden states of a few decoder layers."""

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: list[int]):
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i in dict.fromkeys(layer_ids)]
        self.layer_ids = layer_ids

    def _hook(self, layer_id: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.captured[layer_id] = hidden.detach()
        return hook

    def take(self) -> list[torch.Tensor]:
        out = [self.captured[i] for i in self.layer_ids]  # an id may repeat on small models
        self.captured.clear()
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class Target:
    model: Any
    lm_head: torch.Tensor   # [V, H]
    device: torch.device
    num_layers: int
    hidden_size: int
    vocab_size: int


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(path: str, dtype: str, device: str = "auto",
                trust_remote_code: bool = False) -> Target:
    from transformers import AutoModelForCausalLM

    if device == "sharded":  # split across every visible GPU (accelerate's device_map)
        log.info("loading the target %s in %s across the visible devices", path, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code,
                                                     device_map="auto")
        dev = model.get_input_embeddings().weight.device  # where the input ids go
        model.eval()
    else:
        dev = pick_device(device)
        log.info("loading the target %s in %s on %s", path, dtype, dev)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code)
        model.to(dev).eval()
    config = model.config.get_text_config()
    lm_head = model.get_output_embeddings().weight.detach()
    return Target(model, lm_head, dev, config.num_hidden_layers, config.hidden_size,
                  lm_head.shape[0])


def right_padded(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [B, T] (padded with 0 on the right) and their attention mask."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    attention = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.tensor(s)
        attention[row, :len(s)] = 1
    return ids.to(device), attention.to(device)


@torch.inference_mode()
def forward_batch(target: Target, capture: AuxCapture, seqs: list[list[int]]):
    """Aux states [sum L, 3H] and final-norm states [sum L, H] of a right-padded batch,
    with the padding dropped again."""
    ids, attention = right_padded(seqs, target.device)
    out = target.model.get_decoder()(input_ids=ids, attention_mask=attention, use_cache=False)
    final = out.last_hidden_state                        # [B, T, H], after the final norm
    aux = torch.cat(capture.take(), dim=-1)              # [B, T, 3H]
    keep = attention.bool()
    return aux[keep], final[keep]


def predicting_rows(loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows whose next token is a completion token of the same sample: the only rows whose
    teacher training reads and the greedy check compares."""
    predicted_by = torch.zeros_like(loss_mask, dtype=torch.bool)
    predicted_by[:-1] = loss_mask[1:].bool()            # position t predicts completion token t+1
    starts = offsets[1:-1] - 1                           # the last row of a sample predicts nothing
    predicted_by[starts[starts >= 0]] = False
    return predicted_by


@torch.inference_mode()
def teacher_from_stored(target: Target, final_stored: torch.Tensor, targets: torch.Tensor,
                        rows: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax over the full vocabulary and log-probability of ``targets`` (the next tokens),
    from the final states as they are stored (after the cast to the shard dtype), at the
    ``rows`` mask only: -1 and NaN elsewhere. Prompt rows are most of a sample on short answers
    and the full-vocabulary head is the costliest part of the check, so they are skipped."""
    argmax = torch.full((final_stored.shape[0],), -1, dtype=torch.int64)
    logprob = torch.full((final_stored.shape[0],), float("nan"), dtype=torch.float32)
    index = rows.nonzero().squeeze(1)
    weight = target.lm_head
    for start in range(0, index.numel(), chunk):
        at = index[start:start + chunk]
        h = final_stored[at].to(weight.device, weight.dtype)  # the lm_head's device when sharded
        logits = (h @ weight.T).float()
        argmax[at] = logits.argmax(-1).cpu()
        nxt = targets[at].to(weight.device)
        logprob[at] = torch.log_softmax(logits, -1).gather(1, nxt[:, None]).squeeze(1).cpu()
    return argmax, logprob


def agreement(records: list[dict], input_ids: torch.Tensor, predicted_by: torch.Tensor,
              offsets: torch.Tensor, teacher_argmax: torch.Tensor, next_logprob: torch.Tensor,
              worst: int = 5) -> dict:
    """How often the teacher's argmax at t equals the generated token at t+1, over completion
    tokens (the ``predicted_by`` rows); per sample, the worst ones named."""
    next_ids = torch.roll(input_ids, -1)
    hits = (teacher_argmax == next_ids) & predicted_by
    per_sample = []
    for s, record in enumerate(records):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        n = int(predicted_by[lo:hi].sum())
        if n:
            per_sample.append({"id": record["id"], "positions": n,
                               "agreement": float(hits[lo:hi].sum()) / n,
                               "mean_logprob": float(next_logprob[lo:hi][predicted_by[lo:hi]].mean())})
    total = int(predicted_by.sum())
    return {
        "positions": total,
        "agreement": float(hits.sum()) / total if total else None,
        "mean_logprob": float(next_logprob[predicted_by].mean()) if total else None,
        "worst": sorted(per_sample, key=lambda r: r["agreement"])[:worst],
    }


def estimate_bytes(records: list[dict], max_len: int, hidden_size: int, dtype: str) -> int:
    tokens = sum(min(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]), max_len)
                 for r in records)
    return tokens * shards.bytes_per_token(hidden_size, 3, dtype)


def check_disk(directory: Path, needed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise ExtractionError(
            f"not enough disk for the hidden states: about {_size(needed)} still to "
            f"write, {_size(free)} free on {directory}. Free space, point results_dir "
            f"at a larger disk, or store fp8 shards (extract.dtype: fp8) to halve the bytes.")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def is_greedy(records: list[dict]) -> bool:
    return all((r.get("sampling") or {}).get("temperature", 0.0) == 0.0 for r in records)


def hf_states(target: Target, records: list[dict], seqs: list[list[int]], cfg: dict,
              aux_layer_ids: list[int], progress: Progress | None = None
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Aux [L, 3H] and final-norm [L, H] states of every sequence, from the target loaded by
    transformers (the ``hf`` backend), in token-budget batches."""
    lengths = [len(s) for s in seqs]
    aux_rows: list[torch.Tensor | None] = [None] * len(seqs)
    final_rows: list[torch.Tensor | None] = [None] * len(seqs)
    capture = AuxCapture(decoder_layers(target.model), aux_layer_ids)
    try:
        for batch in token_budget_batches(lengths, cfg["batch_tokens"]):
            aux, final = forward_batch(target, capture, [seqs[i] for i in batch])
            start = 0
            for i in batch:
                aux_rows[i] = aux[start:start + lengths[i]].cpu()
                final_rows[i] = final[start:start + lengths[i]].cpu()
                start += lengths[i]
            if progress is not None:
                progress.advance(done=len(batch), tokens=sum(lengths[i] for i in batch))
    finally:
        capture.close()
    return aux_rows, final_rows


def extract_shard(target: Target, records: list[dict], cfg: dict, aux_layer_ids: list[int],
                  identity: dict, shard_path: str | os.PathLike, meta_path: str | os.PathLike,
                  progress: Progress | None = None, states=hf_states,
                  backend: str = "hf") -> dict:
    """Extract one shard and its sidecar JSON; raise below the teacher-agreement threshold.

    ``states(target, records, seqs, cfg, aux_layer_ids, progress)`` computes the aux and
    final states of each sequence (:func:`hf_states`, or the vLLM backend's); ``target``
    needs only its lm_head and device for the teacher check."""
    started = time.monotonic()
    seqs, masks, truncated = [], [], 0
    for record in records:
        ids, mask, cut = sequence(record, cfg["max_len"])
        seqs.append(ids)
        masks.append(mask)
        truncated += cut
    lengths = [len(s) for s in seqs]
    aux_rows, final_rows = states(target, records, seqs, cfg, aux_layer_ids, progress)

    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    loss_mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.uint8)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    final_all = torch.cat(final_rows)  # the aux states are written from their rows as they are

    # the teacher as training will see it: from the final state after the storage cast
    stored_final = _round_trip(final_all, cfg["dtype"])
    rows = predicting_rows(loss_mask, offsets)
    teacher_argmax, next_logprob = teacher_from_stored(target, stored_final,
                                                       torch.roll(input_ids, -1), rows)
    del stored_final
    check = agreement(records, input_ids, rows, offsets, teacher_argmax, next_logprob)

    written = shards.write(shard_path, input_ids, loss_mask, offsets, teacher_argmax, aux_rows,
                           final_all, sample_ids=[r["id"] for r in records],
                           aux_layer_ids=aux_layer_ids, dtype=cfg["dtype"], target=identity)
    elapsed = time.monotonic() - started
    tensor_bytes = input_ids.numel() * shards.bytes_per_token(target.hidden_size, 3, cfg["dtype"])
    meta = {
        "file": Path(shard_path).name, "sha256": written.sha256, "bytes": written.bytes,
        "tensor_bytes": tensor_bytes, "samples": [r["id"] for r in records],
        "num_samples": len(records), "tokens": int(input_ids.numel()),
        "loss_tokens": int(loss_mask.sum()), "truncated": truncated, "dtype": cfg["dtype"],
        "aux_layer_ids": aux_layer_ids, "hidden_size": target.hidden_size, "target": identity,
        "greedy": is_greedy(records), "teacher": check, "backend": backend, "elapsed_s": elapsed,
        "tokens_per_s": input_ids.numel() / elapsed if elapsed else None,
    }
    write_json(meta_path, meta)
    enforce_agreement(meta, cfg["min_teacher_agreement"])
    return meta


def _round_trip(x: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "fp8":
        return shards.dequantize_fp8(*shards.quantize_fp8(x, 1))
    return x.to(shards.STORAGE_DTYPES[dtype]).float()


def enforce_agreement(meta: dict, threshold: float) -> None:
    check = meta["teacher"]
    if not meta["greedy"] or check["agreement"] is None:
        return  # sampled data: the mean log-probability is reported instead
    if check["agreement"] >= threshold:
        return
    worst = "; ".join(f"{w['id']}: {w['agreement']:.2%} of {w['positions']}" for w in check["worst"])
    raise ExtractionError(
        f"teacher agreement {check['agreement']:.2%} in {meta['file']} is below "
        f"extract.min_teacher_agreement={threshold:.2%}: the target run by "
        f"{BACKEND_NAMES.get(meta.get('backend', 'hf'), meta.get('backend'))} does not "
        f"reproduce the tokens the server generated greedily. Worst samples: {worst}. Check that "
        f"the server and extraction use the same weights, dtype (target.dtype) and tokenizer, "
        f"and that prompt_token_ids came from the server (not re-tokenized).")


BACKEND_NAMES = {"hf": "transformers (extract.backend: hf)",
                 "vllm": "the vLLM server's prefill (extract.backend: vllm)"}


# -- the stage -------------------------------------------------------------------------------

def target_identity(target_info: dict) -> dict:
    keys = ("spec", "path", "hub_id", "source_sha256", "config_sha256")
    return {k: target_info[k] for k in keys if k in target_info}


def shard_records(records: list[dict], num_shards: int, index: int) -> list[dict]:
    lo, hi = shard_bounds(len(records), num_shards, index)
    return records[lo:hi]


def run_shard(cfg: dict, target_json: str, data_path: str, index: int, num_shards: int,
              shard_path: str, meta_path: str, progress_path: str | None = None,
              log_path: str | None = None) -> dict:
    """The ``extract`` rule for one shard (``cfg`` holds ``extract`` and ``target``)."""
    ext = cfg["extract"]
    info = read_json(target_json)
    all_records = read_jsonl(data_path)
    records = shard_records(all_records, num_shards, index)
    if num_shards > len(all_records) and all_records:
        log.warning("%d shards for %d samples: some shards are empty (lower extract.num_shards)",
                    num_shards, len(all_records))
    if not records:
        raise ExtractionError(f"shard {index} of {num_shards} has no samples: lower "
                              f"extract.num_shards to at most the number of samples")
    pending = [i for i in range(num_shards) if not shards.shard_path(Path(shard_path).parent, i).exists()]
    needed = sum(estimate_bytes(shard_records(all_records, num_shards, i), ext["max_len"],
                                hidden_size_of(info), ext["dtype"]) for i in pending)
    check_disk(Path(shard_path).parent, needed)  # before minutes of loading a large model
    target = load_target(info["path"], cfg["target"]["dtype"], ext["device"],
                         cfg["target"].get("trust_remote_code", False))
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    progress = Progress(f"extract[{index}]", total=len(records), path=progress_path,
                        log_path=log_path)
    meta = extract_shard(target, records, ext, aux_ids, target_identity(info), shard_path,
                         meta_path, progress)
    progress.report("finished")
    rates.record("extract", info["spec"], tokens_per_s=meta["tokens_per_s"])
    log.info("shard %d: %d samples, %d tokens (%d truncated), %.1f MB, %.0f tokens/s, teacher "
             "agreement %s", index, meta["num_samples"], meta["tokens"], meta["truncated"],
             meta["bytes"] / 1e6, meta["tokens_per_s"] or 0,
             f"{meta['teacher']['agreement']:.4f}" if meta["teacher"]["agreement"] is not None else "-")
    return meta


def hidden_size_of(info: dict) -> int:
    """The target's hidden size from target.json, else from its config (no weights loaded)."""
    if info.get("hidden_size"):
        return info["hidden_size"]
    from eaglet.target import load_text_config

    return load_text_config(info["path"]).hidden_size


def shard_problem(meta_path: Path, shard_file: Path, expected: dict) -> str | None:
    """Why a finished shard cannot be used as it is, or None when it matches."""
    if not meta_path.exists() or not shard_file.exists():
        return "missing"
    try:
        meta = read_json(meta_path)
    except ValueError:
        return f"its record {meta_path.name} is unreadable"
    if shards.sha256_path(shard_file) != meta["sha256"]:
        return "its sha256 does not match the one recorded at extraction (truncated or modified)"
    for key in ("aux_layer_ids", "dtype", "target"):
        if meta[key] != expected[key]:
            return f"it was extracted with {key}={meta[key]!r}, the run now asks for {expected[key]!r}"
    return None


def build_manifest(cfg: dict, target_json: str, data_path: str, num_shards: int,
                   hidden_dir: str, manifest_path: str, eval_data_path: str | None = None) -> dict:
    """Verify every shard (hash, layers, dtype, target), re-extract the ones that fail, and
    write ``manifest.json``. With ``eval_data_path`` the held-out shard (``eval/`` beside
    the training shards) is verified too and listed under ``eval_shards``."""
    from eaglet.target import load_text_config

    ext = cfg["extract"]
    info = read_json(target_json)
    num_layers = load_text_config(info["path"]).num_hidden_layers
    expected = {"aux_layer_ids": resolve_aux_layer_ids(ext["aux_layer_ids"], num_layers),
                "dtype": ext["dtype"], "target": target_identity(info)}
    jobs = [(Path(hidden_dir), data_path, num_shards, index) for index in range(num_shards)]
    if eval_data_path is not None:
        jobs.append((Path(hidden_dir) / "eval", eval_data_path, 1, 0))
    target: Target | None = None
    records: dict[str, list[dict]] = {}
    problems = [shard_problem(shards.shard_path(d, i).with_suffix(".json"), shards.shard_path(d, i),
                              expected) for d, _, _, i in jobs]
    redo = [(data, count, index) for (_, data, count, index), problem in zip(jobs, problems) if problem]
    if redo:  # before loading the model: the bytes of every shard to extract again
        for data, _, _ in redo:
            if data not in records:
                records[data] = read_jsonl(data)
        check_disk(Path(hidden_dir), sum(
            estimate_bytes(shard_records(records[data], count, index), ext["max_len"],
                           hidden_size_of(info), ext["dtype"]) for data, count, index in redo))
    entries = []
    if redo and ext.get("backend") == "vllm":
        _reextract_with_vllm(cfg, info, [job for job, problem in zip(jobs, problems) if problem],
                             records, hidden_dir)
        problems = [shard_problem(shards.shard_path(d, i).with_suffix(".json"),
                                  shards.shard_path(d, i), expected) for d, _, _, i in jobs]
    for (directory, data, count, index), problem in zip(jobs, problems):
        shard_file = shards.shard_path(directory, index)
        meta_path = shard_file.with_suffix(".json")
        if problem:
            log.warning("shard %s cannot be used: %s; extracting it again", shard_file, problem)
            if target is None:
                target = load_target(info["path"], cfg["target"]["dtype"], ext["device"],
                                     cfg["target"].get("trust_remote_code", False))
            extract_shard(target, shard_records(records[data], count, index), ext,
                          expected["aux_layer_ids"], expected["target"], shard_file, meta_path)
        entry = read_json(meta_path)
        enforce_agreement(entry, ext["min_teacher_agreement"])
        entries.append({**entry, "file": shard_file.relative_to(hidden_dir).as_posix()})
    manifest = summarize(entries[:num_shards], expected, ext)
    if eval_data_path is not None:
        manifest["eval_shards"] = summarize(entries[num_shards:], expected, ext)["shards"]
    write_json(manifest_path, manifest)
    log.info("manifest: %d shards, %d samples, %d tokens, %.1f MB, teacher agreement %s",
             manifest["num_shards"], manifest["num_samples"], manifest["tokens"], manifest["bytes"] / 1e6,
             manifest["teacher_agreement"])
    return manifest


def _reextract_with_vllm(cfg: dict, info: dict, bad: list[tuple], records: dict[str, list[dict]],
                         hidden_dir: str) -> None:
    """Backend vllm: rewrite the shards that cannot be used (``bad``: (directory, data file,
    shards of its split, index)) with one server for all of them."""
    from eaglet import extract_vllm

    work = Path(hidden_dir) / "vllm"
    jobs = []
    for directory, data, count, index in bad:
        paths = [shards.shard_path(directory, i) for i in range(count)]
        split = "eval" if Path(directory).name == "eval" else "train"
        jobs.append(extract_vllm.shard_jobs(
            records[data], count, [str(p) for p in paths],
            [str(p.with_suffix(".json")) for p in paths], work, split)[index])
    extract_vllm.extract_shards(cfg, info, jobs, work,
                                Path(hidden_dir).parent / "logs" / "extract" / "manifest.server.log")


def summarize(entries: list[dict], expected: dict, ext: dict) -> dict:
    positions = sum(e["teacher"]["positions"] for e in entries)
    def weighted(key):
        if not positions:
            return None
        return sum((e["teacher"][key] or 0) * e["teacher"]["positions"] for e in entries) / positions
    tokens = sum(e["tokens"] for e in entries)
    return {
        "format": shards.FORMAT, "target": expected["target"],
        "aux_layer_ids": expected["aux_layer_ids"], "dtype": expected["dtype"],
        "hidden_size": entries[0]["hidden_size"] if entries else None,
        "max_len": ext["max_len"], "num_shards": len(entries),
        "num_samples": sum(e["num_samples"] for e in entries), "tokens": tokens,
        "loss_tokens": sum(e["loss_tokens"] for e in entries),
        "truncated": sum(e["truncated"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "bytes_per_token": sum(e["bytes"] for e in entries) / tokens if tokens else None,
        "greedy": all(e["greedy"] for e in entries),
        "teacher_agreement": weighted("agreement"), "teacher_mean_logprob": weighted("mean_logprob"),
        "shards": [{k: e[k] for k in ("file", "sha256", "bytes", "samples", "num_samples",
                                      "tokens", "loss_tokens", "truncated", "teacher",
                                      "tokens_per_s")} for e in entries],
    }
