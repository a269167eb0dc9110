"""The memory plan of a run: each stage's memory and the dataset's disk, sized from shapes
before the run starts (the numbers `eaglet plan` prints, :mod:`eaglet.tools.plan`).

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

from dataclasses import asdict

from eaglet.core import methods
from eaglet.core.gpus import GPU_BYTES, GPU_USABLE
from eaglet.data import shard_format
from eaglet.data.shard_format import bytes_per_token
from eaglet.model.config import resolve_attention
from eaglet.model.sizes import CHUNK_ELEMENTS as LOSS_CHUNK_ELEMENTS
from eaglet.model.sizes import (
    DTYPE_BYTES,
    NUM_AUX,
    Shape,
    default_window,
    drafter_extra_params,
    drafter_params,
    serving_weights,
    target_params,
    with_drafter,
)
from eaglet.target.checkpoint import TEACHER_CHUNK_ROWS as TEACHER_CHUNK

GiB = 2**30


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
