"""`eaglet plan`: memory per stage, estimated from shapes before a run starts.

Counts what each stage holds at its peak, from the target's and the drafter's shapes and the
run's settings; nothing is loaded. The numbers are estimates: they count the tensors the
code creates and keeps (weights, optimizer states, the tensors autograd saves for the
backward pass, the biggest transient ones), not allocator fragmentation, the CUDA context
(about 0.5 GiB) or library workspaces.

Stages:

* extraction (``hf`` backend): the target's weights in its dtype, one forward pass of
  ``extract.batch_tokens`` padded tokens (inference mode: one layer's activations at a time,
  plus the captured aux and final states), the teacher check's logits chunk; on the host the
  states of the shard being written (kept per sample; streamed to disk in row blocks).
* training: drafter parameters, gradients and AdamW states in float32, bf16 autocast copies
  of the weights, the frozen target embedding and teacher lm_head rows, and the activations
  autograd keeps for the TTT unroll of ``max_tokens_per_batch`` rows (every row scored at
  every step). The TTT attention (``attention.ttt_attention``) materializes float32 scores
  [heads, n, n] per step for an attention block of n rows, kept for backward (and a bf16
  copy under autocast); the worst case, reported here, is one sample filling the batch
  (n = min(max_len, max_tokens_per_batch)). A fused kernel (``train.attention`` sdpa or
  flex, what ``auto`` selects) keeps per step and row only its inputs (q, k, v padded with
  the sink column, ``attention.sdpa_ttt_attention``), its output, a float32 log-sum-exp per
  head and the float32 [heads, head_dim] terms that fold the later steps' own keys in. The
  total is of the path ``train.attention`` selects; the other one is printed beside it.
* disk: ``shards.bytes_per_token`` per stored token; for a dataset of ``--tokens`` training
  tokens, the peak of each ``train.data`` mode (``dataset_disk``): ``shards`` keeps every
  shard, plus the capture server's request files of a shard not packed yet; ``stream``
  keeps the held-out shard and a bounded window of request files.
* co-location (``train.data: stream``): one rank of the capture server (its share of the
  target's weights as vLLM loads them, quantized experts as they are packed; a KV cache for
  the tokens in flight with the captured states; an allowance for the rest) beside one
  training rank and its teacher check of the streamed states, on each of the node's GPUs,
  against an H200 and a B200.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from eaglet.core import methods
from eaglet.core.config import ConfigError, eval_shard_count, load_run_config, validate
from eaglet.core.gpus import GPU_BYTES, GPU_NAME, GPU_USABLE
from eaglet.core.io import human_size, read_json
from eaglet.core.layout import HIDDEN, SHARD_GLOB, START_DRAFTER, SYNTHETIC_STATS, TARGET_JSON
from eaglet.data import shard_format
from eaglet.data.shard_format import bytes_per_token
from eaglet.engine.support import ask_in_subprocess, refusal
from eaglet.model import published
from eaglet.model.config import resolve_attention
from eaglet.model.sizes import CHUNK_ELEMENTS as LOSS_CHUNK_ELEMENTS
from eaglet.model.sizes import (
    DTYPE_BYTES,
    NUM_AUX,
    PRESETS,
    Shape,
    default_window,
    drafter_extra_params,
    drafter_params,
    serving_weights,
    shape_from_target_config,
    target_params,
    target_size,
    with_drafter,
)
from eaglet.target.checkpoint import TEACHER_CHUNK_ROWS as TEACHER_CHUNK
from eaglet.target.checkpoint import TargetError, local_dir, snapshot

GiB = 2**30


# -- parameter counts ------------------------------------------------------------------------


# -- extraction ------------------------------------------------------------------------------


def extraction(
    s: Shape,
    batch_tokens: int,
    max_len: int,
    target_dtype: str,
    store_dtype: str,
    shard_tokens: int,
) -> dict:
    """Bytes on the device and on the host of one ``hf`` extraction job."""
    a = DTYPE_BYTES[target_dtype]
    t = max(batch_tokens, max_len)  # a sequence longer than the budget is a batch of its own
    layer_peak = t * (
        2 * s.hidden * a  # residual stream and the layer's input
        + 4 * s.hidden  # RMSNorm's float32 copy
        + 3 * s.intermediate * a
    )  # gate, up, their product
    captured = t * (NUM_AUX + 1) * s.hidden * a * 2  # aux + final, and their unpadded copies
    stored = t * bytes_per_token(
        s.hidden, NUM_AUX, store_dtype
    )  # one batch, as the shard stores it
    # a batch's stored states are kept on the device until their copy to the host is done
    teacher = (
        TEACHER_CHUNK * s.vocab * (a + 4 + 4)  # logits, float32, log_softmax
        + t * s.hidden * 4
    )  # the batch's stored final states in float32
    device = {
        "target weights": target_params(s) * a,
        "activations of one batch": layer_peak + captured,
        "stored states of the batch being copied to the host": stored,
        "teacher check": teacher,
    }
    # each batch is written from its pinned buffer at its samples' places in the shard file,
    # and the file is digested a block at a time: the shard is never whole in memory
    host = {
        "pinned staging buffers of the copies (2 batches)": 2 * stored,
        "the shard's teacher argmax and log-probabilities": shard_tokens * (8 + 4),
        "blocks being digested (8 MiB per digest thread)": 4 * shard_format.DIGEST_BLOCK,
    }
    return {"device": device, "host": host}


# -- training --------------------------------------------------------------------------------

SINK_PAD = 8  # columns the fused path adds to the head dim on CUDA (the sink's; 1 on CPU)
FUSED = ("sdpa", "flex")


def ttt_attention_bytes(
    s: Shape, rows: int, block: int, steps: int, act: int, fused: bool = False, pad: int = SINK_PAD
) -> int:
    """What the attention of all TTT steps keeps for backward, beyond the projections."""
    heads, kv, d, dv = s.d_heads, s.d_kv_heads, s.d_qk_dim, s.d_v_dim
    if fused:
        # step 0: the kernel's q, k, v (contiguous copies) and output in act, its float32
        # log-sum-exp per head
        first = (heads + kv) * (d + dv) * act + 4 * heads
        if s.mla:  # the kernel reads views of q, k and kv_b_proj's output (ttt_rows_bytes')
            first = heads * dv * act + 4 * heads
        # later steps: q, k, v and output with the sink column, the log-sum-exp, float32
        # per-head terms (the sink's weight, the denominator, the own keys' weights) and
        # float32 [heads, dv] sums of the own keys' values, the numerator and its input
        later = (
            (heads + kv) * (d + dv + 2 * pad) * act + 4 * heads + 3 * 4 * heads + 3 * 4 * heads * dv
        )
        return rows * (first + (steps - 1) * later)
    blocks = rows // block
    square = heads * block * block
    per_step = blocks * square * (4 + (act if act != 4 else 0))  # exp'd scores (+ bf16 copy)
    per_step += blocks * block * block  # the block's bool mask (shared)
    per_step += rows * heads * dv * 4  # float32 output before the cast
    return steps * per_step


def ttt_rows_bytes(s: Shape, rows: int, steps: int, act: int, fused_loss: bool = True) -> int:
    """Per TTT step and row: what the norms, projections, MLP and logits keep for backward
    (``fused_loss``: the logits' gradient in the matmul dtype, ``eaglet.model.loss``)."""
    h, d, i = s.hidden, s.head_dim, s.d_intermediate
    f = 4
    cast = act != 4  # under autocast the float32 copies are extra tensors
    norms = h * (
        act  # input_layernorm: normalized embedding
        + (f if cast else 0)
        + act  # hidden_norm: float32 input, normalized
        + 2 * act  # cat([e, h]) for the input projections
        + (f if cast else 0)
        + 2 * act  # post_attention_layernorm and its output
        + f
        + 2 * act
    )  # final norm: float32 input, normalized, output
    if s.mla:
        heads, qk, rope = s.d_heads, s.d_qk_dim, s.qk_rope_head_dim
        q_lora, kv_lora = s.q_lora_rank or 0, s.kv_lora_rank
        attn = (
            q_lora * (f + 2 * act)  # q_a_layernorm: input, normalized
            + heads * (qk + rope) * act  # q_b_proj's output and its rope part
            + (kv_lora + rope) * act
            + (kv_lora * f if cast else 0)  # kv_a_proj_with_mqa
            + kv_lora * 2 * act
            + rope * act  # kv_a_layernorm, the rotated k_pe
            + heads * (s.qk_nope_head_dim + s.v_head_dim) * act  # kv_b_proj: k_nope, v
            + heads * 2 * qk * act  # q and k with their rope parts
            + heads * s.v_head_dim * act
        )  # o_proj's input
    else:
        attn = (3 * s.d_heads + 4 * s.d_kv_heads) * d * act + s.d_heads * d * act  # rope, o_proj in
    mlp = 4 * i * act
    logits = (
        act * (s.draft_vocab + h)
        if fused_loss  # the logits' gradient, lm_head's input
        else 2 * f * s.draft_vocab
    )  # float32 logits and the teacher's rows of them
    return steps * rows * (norms + attn + mlp + logits)


def training(
    s: Shape,
    tokens: int,
    max_len: int | None,
    steps: int,
    precision: str = "bfloat16",
    embed_dtype: str = "bfloat16",
    attention: str = "auto",
    sink_pad: int = SINK_PAD,
    fused_loss: bool = True,
) -> dict:
    """Bytes on one training rank's device at the peak (the end of the forward pass), with
    the TTT attention of ``attention`` (``train.attention``) and the loss fused with lm_head
    or not (``train.fused_loss``)."""
    attention = resolve_attention(attention, "cuda")  # on a GPU
    act = 2 if precision == "bfloat16" else 4
    block = min(max_len or tokens, tokens)
    p = drafter_params(s)
    e = DTYPE_BYTES[embed_dtype]
    fixed = {
        "drafter weights (float32)": 4 * p,
        "gradients (float32)": 4 * p,
        "AdamW states (2 x float32)": 8 * p,
        "frozen target embedding": s.vocab * s.hidden * e,
        "teacher lm_head rows": s.draft_vocab * s.hidden * e,
    }
    if act == 2:
        fixed["bf16 autocast weight copies"] = 2 * p
    inputs = tokens * (NUM_AUX + 1) * s.hidden * act + (
        tokens * (s.draft_vocab * act + 4)
        if fused_loss  # teacher logits, log-normalizer
        else tokens * s.draft_vocab * 4
    )  # teacher probabilities
    # DFlash: every row's block of steps + 1 slots through each of its layers, taken as that
    # many TTT steps (its keys over the context and the block: a TTT step's with more own keys)
    passes = methods.method(s.method).layer_passes(steps, s.dflash_layers)
    rows = ttt_rows_bytes(s, tokens, passes, act, fused_loss)
    scores = ttt_attention_bytes(s, tokens, block, passes, act)
    fused = ttt_attention_bytes(s, tokens, block, passes, act, fused=True, pad=sink_pad)
    # backward of the last step's attention: float32 gradient of its scores (and a bf16 one)
    square = (tokens // block) * s.d_heads * block * block
    backward = square * (4 + (act if act != 4 else 0))
    out = dict(fixed)
    out["batch inputs and the teacher"] = inputs
    method = methods.method(s.method)
    what = (
        f"{method.words} activations, {steps + 1} slots x {s.dflash_layers} layer(s)"
        if method.block
        else f"TTT activations, {steps} steps"
    )
    out[f"{what} (norms, projections, MLP, logits)"] = rows
    if fused_loss:  # one chunk's float32 logits, probabilities and gradient at a time
        out["fused loss: one chunk of rows"] = LOSS_CHUNK_ELEMENTS * (4 + 4 + 4 + act)
    if attention in FUSED:
        out[
            f"TTT attention, {attention} (kernel inputs and outputs, log-sum-exp; no "
            f"[heads, n, n] scores)"
        ] = fused
    else:
        out[f"TTT attention scores [heads, n, n] float32, n = {block}"] = scores
        out["backward of one step's scores"] = backward
    return {
        "device": out,
        "attention": attention,
        "fused_attention": fused,
        "unfused_attention": scores + backward,
    }


def fits(device_bytes: int) -> bool:
    return device_bytes <= GPU_USABLE * GPU_BYTES


# -- the dataset on disk, by train.data mode -------------------------------------------------

TOKEN_ID_BYTES = 8  # a request file's token_ids are int64


def request_bytes_per_token(s: Shape, dtype: str) -> int:
    """One token of a capture server's request file (``eaglet.engine.connector``): the aux
    layers' and layer L's states in the server's dtype, and the token's id."""
    return (NUM_AUX + 1) * s.hidden * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES


def dataset_disk(
    s: Shape,
    *,
    train_tokens: int,
    heldout_tokens: int,
    store_dtype: str,
    serving_dtype: str,
    num_shards: int,
    capture_during_generation: bool,
    window_tokens: int,
    num_eval_shards: int = 1,
) -> dict:
    """Peak disk of a dataset's hidden states in each ``train.data`` mode, with the bytes
    stored and the request files at the peak.

    shards: every shard, training and held-out, is kept. The vllm backend writes each
    sample's request file first, packs a shard from them and then deletes them; its request
    window runs at most one shard ahead of the shard being packed (``extract_vllm``): the
    peak is all shards and the request files of the two largest. With
    ``generate.capture_hidden_states`` generation writes every sample's request file before
    any is packed: the peak is the larger of all request files and the first shard, or all
    shards and the request files of the two largest.

    stream: only the held-out split is stored (extracted and packed as in shards mode); the
    training samples' request files live from the server's write to the trainer's read, at
    most ``window_tokens`` of them."""
    shard = bytes_per_token(s.hidden, NUM_AUX, store_dtype)
    request = request_bytes_per_token(s, serving_dtype)
    every = train_tokens + heldout_tokens
    heldout_shard = -(-heldout_tokens // num_eval_shards)
    sizes = sorted(
        [-(-train_tokens // max(num_shards, 1))] * num_shards + [heldout_shard] * num_eval_shards
    )
    largest, unpacked = sizes[-1], sum(sizes[-2:])  # the shard being packed, the next one
    at_end = (every * shard, unpacked * request)
    peaks = [at_end]
    if capture_during_generation:
        peaks.append((largest * shard, every * request))
    stored, requests = max(peaks, key=sum)
    held = heldout_tokens * shard
    # the vllm backend's window: the held-out shard being packed and the next
    in_flight = max(min(num_eval_shards, 2) * heldout_shard, window_tokens) * request
    return {
        "train_tokens": train_tokens,
        "heldout_tokens": heldout_tokens,
        "num_eval_shards": num_eval_shards,
        "heldout_shard_tokens": heldout_shard,
        # the vllm backend packs a shard in host memory, its states as the server saved them
        "largest_shard_tokens": largest,
        "packing_host_bytes": largest * request,
        "shard_bytes_per_token": shard,
        "request_bytes_per_token": request,
        "unpacked_tokens": unpacked,
        "window_tokens": window_tokens,
        "shards": {
            "stored": every * shard,
            "peak_shards": stored,
            "peak_requests": requests,
            "peak": stored + requests,
        },
        "stream": {
            "stored": held,
            "peak_shards": held,
            "peak_requests": in_flight,
            "peak": held + in_flight,
        },
    }


# -- the capture server and the trainer on the same GPUs (train.data: stream) ---------------

# nvidia-smi's totals of an H200 ("141 GB") and a B200 ("192 GB")
DEVICES = {"H200": 143_771 * 2**20, "B200": 183_359 * 2**20}
# a server rank's memory beyond its weights and KV cache, allowed for and not counted: the
# activations of a prefill chunk (vLLM's max_num_batched_tokens), CUDA graphs, NCCL buffers
SERVER_ALLOWANCE = 4 * GiB


def kv_bytes_per_token(s: Shape, ranks: int, dtype: str) -> int:
    """A token's cache on one rank of the capture server: MLA's latent and rope key (whole on
    every rank), or K and V of the rank's share of KV heads; plus the captured states
    (the capture's cache layer, [aux layers + 1, H] a token, whole on every rank)."""
    a = DTYPE_BYTES[dtype]
    if s.kv_lora_rank:
        attention = s.layers * (s.kv_lora_rank + s.qk_rope_head_dim) * a
    else:
        attention = s.layers * 2 * -(-s.kv_heads // ranks) * s.head_dim * a
    return attention + (NUM_AUX + 1) * s.hidden * a


def capture_server(
    s: Shape,
    *,
    ranks: int,
    dtype: str,
    kv_tokens: int,
    kv_cache_bytes: int | None = None,
    served_bytes: int | None = None,
) -> dict:
    """One rank of the capture server with tensor parallelism over ``ranks``: its share of
    the weights, a KV cache of ``kv_tokens`` (or the configured ``kv_cache_bytes``) and
    SERVER_ALLOWANCE. ``served_bytes``: the weights as the target's files give them, in
    place of the shape's count."""
    split, whole = serving_weights(s, dtype)
    if served_bytes is not None:
        split = max(served_bytes - whole, 0)
    kv = (
        kv_cache_bytes
        if kv_cache_bytes is not None
        else kv_tokens * kv_bytes_per_token(s, ranks, dtype)
    )
    return {
        "weights": split // ranks + whole,
        "kv_cache": kv,
        "allowance": SERVER_ALLOWANCE,
        "weights_all_ranks": split + whole,
        "replicated_weights": whole,
    }


def colocation(server: int, trainer: int, devices: dict[str, int] | None = None) -> dict:
    """Whether a server rank of ``server`` bytes and a training rank of ``trainer`` bytes fit
    on one GPU of each of ``devices`` (name: bytes), GPU_USABLE of it."""
    total = server + trainer
    return {
        name: {
            "device_bytes": size,
            "usable": int(GPU_USABLE * size),
            "fits": total <= GPU_USABLE * size,
        }
        for name, size in (devices or DEVICES).items()
    }


# -- the plan for a run or a preset ----------------------------------------------------------


def stream_teacher(s: Shape, dtype: str) -> int:
    """A streaming rank's teacher check (``eaglet.stages.train.stream.StateFeed``): the target's
    full-vocabulary lm_head, and the logits of a chunk of rows (as extraction's)."""
    a = DTYPE_BYTES[dtype]  # "auto": the checkpoint's, counted as bfloat16
    return s.vocab * s.hidden * a + TEACHER_CHUNK * s.vocab * (a + 4 + 4)


def stream_window_tokens(
    window_samples: int | None, concurrency: int, ranks: int, longest: int, batch_tokens: int
) -> int:
    """The training tokens stream mode's feeds hold ahead of the trainer at most, in files:
    ``window_samples`` samples of up to ``longest`` tokens (train.stream_ahead, shared by
    the ranks), else each of ``ranks`` feeds' default
    (:meth:`eaglet.stages.train.stream.StateFeed.window`, here in tokens): its share of
    ``concurrency`` requests beside a micro-batch of ``batch_tokens``, at least twice that
    share."""

    if window_samples:
        return ranks * -(-window_samples // ranks) * longest
    return ranks * default_window(-(-concurrency // ranks) * longest, batch_tokens)


def plan(
    s: Shape,
    *,
    tokens: int,
    max_len: int | None,
    steps: int,
    batch_tokens: int,
    extract_max_len: int,
    target_dtype: str,
    store_dtype: str,
    shard_tokens: int,
    precision: str = "bfloat16",
    attention: str = "auto",
    train_tokens: int | None = None,
    heldout_tokens: int = 0,
    num_shards: int = 1,
    num_eval_shards: int = 1,
    capture_during_generation: bool = False,
    window_samples: int | None = 32,
    concurrency: int = 16,
    ranks: int = 8,
    train_ranks: int = 1,
    kv_tokens: int | None = None,
    kv_cache_bytes: int | None = None,
    served_bytes: int | None = None,
    overlap: bool | str = "auto",
    fused_loss: bool = True,
) -> dict:
    """Every stage's memory for ``s`` at ``tokens`` rows a micro-batch; with
    ``train_tokens`` also the dataset's disk in each train.data mode (a stream window of
    ``window_samples`` samples of up to ``extract_max_len`` tokens; None: the feed's default,
    ``concurrency`` samples beside a micro-batch of ``tokens``, at least 2 x ``concurrency``
    samples, :meth:`eaglet.stages.train.stream.StateFeed.window`; of ``train_ranks`` data-parallel
    ranks, each feeds its share of the concurrency beside a micro-batch); and the capture
    server (a KV cache of ``kv_tokens``, default one longest sample) and a training rank
    on each of ``ranks`` GPUs together."""
    ext = extraction(s, batch_tokens, extract_max_len, target_dtype, store_dtype, shard_tokens)
    embed = target_dtype if target_dtype != "auto" else "bfloat16"
    tr = training(
        s,
        tokens,
        max_len,
        steps,
        precision,
        embed_dtype=embed,
        attention=attention,
        fused_loss=fused_loss,
    )
    train_total = sum(tr["device"].values())
    fused = tr["attention"] in FUSED
    rest = train_total - (tr["fused_attention"] if fused else tr["unfused_attention"])
    out = {
        "shape": asdict(s),
        "tokens_per_batch": tokens,
        "ttt_steps": steps,
        "attention": tr["attention"],
        "drafter_attention": s.drafter_attention,
        "drafter_variant": s.drafter_variant,
        "method": s.method,
        "target_dtype": target_dtype,
        "precision": precision,
        "extract_batch_tokens": batch_tokens,
        "extract_max_len": extract_max_len,
        "target_params": target_params(s),
        "drafter_params": drafter_params(s),
        "drafter_extra_params": drafter_extra_params(s),
        "extraction": ext,
        "extraction_device": sum(ext["device"].values()),
        "extraction_host": sum(ext["host"].values()),
        "training": tr["device"],
        "training_device": train_total,
        "training_device_fused_attention": rest + tr["fused_attention"],
        "training_device_eager_attention": rest + tr["unfused_attention"],
        "shard_bytes_per_token": bytes_per_token(s.hidden, NUM_AUX, store_dtype),
        "shard_tokens": shard_tokens,
        "shard_bytes": shard_tokens * bytes_per_token(s.hidden, NUM_AUX, store_dtype),
    }
    # the drafter of the other train.drafter_attention, where its method can be built so
    other_attention = "llama" if s.mla else "mla"
    if (
        s.kv_lora_rank
        and s.q_lora_rank
        and not methods.method(s.method).refusal(other_attention, s.drafter_variant)
    ):
        other = with_drafter(s, other_attention)
        other_tr = training(
            other,
            tokens,
            max_len,
            steps,
            precision,
            embed_dtype=embed,
            attention=attention,
            fused_loss=fused_loss,
        )
        out["other_drafter"] = {
            "drafter_attention": other.drafter_attention,
            "drafter_params": drafter_params(other),
            "training_device": sum(other_tr["device"].values()),
        }
    if train_tokens is not None:
        out["disk"] = dataset_disk(
            s,
            train_tokens=train_tokens,
            heldout_tokens=heldout_tokens,
            store_dtype=store_dtype,
            serving_dtype=target_dtype,
            num_shards=num_shards,
            num_eval_shards=num_eval_shards,
            capture_during_generation=capture_during_generation,
            window_tokens=stream_window_tokens(
                window_samples, concurrency, train_ranks, extract_max_len, tokens
            ),
        )
        out["disk"].update(
            window_samples=window_samples,
            num_shards=num_shards,
            concurrency=concurrency,
            train_ranks=train_ranks,
            capture_during_generation=capture_during_generation,
        )
    kv_tokens = extract_max_len if kv_tokens is None else kv_tokens
    server = capture_server(
        s,
        ranks=ranks,
        dtype=target_dtype,
        kv_tokens=kv_tokens,
        kv_cache_bytes=kv_cache_bytes,
        served_bytes=served_bytes,
    )
    server_total = server["weights"] + server["kv_cache"] + server["allowance"]
    teacher = stream_teacher(s, target_dtype)
    rank_total = train_total + teacher
    out["colocation"] = {
        "ranks": ranks,
        "kv_tokens": None if kv_cache_bytes is not None else kv_tokens,
        "kv_bytes_per_token": kv_bytes_per_token(s, ranks, target_dtype),
        "expert_bits": s.expert_bits,
        "expert_format": s.expert_format,
        "server": server,
        "server_total": server_total,
        "trainer": train_total,
        "teacher_check": teacher,
        "total": server_total + rank_total,
        "devices": colocation(server_total, rank_total),
        "overlap": overlap,
    }  # train.stream_overlap: auto takes turns on shared GPUs
    return out


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _fit_line(n: int) -> str:
    verdict = "fits" if fits(n) else "does NOT fit"
    return (
        f"{verdict} {GPU_NAME} ({gib(n)} of {gib(GPU_USABLE * GPU_BYTES)} usable, "
        f"{GPU_USABLE:.0%} of {gib(GPU_BYTES)})"
    )


def render(p: dict, store_dtype: str) -> str:
    s = p["shape"]
    lines = [
        f"== {s['name']}: hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, "
        f"draft vocab {s['draft_vocab']}; {p['tokens_per_batch']} tokens per batch, "
        f"{p['ttt_steps']} TTT steps",
        f"   settings: target in {p['target_dtype']}, shards in {store_dtype}, extraction "
        f"batches of {p['extract_batch_tokens']} padded tokens, samples up to "
        f"{p['extract_max_len']} tokens, training in {p['precision']}",
        f"   target {p['target_params'] / 1e9:.2f}B parameters, drafter "
        f"{p['drafter_params'] / 1e6:.1f}M trainable (train.drafter_attention "
        f"{p['drafter_attention']}, drafter_variant {p['drafter_variant']}, method "
        f"{p['method']}{_dflash_text(s)}{_extra_text(p['drafter_extra_params'])})",
    ]
    if "other_drafter" in p:
        o = p["other_drafter"]
        lines.append(
            f"   with train.drafter_attention {o['drafter_attention']} instead: drafter "
            f"{o['drafter_params'] / 1e6:.1f}M trainable, training "
            f"{gib(o['training_device'])} a rank"
        )
    for note in s["assumptions"]:
        lines.append(f"   assumed: {note}")
    lines.append("extraction (hf backend, one job)")
    for name, n in p["extraction"]["device"].items():
        lines.append(f"   device  {gib(n):>11}  {name}")
    lines.append(
        f"   device  {gib(p['extraction_device']):>11}  total: {_fit_line(p['extraction_device'])}"
    )
    for name, n in p["extraction"]["host"].items():
        lines.append(f"   host    {gib(n):>11}  {name}")
    lines.append(
        f"   host    {gib(p['extraction_host']):>11}  total, for a shard of "
        f"{p['shard_tokens']:,} tokens"
    )
    lines.append(f"training (one rank, train.attention {p['attention']})")
    for name, n in p["training"].items():
        lines.append(f"   device  {gib(n):>11}  {name}")
    lines.append(
        f"   device  {gib(p['training_device']):>11}  total: {_fit_line(p['training_device'])}"
    )
    if p["attention"] in FUSED:
        other = p["training_device_eager_attention"]
        lines.append(
            f"   device  {gib(other):>11}  with eager attention instead ([heads, n, n] "
            f"float32 scores kept): {_fit_line(other)}"
        )
    else:
        other = p["training_device_fused_attention"]
        lines.append(
            f"   device  {gib(other):>11}  with fused attention instead (sdpa/flex: no "
            f"[heads, n, n] scores kept): {_fit_line(other)}"
        )
    lines.append(
        f"disk: {p['shard_bytes_per_token']:,} bytes per token ({store_dtype}), "
        f"{gib(p['shard_bytes'])} per {p['shard_tokens']:,}-token shard"
    )
    if "disk" in p:
        lines.extend(_disk_lines(p["disk"]))
    lines.extend(_colocation_lines(p["colocation"], p["target_dtype"]))
    return "\n".join(lines)


def _dflash_text(shape: dict) -> str:
    """The drafter's depth, where its method has one (DFlash's)."""
    depth = methods.method(shape["method"]).depth(shape["dflash_layers"])
    return f" of {depth}" if depth else ""


def _extra_text(extra: dict[str, int]) -> str:
    return "".join(f"; {name} {n:,}" for name, n in extra.items())


def size(n: float) -> str:
    """GiB, and decimal TB (as disks are sold) from 1 TB up."""
    return f"{n / GiB:,.1f} GiB" + (f" ({n / 1e12:.2f} TB)" if n >= 1e12 else "")


def _disk_lines(d: dict) -> list[str]:
    shards, stream = d["shards"], d["stream"]
    done = (
        ""
        if shards["peak_shards"] == shards["stored"]
        else f" ({size(shards['stored'])} when all are packed)"
    )
    captured = (
        ", generation having captured every sample's" if d["capture_during_generation"] else ""
    )
    return [
        f"   dataset: {d['train_tokens']:,} training tokens, {d['heldout_tokens']:,} held-out "
        f"({_shards(d['num_eval_shards'])} of up to {d['heldout_shard_tokens']:,} tokens, "
        f"extract.num_eval_shards); capture request files of "
        f"{d['request_bytes_per_token']:,} bytes a token",
        f"   extraction's host memory (backend vllm) {size(d['packing_host_bytes']):>10}: the "
        f"largest shard's states ({d['largest_shard_tokens']:,} tokens), held until it is "
        f"written; more shards make it smaller (extract.num_shards, extract.num_eval_shards)",
        f"   train.data shards {size(shards['peak']):>24} at the peak: "
        f"{size(shards['peak_shards'])} of shards{done} and {size(shards['peak_requests'])} of "
        f"request files not packed yet ({d['unpacked_tokens']:,} tokens: the two largest "
        f"shards', the one being packed and the next, extract.num_shards {d['num_shards']}"
        f"{captured})",
        f"   train.data stream {size(stream['peak']):>24} at the peak, "
        f"{stream['peak'] / shards['peak']:.1%} of shards mode: {size(stream['stored'])} of "
        f"held-out shards and {size(stream['peak_requests'])} of request files: the held-out "
        f"shards' before they are packed, or a window of {d['window_tokens']:,} training tokens "
        + (
            f"({d['window_samples']} samples ahead of the trainer, train.stream_ahead or "
            f"--stream-window, of up to {d['window_tokens'] // d['window_samples']:,} tokens)"
            if d["window_samples"]
            else f"(ahead of the trainer: extract.concurrency {d['concurrency']} samples at their "
            f"longest beside a micro-batch's, at least twice the concurrency"
            + (
                f"; shared by {d['train_ranks']} training ranks, each beside its own micro-batch"
                if d.get("train_ranks", 1) > 1
                else ""
            )
            + ")"
        )
        + ", plus train.stream_cache_gib if set"
        + _heldout_hint(d),
    ]


def _shards(n: int) -> str:
    return "one shard" if n == 1 else f"{n} shards"


# held-out tokens past which the split, not the training data, is what it costs: the
# held-out simulated AL is a mean of per-position agreements, whose standard error over n
# positions is at most 0.5 / sqrt(n): 0.0016 at 10^5 tokens, within the 0.01 its figures show
HELDOUT_ENOUGH = 100_000


def _heldout_hint(d: dict) -> str:
    """Where the held-out split is most of stream mode's disk and larger than its figures
    need: how to bound it."""
    stream = d["stream"]
    if d["heldout_tokens"] <= 10 * HELDOUT_ENOUGH or 2 * stream["stored"] < stream["peak"]:
        return ""
    return (
        f". The held-out split is most of it: its simulated AL is good to 0.01 from about "
        f"{HELDOUT_ENOUGH:,} tokens, so data.max_eval_prompts (or a smaller "
        f"data.eval_fraction) can bound it {d['heldout_tokens'] // HELDOUT_ENOUGH:,} times "
        f"smaller"
    )


def _colocation_lines(c: dict, dtype: str) -> list[str]:
    server, ranks = c["server"], c["ranks"]
    experts = (
        f"routed experts {c.get('expert_format') or 'INT%d' % c['expert_bits']}, the rest {dtype}"
        if c["expert_bits"]
        else dtype
    )
    kv = (
        "KV cache as configured (train.stream_kv_cache_gib, else server.kv_cache_gib)"
        if c["kv_tokens"] is None
        else f"KV cache and captured states of {c['kv_tokens']:,} tokens (extract.concurrency "
        f"longest samples, at least the context length), {c['kv_bytes_per_token']:,} bytes "
        f"a token"
    )
    lines = [
        f"capture server and trainer on the same {ranks} GPUs (train.data: stream; the "
        f"server tensor parallel over them, a training rank on each), one GPU:",
        f"   server  {gib(server['weights']):>11}  target weights: "
        f"{gib(server['weights_all_ranks'])} ({server['weights_all_ranks'] / 1e9:.1f} GB; "
        f"{experts}), {gib(server['replicated_weights'])} of it whole on every rank, the "
        f"rest split {ranks} ways",
        f"   server  {gib(server['kv_cache']):>11}  {kv}",
        f"   server  {gib(server['allowance']):>11}  allowed for: a prefill chunk's "
        f"activations, CUDA graphs, NCCL buffers",
        f"   trainer {gib(c['trainer']):>11}  training, one rank (above)",
        f"   trainer {gib(c['teacher_check']):>11}  teacher check of the streamed states: "
        f"the target's full lm_head and {TEACHER_CHUNK} rows' logits",
    ]
    verdicts = [
        f"{'fits' if d['fits'] else 'does NOT fit'} one {name} ({gib(d['usable'])} "
        f"usable of {gib(d['device_bytes'])})"
        for name, d in c["devices"].items()
    ]
    lines.append(f"   total   {gib(c['total']):>11}  {'; '.join(verdicts)}")
    lines.append(
        f"   size the streaming job's KV cache (train.stream_kv_cache_gib: "
        f"{server['kv_cache'] / GiB:.1f}; generation keeps server.*): "
        f"memory_utilization takes a share of each GPU for the server alone"
    )
    setting = str(c.get("overlap", "auto")).lower()
    lines.append(
        "   the two hold this memory at once and "
        + (
            f"compute at once (train.stream_overlap {setting})"
            if setting == "true"
            else f"take turns computing (train.stream_overlap {setting}): the server "
            "a window's states while the ranks wait, then the ranks train on them"
        )
    )
    return lines


def _run_target(cfg: dict, results: Path) -> tuple[dict, Path] | None:
    """The run's target: its config.json and directory, once prepare_target has run for the
    config's target.model (a results directory of another target's run is not it)."""
    target_json = results / TARGET_JSON
    if not target_json.exists():
        return None
    info = read_json(target_json)
    if info.get("spec") not in (None, str(cfg["target"]["model"])):
        return None
    directory = Path(info["path"])
    config_path = directory / "config.json"
    if not config_path.exists():
        return None
    return json.loads(config_path.read_text()), directory


def _target_files(cfg: dict) -> tuple[dict, Path] | None:
    """The target's config.json and directory before any stage ran: a local directory as it
    is, a hub id's config and tokenizer files alone (kilobytes, no weights, as `eaglet
    rehearse` fetches them); None for the embedded target, which prepare_target makes."""
    spec = str(cfg["target"]["model"])
    if spec.startswith("embedded:"):
        return None
    directory = local_dir(spec) or Path(snapshot(spec, weights=False))
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ValueError(
            f"{directory} has no config.json: it is not a Hugging Face model directory"
        )
    return json.loads(config_path.read_text()), directory


def _served_bytes(directory: Path, dtype: str) -> int | None:
    """The target's weights as the server loads them, from its safetensors headers (quantized
    weights as they are packed); None without weight files."""
    found = target_size(directory, dtype)
    return found.served if found is not None and "safetensors" in found.source else None


def _shard_tokens(results: Path) -> int | None:
    metas = sorted((results / HIDDEN).glob(f"{SHARD_GLOB}.json"))
    tokens = []
    for meta in metas:
        try:
            tokens.append(int(json.loads(meta.read_text())["tokens"]))
        except (OSError, ValueError, KeyError):
            continue
    return max(tokens) if tokens else None


def _generated_tokens(results: Path) -> tuple[int, int] | None:
    """(training, held-out) tokens of the run's generated samples (synthetic/stats.json),
    before extract.max_len cuts them; None before generation."""
    try:
        splits = json.loads((results / SYNTHETIC_STATS).read_text())["splits"]
        return tuple(
            splits[name]["prompt_tokens"] + splits[name]["completion_tokens"]
            for name in ("train", "eval")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_parser():
    """`eaglet plan`'s arguments (the top-level `eaglet --help` lists them from here)."""
    import argparse

    parser = argparse.ArgumentParser(prog="eaglet plan", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None, help="results directory (default: the config's)")
    parser.add_argument(
        "--configfile",
        dest="config",
        default=None,
        help="the run's config file, over the schema's defaults (not "
        "config.yaml), as Snakemake and `eaglet rehearse` take it",
    )
    parser.add_argument("--workflow", default=".", help="workflow directory (its config.yaml)")
    parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        default=[],
        help="plan for a named target shape instead of the run's target (repeatable)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="training tokens of the dataset: the disk each train.data mode "
        "needs for them (default: the run's generated samples, if any)",
    )
    parser.add_argument(
        "--max-tokens-per-batch",
        type=int,
        action="append",
        default=[],
        help="rows of one training micro-batch (train.max_tokens_per_batch), "
        "and the longest sample; repeatable (default: the config's; for "
        "presets 2048 and 8192)",
    )
    parser.add_argument(
        "--drafter-attention",
        choices=("llama", "mla"),
        default=None,
        help="the drafter's attention (default: the config's train.drafter_attention)",
    )
    parser.add_argument(
        "--drafter-variant",
        choices=sorted(methods.VARIANTS),
        default=None,
        help="the drafter's norms (default: the config's train.drafter_variant)",
    )
    parser.add_argument(
        "--method",
        choices=list(methods.METHODS),
        default=None,
        help="eagle3, peagle or dflash (default: the config's train.method)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs the capture server and the trainer share (default: the "
        "config's server.gpus, else 8)",
    )
    parser.add_argument(
        "--stream-window",
        type=int,
        default=None,
        help="samples the stream feed holds ahead of the trainer (default: "
        "train.stream_ahead, else extract.concurrency beside a "
        "micro-batch's, at least twice extract.concurrency)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=None,
        help="tokens in one shard (default: the largest shard written so far, else 1,000,000)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    results_hint = Path(args.results) if args.results else None
    try:
        if args.preset and not args.config:  # a GPU run at the schema's defaults
            cfg = validate({"target": {"dtype": "bfloat16"}})
        else:
            cfg = load_run_config(results_hint or Path("results"), args.config, Path(args.workflow))
    except ConfigError as error:
        print(f"eaglet plan: {error}", file=sys.stderr)
        return 2
    results = results_hint or Path(cfg["results_dir"])
    start = None
    if cfg["train"].get("init_from"):  # a fine-tune: the starting drafter decides the drafter
        try:
            for note in published.apply(cfg, str(results / START_DRAFTER)):
                print(f"eaglet plan: {note}", file=sys.stderr)
            start = published.read(cfg["train"]["init_from"])
        except published.DrafterFormatError as error:
            print(f"eaglet plan: {error}", file=sys.stderr)
            return 2
    ext, train, server = cfg["extract"], cfg["train"], cfg["server"]
    shard_tokens = args.shard_tokens or _shard_tokens(results) or 1_000_000
    precision = train["precision"] if train["precision"] != "auto" else "bfloat16"
    attention_kind = args.drafter_attention or train["drafter_attention"]
    variant = args.drafter_variant or train["drafter_variant"]
    method = args.method or train["method"]
    served = None
    try:
        if args.preset:
            shapes = [
                with_drafter(PRESETS[name], attention_kind, variant, method, train["dflash_layers"])
                for name in args.preset
            ]
            batches = args.max_tokens_per_batch or [2048, 8192]
        else:
            target = _run_target(cfg, results) or _target_files(cfg)
            if target is None:
                configfile = f" --configfile {args.config}" if args.config else ""
                print(
                    f"eaglet plan: the target of {results} is not prepared yet (no "
                    f"{results}/target/target.json with its config.json); run `snakemake"
                    f"{configfile} {results}/target/target.json` first, or plan for a "
                    f"named shape: --preset {' --preset '.join(sorted(PRESETS))}",
                    file=sys.stderr,
                )
                return 2
            refused = refusal(
                ask_in_subprocess(target[1] / "config.json"),
                methods.words(method),
                str(cfg["target"]["model"]),
            )
            if refused:
                print(f"eaglet plan: {refused}", file=sys.stderr)
                return 2
            shapes = [
                shape_from_target_config(
                    target[0],
                    cfg["vocab"]["draft_vocab_size"],
                    cfg["target"]["model"],
                    attention_kind,
                    variant,
                    method,
                    train["dflash_layers"],
                )
            ]
            served = _served_bytes(target[1], cfg["target"]["dtype"])
            batches = args.max_tokens_per_batch or [train["max_tokens_per_batch"]]
    except (ValueError, TargetError) as error:
        print(f"eaglet plan: {error}", file=sys.stderr)
        return 2
    if args.tokens is not None:
        f = cfg["data"]["eval_fraction"]
        dataset = (args.tokens, round(args.tokens * f / (1 - f)))
    else:
        dataset = None if args.preset else _generated_tokens(results)
    gpus = args.gpus or (server["gpus"] if server["gpus"] > 1 else 8)
    window = args.stream_window or train["stream_ahead"]  # None: the feed's default
    # the streaming job's server: its own size, else the server section's
    kv_gib = train.get("stream_kv_cache_gib") or server.get("kv_cache_gib")
    plans, texts = [], []
    for shape in shapes:
        for t in batches:
            named = bool(args.max_tokens_per_batch or args.preset)  # t is also the longest sample
            longest = t if named else ext["max_len"]
            p = plan(
                shape,
                tokens=t,
                max_len=t if named else (train["max_len"] or t),
                steps=train["ttt_steps"],
                batch_tokens=ext["batch_tokens"],
                extract_max_len=longest,
                target_dtype=cfg["target"]["dtype"],
                store_dtype=ext["dtype"],
                shard_tokens=shard_tokens,
                precision=precision,
                attention=train["attention"],
                fused_loss=train["fused_loss"],
                train_tokens=dataset[0] if dataset else None,
                heldout_tokens=dataset[1] if dataset else 0,
                num_shards=ext["num_shards"],
                num_eval_shards=eval_shard_count(cfg),
                capture_during_generation=cfg["generate"]["capture_hidden_states"],
                window_samples=window,
                concurrency=ext["concurrency"],
                ranks=gpus,
                # stream's ranks: the trainer's own GPUs, else one beside each server GPU
                train_ranks=train["gpus"] or gpus,
                # vLLM starts only with room for one sequence of its context length
                kv_tokens=max(
                    ext["concurrency"] * longest, longest + 1, cfg["target"]["max_model_len"]
                ),
                kv_cache_bytes=None if kv_gib is None else int(kv_gib * GiB),
                served_bytes=served,
                overlap=train.get("stream_overlap", "auto"),
            )
            plans.append(p)
            texts.append(render(p, ext["dtype"]))
    if start is not None:
        size = published.size(start)
        for p in plans:
            p["start_drafter"] = {"from": cfg["train"]["init_from"], "format": start.format, **size}
        params = f"{size['parameters']:,} parameters, " if size["parameters"] else ""
        texts.append(
            f"Fine-tune of a published drafter: {cfg['train']['init_from']} ({start.format}; "
            f"{params}{human_size(size['bytes'])} of weights, read once, from the Hugging Face "
            f"cache where it is a hub id). It decides the method, the draft vocabulary and "
            f"the aux layers (applied above); fine-tunes need fewer epochs than training "
            f"from scratch (train.epochs {train['epochs']})."
        )
    if args.json:
        print(json.dumps(plans, indent=2))
    else:
        print("\n\n".join(texts))
        print(
            "\nEstimates from shapes: tensors the code keeps at its peak; add about 0.5 GiB "
            "of CUDA context. Training's worst case: one sample fills the batch."
        )
        if dataset is None:
            print(
                "The disk of a dataset in each train.data mode (shards, stream): --tokens N "
                "for N training tokens."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
