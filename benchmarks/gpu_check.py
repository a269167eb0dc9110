"""One device check of eaglet on a GPU machine: extraction, training and disk rates against
eaglet's GPU goals, in about 6 minutes, with nothing installed but PyTorch and transformers
(no vLLM, no jsonschema, no network, no checkpoint).

Sections, each timed on its own and skipped with a recorded reason when the run is late:

* ``extraction``: a random-weight Llama-3.1-8B-shaped target (``LlamaForCausalLM`` built from
  a ``LlamaConfig`` straight on the device in bf16) over synthetic records of random token
  ids (64 samples x 2048 tokens). Timings over the same token-budget batches: the plain
  decoder forward; the forward with eaglet's aux-layer hooks (``extract.forward_batch``: what
  extraction needs from the model, the 3 aux states and the final norm's output, left on the
  device); eaglet's extraction of one shard end to end (``extract.stream_shard`` +
  ``finish_shard``: each batch cast to the shard dtype, its teacher check on the device,
  copied to pinned host buffers and written at its samples' places in the file by a writer
  thread while the next batch runs, the file digested block by block as it fills, fsynced
  and renamed); the same with the writer's overlap off (each batch written before the next
  one runs); and the records split into shards written by one job (``extract.extract_shards``,
  as ``extract.jobs: one`` runs them: each shard finished beside the next shard's forward).
  Each timed shard is removed first, as Snakemake removes a job's outputs before it runs.
  Random tokens are no greedy completion, so ``extract.min_teacher_agreement`` is set to 0
  (the check still runs and costs what it costs). Goal: extraction >= 0.85x the hooked forward.
* ``train_llama`` and ``train_kimi``: eaglet's training step (``Trainer.train_step``: batches
  packed ahead by the prefetcher in page-locked memory, copied to the device, bf16 autocast,
  7 TTT steps, loss against the teacher, backward, grad clip, AdamW, LR schedule) at the
  drafter shapes of Llama-3.1-8B (8,192 tokens a step: 4 samples of 2,048) and Kimi-K2.5
  (2,048 tokens) of ``eaglet.model.sizes.PRESETS``, once per variant of the step: ``plain`` (the
  autograd loss, eager kernels: the step before these optimizations), ``fused_loss``
  (``train.fused_loss``) and ``fused_loss+compile`` (``train.compile``, the GPU default), all
  from the same initial weights over the same batches, so their losses must agree within
  bf16 rounding (``max_loss_rel_diff``). The trainer is assembled around random samples
  instead of shards, a target directory and a vocabulary map; its step code is the real one.
  MFU counts the FLOPs of ``drafter.count_flops_per_token`` (every matmul of forward and
  backward over the 7 steps, attention scores, the teacher's head) against the H200's dense
  bf16 peak of 989 TFLOP/s. Goals: >= 32K tokens/s at the 8B shape, >= 14K at Kimi-K2.5's.
* ``profile``: torch.profiler over two steps of the default (fastest) variant at the 8B shape:
  the kernels that take the step's GPU time, grouped (matmul, attention, elementwise,
  reductions, copies, optimizer).
* ``disk``: about 4 GB written by the shard writer (``shards.write``: cast, block digests,
  fsync) and the same bytes by a plain file write with fsync, GB/s each (goal: >= 0.9x).

Run from the repository root on the GPU machine; results go to benchmarks/results/gpu_check.json
(raw numbers, shapes, versions, seconds per section, skips and errors) and gpu_check.md:

    python benchmarks/gpu_check.py [--out DIR] [--sections extraction,disk] [--budget-s 500]

``--tiny`` runs every section at toy shapes on whatever device there is (tests/test_gpu_check.py);
its results belong in a temporary directory, not in benchmarks/results.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # run from a plain copy of the repository, nothing installed

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors import safe_open  # noqa: E402

from eaglet.core.io import write_json  # noqa: E402
from eaglet.core.methods import default_aux_layer_ids  # noqa: E402
from eaglet.data import shards  # noqa: E402
from eaglet.model.config import DrafterConfig  # noqa: E402
from eaglet.model.drafter import Eagle3Drafter, count_flops_per_token, num_params  # noqa: E402
from eaglet.model.init import init_lm_head  # noqa: E402
from eaglet.model.sizes import PRESETS, Shape  # noqa: E402
from eaglet.stages.extract.hf import (  # noqa: E402
    extract_shards,
    finish_shard,
    forward_batch,
    right_padded,
    stream_shard,
    token_budget_batches,
)
from eaglet.stages.train.data import Prefetcher, prefetch_depth  # noqa: E402
from eaglet.stages.train.loop import Dist, Trainer  # noqa: E402
from eaglet.target.hooks import AuxCapture, decoder_layers  # noqa: E402
from eaglet.target.states import Target, sequence  # noqa: E402

OUT = Path(__file__).parent / "results"
PEAK_FLOPS = 989e12  # H200 dense bf16 (the datasheet's number without sparsity)
NAIVE_ANCHOR = 17_000  # tokens/s of a naive plain-PyTorch TTT-7 step at the 8B shape (31 GiB)
SPECFORGE = 30_600  # SpecForge's published step: Qwen3-8B drafter, 4 x 2,048 tokens in 0.268 s
GOALS = {
    "extraction_over_forward": 0.85,
    "train_llama_tokens_per_s": 32_000,
    "train_kimi_tokens_per_s": 14_000,
    "shard_over_plain": 0.9,
}
# the step's variants, each a (train.fused_loss, train.compile); the last is the GPU default
VARIANTS = {
    "plain": (False, False),
    "fused_loss": (True, False),
    "fused_loss+compile": (True, True),
}

SHAPES = {
    "full": {"llama": PRESETS["llama-3.1-8b"], "kimi": PRESETS["kimi-k2.5"]},
    "tiny": {
        "llama": Shape(
            "tiny-llama",
            hidden=64,
            layers=8,
            heads=4,
            kv_heads=2,
            head_dim=16,
            intermediate=128,
            vocab=512,
            draft_vocab=128,
        ),
        "kimi": Shape(
            "tiny-kimi",
            hidden=96,
            layers=8,
            heads=4,
            kv_heads=4,
            head_dim=24,
            intermediate=192,
            vocab=640,
            draft_vocab=128,
        ),
    },
}
SIZES = {  # what each section runs over
    "full": {
        "samples": 64,
        "sample_len": 2048,
        "prompt_len": 512,
        "repeats": 2,
        "shards": 4,
        "train_tokens": {"llama": 8192, "kimi": 2048},
        "train_sample_len": 2048,
        "train_steps": 5,
        "train_warmup": 3,
        "profile_steps": 2,
        "disk_bytes": 4_000_000_000,
    },
    "tiny": {
        "samples": 4,
        "sample_len": 64,
        "prompt_len": 16,
        "repeats": 1,
        "batch_tokens": 128,
        "shards": 2,
        "train_tokens": {"llama": 128, "kimi": 128},
        "train_sample_len": 64,
        "train_steps": 2,
        "train_warmup": 1,
        "profile_steps": 1,
        "disk_bytes": 8_000_000,
    },
}
# seconds a section is expected to take on the H200: it is skipped when it would end past
# the budget (nothing is expected of the tiny run but speed)
ESTIMATES = {"extraction": 120, "train_llama": 120, "train_kimi": 80, "profile": 20, "disk": 25}


# -- small helpers ---------------------------------------------------------------------------


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


CLOCK = Clock(math.inf)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{CLOCK.elapsed():6.1f}s] {message}", flush=True)


def schema_defaults(section: str) -> dict:
    """The defaults ``config_schema.yaml`` gives one flat section (``extract``, ``train``): what
    ``eaglet.core.config.validate`` fills in, read without jsonschema."""
    schema = yaml.safe_load((REPO / "src" / "eaglet" / "core" / "config_schema.yaml").read_text())
    properties = schema["properties"][section]["properties"]
    return {
        key: copy.deepcopy(sub["default"]) for key, sub in properties.items() if "default" in sub
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, *args, **kwargs) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return time.perf_counter() - start, out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def target_config(shape: Shape) -> dict:
    """The target's config.json fields that ``DrafterConfig.from_target`` reads, with the
    drafter layer's heads and width where model/sizes.py gives them apart (default RoPE: the
    scaling variant does not change the cost)."""
    return {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.d_heads,
        "num_key_value_heads": shape.d_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.d_intermediate,
        "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
    }


# -- extraction ------------------------------------------------------------------------------


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype) -> Target:
    """A random-weight ``LlamaForCausalLM`` of ``shape``, created on ``device`` in ``dtype``
    (no float32 copy, no host detour), wrapped as extraction's ``Target``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    model.eval()
    lm_head = model.get_output_embeddings().weight.detach()
    return Target(model, lm_head, device, shape.layers, shape.hidden, lm_head.shape[0])


