"""Extraction throughput and bytes, against their ceilings.

* tokens/s of eaglet's shard extraction (hooks, packing, teacher check, write) against a bare
  forward pass of the same model over the same batches (no hooks, nothing kept);
* bytes per token of the shard file against the tensor minimum (ids, mask, teacher argmax,
  aux and final states at the storage dtype, nothing else);
* fp8 against bf16: bytes and teacher agreement;
* with ``--vllm``: the same shard written by the vLLM backend (one capture server, prefill
  requests, teacher check from the served states) on the same samples, its tokens/s against
  the transformers backend's, the server's start-up time apart.

    .venv/bin/python benchmarks/extract.py --target results/target \\
        --data results/synthetic/train.jsonl [--samples 48] [--vllm]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eaglet.core.config import validate
from eaglet.core.io import read_jsonl, write_json
from eaglet.data import shards
from eaglet.engine.capture import capture_layer_ids, capture_server
from eaglet.stages.extract.hf import (
    extract_shard,
    forward_batch,
    load_target,
    right_padded,
    token_budget_batches,
)
from eaglet.stages.extract.vllm import capture_shards, staged_shards
from eaglet.target.checkpoint import load_head, model_identity
from eaglet.target.hooks import AuxCapture, decoder_layers
from eaglet.target.states import resolve_aux_layer_ids, sequence

OUT = Path(__file__).parent / "results"


@torch.inference_mode()
def bare_forward(target, seqs: list[list[int]], batch_tokens: int) -> float:
    """Seconds for the decoder forward alone over the same batches."""
    start = time.perf_counter()
    for batch in token_budget_batches([len(s) for s in seqs], batch_tokens):
        ids, mask = right_padded([seqs[i] for i in batch], target.device)
        target.model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def timed_extract(target, records, cfg, aux_ids, directory: Path, dtype: str) -> dict:
    shard = directory / f"shard_{dtype}.safetensors"
    start = time.perf_counter()
    meta = extract_shard(
        target,
        records,
        {**cfg, "dtype": dtype, "min_teacher_agreement": 0.0},
        aux_ids,
        {"benchmark": True},
        shard,
        shard.with_suffix(".json"),
    )
    meta["wall_s"] = time.perf_counter() - start
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True, help="synthetic/train.jsonl")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--dtype", default="float32", help="compute dtype of the target")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--vllm", action="store_true", help="also time the vLLM backend on the same samples"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="vLLM backend requests in flight"
    )
    parser.add_argument(
        "--out", default=str(OUT / "extract"), help="results go to OUT.json and OUT.md"
    )
    args = parser.parse_args()
    out = Path(args.out)

    cfg = validate({})["extract"]
    records = read_jsonl(args.data)[: args.samples]
    seqs = [sequence(r, cfg["max_len"])[0] for r in records]
    tokens = sum(len(s) for s in seqs)
    target = load_target(args.target, args.dtype, "auto")
    aux_ids = resolve_aux_layer_ids(None, target.num_layers)
    bare_forward(target, seqs[:4], cfg["batch_tokens"])  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        bare, eaglet = [], []
        for _ in range(args.repeats):  # alternate, keep the best of each
            bare.append(bare_forward(target, seqs, cfg["batch_tokens"]))
            eaglet.append(timed_extract(target, records, cfg, aux_ids, Path(tmp), "bfloat16"))
        bf16 = min(eaglet, key=lambda m: m["wall_s"])
        fp8 = timed_extract(target, records, cfg, aux_ids, Path(tmp), "fp8")
    hooked = _hooked_forward_only(target, seqs, cfg["batch_tokens"], aux_ids)
    minimum = tokens * shards.bytes_per_token(target.hidden_size, 3, "bfloat16")
    result = {
        "samples": len(records),
        "tokens": tokens,
        "compute_dtype": args.dtype,
        "device": str(target.device),
        "bare_forward_tokens_per_s": tokens / min(bare),
        "forward_with_hooks_tokens_per_s": tokens / hooked,
        "eaglet_tokens_per_s": tokens / bf16["wall_s"],
        "ratio_eaglet_over_bare": min(bare) / bf16["wall_s"],
        "bf16_bytes": bf16["bytes"],
        "bf16_bytes_per_token": bf16["bytes"] / tokens,
        "bf16_over_tensor_minimum": bf16["bytes"] / minimum,
        "fp8_bytes": fp8["bytes"],
        "fp8_over_bf16_bytes": fp8["bytes"] / bf16["bytes"],
        "bf16_teacher_agreement": bf16["teacher"]["agreement"],
        "fp8_teacher_agreement": fp8["teacher"]["agreement"],
    }
    if args.vllm:
        del target
        result.update(vllm_backend(args, records, tokens, bf16["wall_s"]))
    write_json(out.with_suffix(".json"), result)
    lines = ["| measure | value |", "|---|---|"]
    lines += [
        f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
        for k, v in result.items()
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


@torch.inference_mode()
def _hooked_forward_only(target, seqs, batch_tokens, aux_ids) -> float:
    """Seconds for the forward with eaglet's hooks but nothing else: what the hooks cost."""
    capture = AuxCapture(decoder_layers(target.model), aux_ids)
    start = time.perf_counter()
    try:
        for batch in token_budget_batches([len(s) for s in seqs], batch_tokens):
            forward_batch(target, capture, [seqs[i] for i in batch])
    finally:
        capture.close()
    return time.perf_counter() - start


def vllm_backend(args, records: list[dict], tokens: int, hf_wall_s: float) -> dict:
    """The same bf16 shard from the vLLM backend, best of ``--repeats`` (the request files of
    a run are removed before the next, so each one sends every request)."""
    cfg = validate(
        {
            "target": {"dtype": args.dtype, "max_model_len": 2048},
            "server": {"memory_utilization": 0.4, "enforce_eager": True},
            "extract": {
                "backend": "vllm",
                "dtype": "bfloat16",
                "min_teacher_agreement": 0.0,
                "concurrency": args.concurrency,
            },
        }
    )
    info = {"spec": "benchmark", "path": args.target, **model_identity(Path(args.target))}
    walls, metas = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        head = load_head(args.target, args.dtype)
        aux_ids = resolve_aux_layer_ids(None, head.num_layers)
        server = capture_server(
            cfg,
            args.target,
            capture_layer_ids(aux_ids, head.num_layers),
            work / "requests",
            OUT / "extract_vllm.server.log",
        )
        with server:
            for repeat in range(args.repeats):
                jobs = staged_shards(
                    records,
                    1,
                    [f"{tmp}/out{repeat}.safetensors"],
                    [f"{tmp}/out{repeat}.json"],
                    work,
                    f"r{repeat}",
                )
                start = time.perf_counter()
                metas += capture_shards(
                    cfg, info, jobs, work, OUT / "extract_vllm.server.log", server=server
                )
                walls.append(time.perf_counter() - start)
    best = min(walls)
    return {
        "vllm_backend_tokens_per_s": tokens / best,
        "vllm_over_hf_backend": hf_wall_s / best,
        "vllm_server_start_s": server.ready_after_s,
        "vllm_teacher_agreement": metas[walls.index(best)]["teacher"]["agreement"],
        "vllm_concurrency": args.concurrency,
    }


if __name__ == "__main__":
    main()