def synthetic_records(count: int, length: int, prompt_len: int, vocab: int) -> list[dict]:
    """Records as generation writes them (the fields extraction reads), of random token ids."""
    rows = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))
    return [
        {
            "id": f"gpu-check-{i:04d}",
            "prompt_token_ids": row[:prompt_len],
            "completion_token_ids": row[prompt_len:],
            "sampling": {"temperature": 0.0},
        }
        for i, row in enumerate(rows.tolist())
    ]


@torch.inference_mode()
def plain_forward(target: Target, seqs: list[list[int]], batch_tokens: int) -> None:
    """The decoder alone over the same right-padded batches (no mask, as extraction runs it)."""
    for batch in token_budget_batches([len(s) for s in seqs], batch_tokens):
        target.model.get_decoder()(
            input_ids=right_padded([seqs[i] for i in batch], target.device), use_cache=False
        )


def hooked_forward(
    target: Target, seqs: list[list[int]], batch_tokens: int, aux_ids: list[int]
) -> None:
    """The forward with eaglet's hooks, the aux and final states gathered on the device."""
    capture = AuxCapture(decoder_layers(target.model), aux_ids)
    try:
        for batch in token_budget_batches([len(s) for s in seqs], batch_tokens):
            forward_batch(target, capture, [seqs[i] for i in batch])
    finally:
        capture.close()


def removed(*paths: Path) -> None:
    """A job's outputs gone before it runs, as Snakemake removes them (untimed)."""
    for path in paths:
        path.unlink(missing_ok=True)


def extraction(
    shape: Shape,
    size: dict,
    device: torch.device,
    dtype: torch.dtype,
    work: Path,
    keep: Path | None,
) -> dict:
    cfg = {
        **schema_defaults("extract"),
        "max_len": size["sample_len"],
        "dtype": "bfloat16",
        "min_teacher_agreement": 0.0,
    }  # random tokens are no greedy completion
    if "batch_tokens" in size:
        cfg["batch_tokens"] = size["batch_tokens"]
    build_s, target = timed(device, build_target, shape, device, dtype)
    say(f"extraction: {shape.name} target built in {build_s:.1f}s")
    aux_ids = default_aux_layer_ids(shape.layers)
    records = synthetic_records(
        size["samples"], size["sample_len"], size["prompt_len"], shape.vocab
    )
    seqs = [sequence(r, cfg["max_len"])[0] for r in records]
    tokens = sum(len(s) for s in seqs)
    shard = work / "shard_00000.safetensors"

    def run_extract(recs, overlap=True):
        removed(shard, shard.with_suffix(".json"))
        start = time.perf_counter()
        opened = stream_shard(
            target, recs, cfg, aux_ids, {"spec": "gpu_check"}, shard, overlap=overlap
        )
        meta = finish_shard(
            target, opened, cfg, aux_ids, {"spec": "gpu_check"}, shard, shard.with_suffix(".json")
        )
        return time.perf_counter() - start, meta

    count = size["shards"]
    parts = [
        (
            records[k * len(records) // count : (k + 1) * len(records) // count],
            work / f"shard_{k + 1:05d}.safetensors",
            work / f"shard_{k + 1:05d}.json",
        )
        for k in range(count)
    ]

    def run_shards():
        for _, path, meta_path in parts:
            removed(path, meta_path)
        start = time.perf_counter()
        metas = extract_shards(target, parts, cfg, aux_ids, {"spec": "gpu_check"})
        return time.perf_counter() - start, metas

    warm = max(1, cfg["batch_tokens"] // size["sample_len"])  # one batch, every path once
    plain_forward(target, seqs[:warm], cfg["batch_tokens"])
    hooked_forward(target, seqs[:warm], cfg["batch_tokens"], aux_ids)
    run_extract(records[:warm])
    say(
        f"extraction: warmed up; {len(records)} samples, {tokens} tokens, "
        f"batch_tokens {cfg['batch_tokens']}"
    )
    plain, hooked, extracted, serial, overlapped, meta, metas = [], [], [], [], [], None, None
    for repeat in range(size["repeats"]):  # alternate, keep the best of each
        if repeat and CLOCK.left() < 2 * ESTIMATES["extraction"] / size["repeats"]:
            say("extraction: running late, no further repeat")
            break
        plain.append(timed(device, plain_forward, target, seqs, cfg["batch_tokens"])[0])
        hooked.append(timed(device, hooked_forward, target, seqs, cfg["batch_tokens"], aux_ids)[0])
        seconds, meta = run_extract(records)
        extracted.append(seconds)
        serial.append(run_extract(records, overlap=False)[0])
        overlapped_s, metas = run_shards()
        overlapped.append(overlapped_s)
        say(
            f"extraction: repeat {repeat + 1}: plain forward {tokens / plain[-1]:.0f}, hooked "
            f"forward {tokens / hooked[-1]:.0f}, eaglet extraction {tokens / seconds:.0f} "
            f"(writer not overlapped: {tokens / serial[-1]:.0f}), {count} shards in one job "
            f"{tokens / overlapped_s:.0f} tokens/s"
        )
    seconds, meta = run_extract(records)  # the shard the test reads back: the overlapped path's
    with safe_open(str(shard), framework="pt") as handle:
        tokens_in_file = handle.get_slice("input_ids").get_shape()[0]
    if tokens_in_file != tokens or meta["tokens"] != tokens:
        raise RuntimeError(f"the shard holds {tokens_in_file} tokens, {tokens} were extracted")
    if sum(m["tokens"] for m in metas) != tokens:
        raise RuntimeError(
            f"the {count} shards hold {sum(m['tokens'] for m in metas)} tokens, "
            f"{tokens} were extracted"
        )
    result = {
        "shape": shape.name,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "vocab": shape.vocab,
        "target_dtype": str(dtype).removeprefix("torch."),
        "attention": getattr(target.model.config, "_attn_implementation", None),
        "aux_layer_ids": aux_ids,
        "samples": len(records),
        "sample_len": size["sample_len"],
        "prompt_len": size["prompt_len"],
        "batch_tokens": cfg["batch_tokens"],
        "shard_dtype": cfg["dtype"],
        "teacher_check": "min_teacher_agreement 0 (random tokens)",
        "teacher_agreement": meta["teacher"]["agreement"],
        "build_s": build_s,
        "tokens": tokens,
        "repeats": len(extracted),
        "plain_forward_s": min(plain),
        "hooked_forward_s": min(hooked),
        "extraction_s": min(extracted),
        "plain_forward_tokens_per_s": tokens / min(plain),
        "hooked_forward_tokens_per_s": tokens / min(hooked),
        "extraction_tokens_per_s": tokens / min(extracted),
        "extraction_over_forward": min(hooked) / min(extracted),
        "extraction_over_plain_forward": min(plain) / min(extracted),
        "extraction_not_overlapped_s": min(serial),
        "extraction_not_overlapped_tokens_per_s": tokens / min(serial),
        "extraction_not_overlapped_over_forward": min(hooked) / min(serial),
        "shards_in_one_job": count,
        "shards_in_one_job_s": min(overlapped),
        "shards_in_one_job_tokens_per_s": tokens / min(overlapped),
        "shards_in_one_job_over_forward": min(hooked) / min(overlapped),
        "shards_in_one_job_bytes": sum(m["bytes"] for m in metas),
        "shard_bytes": meta["bytes"],
        "shard_sha256": meta["sha256"],
        "shard_gb_per_s": meta["bytes"] / min(extracted) / 1e9,
        "shard_tokens_in_file": tokens_in_file,
        "peak_memory_gib": peak_memory_gib(device),
        "all_s": {
            "plain": plain,
            "hooked": hooked,
            "extraction": extracted,
            "not_overlapped": serial,
            "shards_in_one_job": overlapped,
        },
    }
    if keep is not None:  # for the test: the shard itself, to read back
        shutil.move(shard, keep)
        result["shard_path"] = str(keep)
    return result


# -- training --------------------------------------------------------------------------------


class RandomSamples:
    """Stands in for ``train.Samples``: fixed random samples, in the tuple its ``get`` returns
    (states in bfloat16, as a bf16 shard maps them; the step widens them on the device)."""

    def __init__(self, config: DrafterConfig, count: int, length: int):
        g = torch.Generator().manual_seed(0)
        self.lengths = [length] * count
        self.pieces = [
            (
                f"r{s}",
                torch.randint(0, config.vocab_size, (length,), generator=g),
                torch.ones(length, dtype=torch.uint8),
                # the target's argmax, in the draft vocabulary (d2t = 0: same ids)
                torch.randint(0, config.draft_vocab_size, (length,), generator=g),
                torch.randn(length, config.fc_input_size, generator=g).bfloat16(),
                torch.randn(length, config.hidden_size, generator=g).bfloat16(),
            )
            for s in range(count)
        ]

        # one "shard" holding them all, as train_data.pack_epoch reads samples
        self.infos, self.first = [SimpleNamespace(lengths=self.lengths)], [0]

    def __len__(self) -> int:
        return len(self.pieces)

    def get(self, index: int, max_len: int) -> tuple:
        sid, *tensors = self.pieces[index]
        return (sid, *(t[:max_len] for t in tensors))


def random_trainer(
    cfg: dict,
    config: DrafterConfig,
    samples: RandomSamples,
    device: torch.device,
    dtype: torch.dtype,
    work: Path,
) -> Trainer:
    """eaglet's ``Trainer`` around random samples and random target weights (in place of what
    ``Trainer.from_files`` reads from the shards, the vocabulary map and the target)."""
    t2d = torch.arange(config.vocab_size) < config.draft_vocab_size
    d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    torch.manual_seed(cfg["seed"])
    # in the target's dtype, as a checkpoint gives them; drawn on the device (the Kimi-K2.5
    # embedding is 1.2G numbers)
    embed = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02
    teacher_head = (
        torch.randn(config.draft_vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02
    )
    model = Eagle3Drafter(config, embed, d2t, t2d)
    init_lm_head(model, teacher_head)  # train.lm_head_init: target
    return Trainer(cfg, model, teacher_head, samples, samples, work / "checkpoints", device, Dist())


def step_runner(
    shape: Shape,
    size: dict,
    device: torch.device,
    dtype: torch.dtype,
    work: Path,
    tokens: int,
    fused: bool,
    compiled: bool,
    steps: int,
):
    """A trainer of ``shape`` over one micro-batch of ``tokens`` random tokens a step, with the
    step's variant (``train.fused_loss``, ``train.compile``), and the function that runs its
    next step (packed ahead as ``TrainingRun.run`` packs, the wait for it inside the step)."""
    cfg = {
        **schema_defaults("train"),
        "max_len": size["train_sample_len"],
        "max_tokens_per_batch": tokens,
        "fused_loss": fused,
        "compile": compiled,
    }
    config = DrafterConfig.from_target(
        target_config(shape), shape.draft_vocab, default_aux_layer_ids(shape.layers)
    )
    count = tokens // size["train_sample_len"]
    samples = RandomSamples(config, count, size["train_sample_len"])
    # the schedule spans exactly the steps run
    trainer = random_trainer(
        {**cfg, "epochs": steps, "max_steps": steps}, config, samples, device, dtype, work
    )
    micro = [list(range(count))]  # one micro-batch per step (grad_accum 1), every sample
    feed = Prefetcher(
        lambda indices: trainer.host_batch(samples, indices),
        (((step, 0, 0), micro[0]) for step in range(steps)),
        max(1, prefetch_depth(cfg["prefetch_batches"], device)),
    )

    def step() -> tuple[float, int, float]:
        seconds, (stats, rows) = timed(
            device, lambda: trainer.train_step(micro, [feed.take((trainer.step, 0, 0))])
        )
        trainer.step += 1
        return seconds, rows, float(stats[0].sum() / stats[1].sum())

    return trainer, feed, config, cfg, step


def train_variant(
    shape: Shape,
    size: dict,
    device: torch.device,
    dtype: torch.dtype,
    work: Path,
    tokens: int,
    fused: bool,
    compiled: bool,
) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = size["train_warmup"] + size["train_steps"]
    trainer, feed, config, cfg, step = step_runner(
        shape, size, device, dtype, work, tokens, fused, compiled, steps
    )
    times, warmup, rows, losses = [], [], 0, []
    try:
        for k in range(steps):
            seconds, rows, loss = step()
            losses.append(loss)
            (times if k >= size["train_warmup"] else warmup).append(seconds)
    finally:
        feed.close()
    step_s = sorted(times)[len(times) // 2]
    context = (size["train_sample_len"] + 1) / 2
    flops = count_flops_per_token(config, cfg["ttt_steps"], context)
    tokens_per_s = rows / step_s
    return {
        "fused_loss": fused,
        "compile": compiled,
        "tokens_per_step": rows,
        "trainable_params": num_params(trainer.model),
        "timed_steps": len(times),
        "step_s": step_s,
        "step_s_all": times,
        "warmup_s": warmup,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "model_tflops_per_s": flops * tokens_per_s / 1e12,
        "peak_flops": PEAK_FLOPS,
        "mfu": flops * tokens_per_s / PEAK_FLOPS if device.type == "cuda" else None,
        "peak_memory_gib": peak_memory_gib(device),
        "losses": losses,
        "ttt_steps": cfg["ttt_steps"],
        "config": config,
    }


def training(
    shape: Shape, size: dict, device: torch.device, dtype: torch.dtype, work: Path, tokens: int
) -> dict:
    """Every variant of the step (VARIANTS) at ``shape``; the section's own figures are the
    last (default) variant's, the others listed under ``variants`` with what each bought."""
    variants, errors = {}, {}
    for name, (fused, compiled) in VARIANTS.items():
        try:
            variants[name] = train_variant(
                shape, size, device, dtype, work, tokens, fused, compiled
            )
            say(
                f"  {shape.name} {name}: {variants[name]['tokens_per_s']:.0f} tokens/s, "
                f"peak {variants[name]['peak_memory_gib'] or 0:.1f} GiB, first steps "
                f"{', '.join(f'{t:.2f}' for t in variants[name]['warmup_s'])} s"
            )
        except Exception:  # the other variants still tell something
            errors[name] = traceback.format_exc()
            say(f"  {shape.name} {name}: FAILED\n{errors[name]}")
        free(device)
    if not variants:
        raise RuntimeError("every variant of the step failed:\n" + "\n".join(errors.values()))
    plain = variants.get("plain")
    for v in variants.values():
        config = v.pop("config")
        if plain is not None:  # the same weights and batches: the same losses within bf16
            v["max_loss_rel_diff"] = max(
                abs(a - b) / abs(b) for a, b in zip(v["losses"], plain["losses"])
            )
            v["over_plain"] = v["tokens_per_s"] / plain["tokens_per_s"]
    name = list(variants)[-1]
    best = variants[name]
    result = {
        "shape": shape.name,
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate": config.intermediate_size,
        "target_vocab": config.vocab_size,
        "draft_vocab": config.draft_vocab_size,
        "ttt_steps": best["ttt_steps"],
        "precision": "bf16 autocast" if device.type == "cuda" else "float32",
        "driven_by": "Trainer.train_step on random bf16 samples packed ahead (no shards on disk)",
        "sample_len": size["train_sample_len"],
        "variant": name,
        **{k: v for k, v in best.items() if k not in ("fused_loss", "compile", "ttt_steps")},
        "variants": variants,
        "variant_errors": errors,
    }
    if shape.name.startswith("Llama") or shape.name == "tiny-llama":
        result["naive_anchor_tokens_per_s"] = NAIVE_ANCHOR
        result["over_naive_anchor"] = best["tokens_per_s"] / NAIVE_ANCHOR
        result["over_specforge"] = best["tokens_per_s"] / SPECFORGE
    return result


# -- profile ---------------------------------------------------------------------------------

CATEGORIES = [  # (category, patterns of kernel names), first match wins
    ("attention", ("flash", "fmha", "attention", "efficient_attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "matmul", "nvjet", "xmma", "mm_", "_mm", "addmm", "bmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("compiled (fused by inductor)", ("triton_",)),
    ("reductions", ("reduce", "softmax", "logsumexp", "argmax", "max", "sum", "norm")),
    (
        "copies, casts, gathers",
        ("copy", "cat", "index", "gather", "scatter", "memcpy", "memset", "fill", "pad", "to_"),
    ),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "mul", "add", "exp", "silu", "div")),
]


def category(name: str) -> str:
    low = name.lower()
    for label, patterns in CATEGORIES:
        if any(p in low for p in patterns):
            return label
    return "other"


def profile(
    shape: Shape, size: dict, device: torch.device, dtype: torch.dtype, work: Path, tokens: int
) -> dict:
    """torch.profiler over ``profile_steps`` steps of the default variant, after its warm-up:
    the step's device time by kernel category and its costliest kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fused, compiled = VARIANTS[list(VARIANTS)[-1]]
    steps = size["train_warmup"] + size["profile_steps"]
    trainer, feed, _, _, step = step_runner(
        shape, size, device, dtype, work, tokens, fused, compiled, steps
    )
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        for _ in range(size["train_warmup"]):
            step()
        with torch_profile(activities=activities) as prof:
            wall = sum(step()[0] for _ in range(size["profile_steps"]))
    finally:
        feed.close()
    kernels = {}
    for event in prof.key_averages():
        on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if cuda and not on_device:
            continue
        us = (
            (
                getattr(event, "self_device_time_total", None)
                or getattr(event, "self_cuda_time_total", 0)
            )
            if cuda
            else event.self_cpu_time_total
        )
        if us:
            kernels[event.key] = kernels.get(event.key, 0) + us
    total = sum(kernels.values()) or 1
    by_category: dict[str, float] = {}
    for name, us in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    steps_n = size["profile_steps"]
    return {
        "variant": list(VARIANTS)[-1],
        "steps": steps_n,
        "tokens_per_step": tokens,
        "wall_s_per_step": wall / steps_n,
        "device_s_per_step": total / 1e6 / steps_n,
        "busy": total / 1e6 / wall if cuda else None,
        "kernels": len(kernels),
        "by_category": {
            k: {"ms_per_step": v / 1e3 / steps_n, "share": v / total}
            for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {
                "kernel": k[:120],
                "ms_per_step": v / 1e3 / steps_n,
                "share": v / total,
                "category": category(k),
            }
            for k, v in top
        ],
    }


# -- disk ------------------------------------------------------------------------------------


def disk(shape: Shape, size: dict, work: Path, repeats: int = 2) -> dict:
    """One shard of about ``disk_bytes`` through ``shards.write`` and as many bytes through a
    plain write, both fsynced, alternated ``repeats`` times (the best of each kept); files
    removed after each."""
    hidden = shape.hidden
    tokens = size["disk_bytes"] // shards.bytes_per_token(hidden, 3, "bfloat16")
    g = torch.Generator().manual_seed(0)
    rows = min(tokens, 2048)  # one random block, repeated: the writer reads it as row pieces
    aux = torch.randn(rows, 3 * hidden, generator=g).to(torch.bfloat16)
    final = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    counts = [rows] * (tokens // rows) + ([tokens % rows] if tokens % rows else [])
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    ids = torch.randint(0, shape.vocab, (tokens,), generator=g)
    path, plain = work / "disk_check.safetensors", work / "disk_check.bin"
    shard_times, plain_times, written = [], [], None
    for _ in range(repeats):
        start = time.perf_counter()
        with open(plain, "wb") as handle:
            left = written.bytes if written else size["disk_bytes"]
            block = memoryview(os.urandom(min(16 << 20, left)))
            while left:
                left -= handle.write(block[: min(left, len(block))])
            handle.flush()
            os.fsync(handle.fileno())
        plain_times.append(time.perf_counter() - start)
        plain_bytes = plain.stat().st_size
        plain.unlink()
        start = time.perf_counter()
        written = shards.write(
            path,
            ids,
            torch.ones(tokens, dtype=torch.uint8),
            offsets,
            torch.full((tokens,), -1),
            [aux[:n] for n in counts],
            [final[:n] for n in counts],
            sample_ids=[f"d{i}" for i in range(len(counts))],
            aux_layer_ids=[0, 1, 2],
            dtype="bfloat16",
            target={"spec": "gpu_check"},
        )
        shard_times.append(time.perf_counter() - start)
        if path.stat().st_size != written.bytes:
            raise RuntimeError(
                f"shards.write reported {written.bytes} bytes, the file has {path.stat().st_size}"
            )
        path.unlink()
    shard_s, plain_s = min(shard_times), min(plain_times)
    shard_rate, plain_rate = written.bytes / shard_s, plain_bytes / plain_s
    return {
        "directory": str(work),
        "bytes": written.bytes,
        "plain_bytes": plain_bytes,
        "tokens": tokens,
        "hidden": hidden,
        "shard_write_s": shard_s,
        "plain_write_s": plain_s,
        "shard_write_s_all": shard_times,
        "plain_write_s_all": plain_times,
        "shard_write_gb_per_s": shard_rate / 1e9,
        "plain_write_gb_per_s": plain_rate / 1e9,
        "shard_over_plain": shard_rate / plain_rate,
    }


# -- the run ---------------------------------------------------------------------------------

SECTIONS = ["extraction", "train_llama", "train_kimi", "profile", "disk"]


def render(result: dict) -> str:
    s = result["sections"]

    def value(section, key):
        return s.get(section, {}).get(key)

    def fmt(v, spec="{:.3g}"):
        return "-" if v is None else spec.format(v)

    def status(v, least):
        if least is None or v is None:
            return "-"
        if result["tiny"]:
            return "n/a (tiny shapes)"
        return "met" if v >= least else "missed"

    def row(what, goal, v, spec="{:.3g}", least=None):
        return f"| {what} | {goal} | {fmt(v, spec)} | {status(v, least)} |"

    llama, kimi = (result["shapes"][k]["name"] for k in ("llama", "kimi"))
    lines = [
        f"# GPU check: {result['device']}",
        "",
        f"torch {result['torch']}, transformers {result['transformers']}, "
        f"{result['elapsed_s']['total']:.0f} s in all{' (tiny shapes)' if result['tiny'] else ''}",
        "",
        "| measure | goal | measured | |",
        "|---|---|---|---|",
        row(
            f"extraction / hooked forward ({llama} target, one shard written)",
            ">= 0.85",
            value("extraction", "extraction_over_forward"),
            "{:.3f}",
            GOALS["extraction_over_forward"],
        ),
        row("extraction tokens/s", "-", value("extraction", "extraction_tokens_per_s"), "{:.0f}"),
        row(
            "  the same, writer not overlapped (/ hooked forward)",
            "-",
            value("extraction", "extraction_not_overlapped_over_forward"),
            "{:.3f}",
        ),
        row(
            f"  {value('extraction', 'shards_in_one_job') or '-'} shards in one job "
            f"(/ hooked forward)",
            "-",
            value("extraction", "shards_in_one_job_over_forward"),
            "{:.3f}",
        ),
        row(
            "hooked forward tokens/s (3 aux layers)",
            "-",
            value("extraction", "hooked_forward_tokens_per_s"),
            "{:.0f}",
        ),
        row(
            "plain forward tokens/s",
            "-",
            value("extraction", "plain_forward_tokens_per_s"),
            "{:.0f}",
        ),
        row(
            f"training tokens/s, {llama} drafter, TTT 7, "
            f"{result['sizes']['train_tokens']['llama']} tokens a step",
            ">= 32K",
            value("train_llama", "tokens_per_s"),
            "{:.0f}",
            GOALS["train_llama_tokens_per_s"],
        ),
        row("  MFU (of 989 TFLOP/s)", "-", value("train_llama", "mfu"), "{:.1%}"),
        row("  peak memory GiB", "<= 60", value("train_llama", "peak_memory_gib"), "{:.1f}"),
        row(
            f"training tokens/s, {kimi} drafter, TTT 7, "
            f"{result['sizes']['train_tokens']['kimi']} tokens a step",
            ">= 14K",
            value("train_kimi", "tokens_per_s"),
            "{:.0f}",
            GOALS["train_kimi_tokens_per_s"],
        ),
        row("  MFU (of 989 TFLOP/s)", "-", value("train_kimi", "mfu"), "{:.1%}"),
        row("  peak memory GiB", "-", value("train_kimi", "peak_memory_gib"), "{:.1f}"),
        row(
            "shards.write / plain write, both fsynced",
            ">= 0.9",
            value("disk", "shard_over_plain"),
            "{:.2f}",
            GOALS["shard_over_plain"],
        ),
        row("  disk GB/s, shards.write", "-", value("disk", "shard_write_gb_per_s"), "{:.2f}"),
        row("  disk GB/s, plain write", "-", value("disk", "plain_write_gb_per_s"), "{:.2f}"),
        "",
    ]
    for section in ("train_llama", "train_kimi"):
        variants = s.get(section, {}).get("variants")
        if not variants:
            continue
        lines += [
            f"Training step variants, {s[section]['shape']} "
            f"({s[section]['tokens_per_step']} tokens a step):",
            "",
            "| variant | tokens/s | x plain | MFU | peak GiB | max loss rel. diff vs plain | first steps s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, v in variants.items():
            lines.append(
                f"| {name} | {v['tokens_per_s']:.0f} | {fmt(v.get('over_plain'), '{:.2f}')} | "
                f"{fmt(v['mfu'], '{:.1%}')} | {fmt(v['peak_memory_gib'], '{:.1f}')} | "
                f"{fmt(v.get('max_loss_rel_diff'), '{:.1e}')} | "
                f"{', '.join(f'{t:.2f}' for t in v['warmup_s'])} |"
            )
        lines += [
            f"Failed variant {n}: {e.strip().splitlines()[-1]}"
            for n, e in s[section].get("variant_errors", {}).items()
        ]
        lines.append("")
    if "profile" in s:
        p = s["profile"]
        lines += [
            f"Where a step's device time goes ({p['variant']}, {p['tokens_per_step']} tokens, "
            f"{fmt(p['device_s_per_step'] * 1e3, '{:.1f}')} ms of kernels in "
            f"{fmt(p['wall_s_per_step'] * 1e3, '{:.1f}')} ms, {p['kernels']} kernels):",
            "",
            "| category | ms a step | share |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['ms_per_step']:.2f} | {v['share']:.1%} |"
            for k, v in p["by_category"].items()
        ]
        lines.append("")
    lines += [f"Skipped {name}: {why}" for name, why in result["skipped"].items()]
    lines += [
        f"Failed {name}: {err.strip().splitlines()[-1]}" for name, err in result["errors"].items()
    ]
    lines += [
        "",
        "Extraction: random token ids, extract.min_teacher_agreement 0. Training: "
        "Trainer.train_step on random samples, one micro-batch a step, all variants from "
        "the same weights over the same batches. Raw numbers: gpu_check.json.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    global CLOCK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="where gpu_check.json and .md go")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, any device (the test)")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420, help="skip sections that would end later than this"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"the training step's variants to time, of {', '.join(VARIANTS)} "
        f"(the profile takes the last)",
    )
    parser.add_argument(
        "--work",
        help="directory for shards and disk writes (default: a "
        "temporary one in --out, on the disk results go to)",
    )
    parser.add_argument(
        "--keep-shard",
        action="store_true",
        help="keep the extracted shard as <out>/gpu_check_shard.safetensors",
    )
    args = parser.parse_args()
    CLOCK = Clock(args.budget_s)
    wanted = args.sections.split(",")
    chosen = args.variants.split(",")
    if unknown := sorted(set(chosen) - set(VARIANTS)):
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    for name in list(VARIANTS):
        if name not in chosen:
            del VARIANTS[name]
    if unknown := sorted(set(wanted) - set(SECTIONS)):
        parser.error(f"unknown sections {unknown}; known: {SECTIONS}")
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = "tiny" if args.tiny else "full"
    shapes, size = SHAPES[scale], SIZES[scale]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check.", dir=out))
    work.mkdir(parents=True, exist_ok=True)
    import transformers

    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "goals": GOALS,
        "shapes": {
            k: {
                f: getattr(v, f)
                for f in (
                    "name",
                    "hidden",
                    "layers",
                    "heads",
                    "kv_heads",
                    "head_dim",
                    "intermediate",
                    "vocab",
                    "draft_vocab",
                )
            }
            for k, v in shapes.items()
        },
        "sizes": size,
        "sections": {},
        "skipped": {},
        "errors": {},
        "elapsed_s": {},
    }
    runs = {
        "extraction": lambda: extraction(
            shapes["llama"],
            size,
            device,
            dtype,
            work,
            out / "gpu_check_shard.safetensors" if args.keep_shard else None,
        ),
        "train_llama": lambda: training(
            shapes["llama"], size, device, dtype, work, size["train_tokens"]["llama"]
        ),
        "train_kimi": lambda: training(
            shapes["kimi"], size, device, dtype, work, size["train_tokens"]["kimi"]
        ),
        "profile": lambda: profile(
            shapes["llama"], size, device, dtype, work, size["train_tokens"]["llama"]
        ),
        "disk": lambda: disk(shapes["llama"], size, work),
    }
    say(
        f"gpu_check on {result['device']}, torch {torch.__version__}, {scale} shapes, "
        f"sections {wanted}, budget {args.budget_s:.0f}s"
    )
    try:
        for name in SECTIONS:
            if name not in wanted:
                result["skipped"][name] = "not asked for (--sections)"
                continue
            expected = 0 if args.tiny else ESTIMATES[name]
            if CLOCK.elapsed() + expected > args.budget_s:
                result["skipped"][name] = (
                    f"running late: {CLOCK.elapsed():.0f}s gone, about "
                    f"{expected}s needed, budget {args.budget_s:.0f}s"
                )
                say(f"{name}: skipped, {result['skipped'][name]}")
                continue
            say(f"{name}: start")
            start = time.monotonic()
            try:
                result["sections"][name] = runs[name]()
                say(f"{name}: {json.dumps(summary(result['sections'][name]))}")
            except Exception:  # keep going: the other sections still tell something
                result["errors"][name] = traceback.format_exc()
                say(f"{name}: FAILED\n{result['errors'][name]}")
            finally:
                result["elapsed_s"][name] = time.monotonic() - start
                free(device)
            write_outputs(out, result)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    write_outputs(out, result)
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    print(render(result))
    return 1 if result["errors"] else 0


def summary(section: dict) -> dict:
    keys = (
        "extraction_tokens_per_s",
        "extraction_over_forward",
        "extraction_not_overlapped_over_forward",
        "shards_in_one_job_over_forward",
        "tokens_per_s",
        "mfu",
        "peak_memory_gib",
        "shard_write_gb_per_s",
        "plain_write_gb_per_s",
        "shard_over_plain",
        "device_s_per_step",
        "wall_s_per_step",
    )
    return {k: round(section[k], 4) for k in keys if section.get(k) is not None}


def write_outputs(out: Path, result: dict) -> None:
    result["elapsed_s"]["total"] = CLOCK.elapsed()
    write_json(out / "gpu_check.json", result)
    (out / "gpu_check.md").write_text(render(result))


if __name__ == "__main__":
    sys.exit(main())
