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
  every step). The TTT attention (``drafter.ttt_attention``) materializes float32 scores
  [heads, n, n] per step for an attention block of n rows, kept for backward (and a bf16
  copy under autocast); the worst case, reported here, is one sample filling the batch
  (n = min(max_len, max_tokens_per_batch)). A fused kernel (``train.attention`` sdpa or
  flex, what ``auto`` selects) keeps per step and row only its inputs (q, k, v padded with
  the sink column, ``drafter.sdpa_ttt_attention``), its output, a float32 log-sum-exp per
  head and the float32 [heads, head_dim] terms that fold the later steps' own keys in. The
  total is of the path ``train.attention`` selects; the other one is printed beside it.
* disk: ``shards.bytes_per_token`` per stored token.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eaglet import shards
from eaglet.shards import bytes_per_token

GiB = 2 ** 30
# one H200 ("141 GB"): 143,771 MiB as nvidia-smi reports it; 5% is kept for the CUDA
# context, NCCL buffers and allocator fragmentation
GPU_NAME = "one 141 GB GPU"
GPU_BYTES = 143_771 * 2 ** 20
GPU_USABLE = 0.95
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "auto": 2}
NUM_AUX = 3
TEACHER_CHUNK = 1024  # rows of extraction's teacher check at a time (extract.teacher_from_stored)


@dataclass
class Shape:
    """A target and the drafter trained for it."""
    name: str
    hidden: int                 # the target's hidden size (= the drafter's, as from_target reads it)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int                  # the target's vocabulary
    draft_vocab: int
    tied_embeddings: bool = False
    # the drafter layer, when it differs from the target's (None: the target's)
    drafter_heads: int | None = None
    drafter_kv_heads: int | None = None
    drafter_intermediate: int | None = None
    # the target's parameter count when the dense-Llama formula does not hold (MoE, MLA)
    target_params: int | None = None
    assumptions: list[str] = field(default_factory=list)

    @property
    def d_heads(self) -> int:
        return self.drafter_heads or self.heads

    @property
    def d_kv_heads(self) -> int:
        return self.drafter_kv_heads or self.kv_heads

    @property
    def d_intermediate(self) -> int:
        return self.drafter_intermediate or self.intermediate


PRESETS = {
    "llama-3.1-8b": Shape(
        "Llama-3.1-8B", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
        intermediate=14336, vocab=128256, draft_vocab=32000),
    "kimi-k2.5": Shape(
        "Kimi-K2.5", hidden=7168, layers=61, heads=64, kv_heads=64, head_dim=112,
        intermediate=18432, vocab=163840, draft_vocab=32000,
        target_params=1_000_000_000_000,
        assumptions=[
            "drafter layer: 64 heads and 64 KV heads (no GQA) of head_dim 112 = 7168/64, "
            "intermediate 18432 (the target's dense MLP width)",
            "target: about 1.0e12 parameters (MoE with MLA, 61 layers) at 2 bytes each; its "
            "quantized experts would need less, but the hf backend loads them in target.dtype",
            "extraction activations as for a dense layer of intermediate 18432 (one MoE layer's "
            "routed experts per token are narrower)"]),
}


# -- parameter counts ------------------------------------------------------------------------

def target_params(s: Shape) -> int:
    """A dense Llama: embedding, layers (attention, SwiGLU MLP, two norms), final norm, lm_head."""
    if s.target_params is not None:
        return s.target_params
    layer = (s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
             + 3 * s.hidden * s.intermediate + 2 * s.hidden)
    heads = 1 if s.tied_embeddings else 2
    return heads * s.vocab * s.hidden + s.layers * layer + s.hidden


def drafter_params(s: Shape) -> int:
    """Trainable parameters of ``drafter.Eagle3Drafter``: fc [3Ht -> H], q/k/v from 2H, o_proj,
    the MLP, four RMSNorms (input, hidden, post-attention, final) and lm_head [H -> Vd]."""
    h, d = s.hidden, s.head_dim
    return (NUM_AUX * h * h
            + 2 * h * (s.d_heads + 2 * s.d_kv_heads) * d
            + s.d_heads * d * h
            + 3 * h * s.d_intermediate
            + 4 * h
            + h * s.draft_vocab)


# -- extraction ------------------------------------------------------------------------------

def extraction(s: Shape, batch_tokens: int, max_len: int, target_dtype: str, store_dtype: str,
               shard_tokens: int) -> dict:
    """Bytes on the device and on the host of one ``hf`` extraction job."""
    a = DTYPE_BYTES[target_dtype]
    t = max(batch_tokens, max_len)  # a sequence longer than the budget is a batch of its own
    seq = max_len
    layer_peak = t * (2 * s.hidden * a             # residual stream and the layer's input
                      + 4 * s.hidden               # RMSNorm's float32 copy
                      + 3 * s.intermediate * a)    # gate, up, their product
    captured = t * (NUM_AUX + 1) * s.hidden * a * 2  # aux + final, and their unpadded copies
    # the previous batch's packed states, kept until their copy to the host is done
    in_flight = t * (NUM_AUX + 1) * s.hidden * a
    mask = (t // seq) * seq * seq                     # the [B, 1, L, L] bool attention mask
    teacher = TEACHER_CHUNK * s.vocab * (a + 4 + 4)   # logits, float32, log_softmax
    device = {"target weights": target_params(s) * a,
              "activations of one batch": layer_peak + captured + mask,
              "packed states of the batch being copied to the host": in_flight,
              "teacher check": teacher}
    # the writer streams the aux states from their per-sample rows (eaglet.shards.write); the
    # final states are concatenated, and rounded to the storage dtype in float32 for the check
    host = {"aux states of the shard (per sample)": shard_tokens * NUM_AUX * s.hidden * a,
            "final states (per sample, concatenated, float32 for the teacher check)":
                shard_tokens * s.hidden * (2 * a + 4),
            "write buffer (row blocks)": shards.CHUNK_BYTES * 2,
            "pinned staging buffers of the copies (2 batches)": 2 * in_flight}
    return {"device": device, "host": host}


# -- training --------------------------------------------------------------------------------

SINK_PAD = 8  # columns the fused path adds to the head dim on CUDA (the sink's; 1 on CPU)
FUSED = ("sdpa", "flex")


def resolve_attention(name: str) -> str:
    """``train.attention`` on a GPU, as ``drafter.resolve_attention`` resolves it."""
    return "sdpa" if name == "auto" else name


def ttt_attention_bytes(s: Shape, rows: int, block: int, steps: int, act: int,
                        fused: bool = False, pad: int = SINK_PAD) -> int:
    """What the attention of all TTT steps keeps for backward, beyond the projections."""
    heads, kv, d = s.d_heads, s.d_kv_heads, s.head_dim
    if fused:
        # step 0: the kernel's q, k, v (contiguous copies) and output in act, its float32
        # log-sum-exp per head
        first = 2 * heads * d * act + 2 * kv * d * act + 4 * heads
        # later steps: q, k, v and output with the sink column, the log-sum-exp, float32
        # per-head terms (the sink's weight, the denominator, the own keys' weights) and
        # float32 [heads, d] sums of the own keys' values, the numerator and its input
        later = (2 * heads * (d + pad) * act + 2 * kv * (d + pad) * act + 4 * heads
                 + 3 * 4 * heads + 3 * 4 * heads * d)
        return rows * (first + (steps - 1) * later)
    blocks = rows // block
    square = heads * block * block
    per_step = blocks * square * (4 + (act if act != 4 else 0))  # exp'd scores (+ bf16 copy)
    per_step += blocks * block * block                          # the block's bool mask (shared)
    per_step += rows * heads * s.head_dim * 4                   # float32 output before the cast
    return steps * per_step


def ttt_rows_bytes(s: Shape, rows: int, steps: int, act: int) -> int:
    """Per TTT step and row: what the norms, projections, MLP and logits keep for backward."""
    h, d, i = s.hidden, s.head_dim, s.d_intermediate
    f = 4
    cast = act != 4  # under autocast the float32 copies are extra tensors
    norms = h * (act                         # input_layernorm: normalized embedding
                 + (f if cast else 0) + act  # hidden_norm: float32 input, normalized
                 + 2 * act                   # cat([e, h]) for q/k/v
                 + (f if cast else 0) + 2 * act  # post_attention_layernorm and its output
                 + f + 2 * act)              # final norm: float32 input, normalized, output
    attn = (3 * s.d_heads + 4 * s.d_kv_heads) * d * act + s.d_heads * d * act  # rope, o_proj in
    mlp = 4 * i * act
    logits = 2 * f * s.draft_vocab           # float32 logits and the teacher's rows of them
    return steps * rows * (norms + attn + mlp + logits)


def training(s: Shape, tokens: int, max_len: int | None, steps: int, precision: str = "bfloat16",
             embed_dtype: str = "bfloat16", attention: str = "auto",
             sink_pad: int = SINK_PAD) -> dict:
    """Bytes on one training rank's device at the peak (the end of the forward pass), with
    the TTT attention of ``attention`` (``train.attention``)."""
    attention = resolve_attention(attention)
    act = 2 if precision == "bfloat16" else 4
    block = min(max_len or tokens, tokens)
    p = drafter_params(s)
    e = DTYPE_BYTES[embed_dtype]
    fixed = {"drafter weights (float32)": 4 * p,
             "gradients (float32)": 4 * p,
             "AdamW states (2 x float32)": 8 * p,
             "frozen target embedding": s.vocab * s.hidden * e,
             "teacher lm_head rows": s.draft_vocab * s.hidden * e}
    if act == 2:
        fixed["bf16 autocast weight copies"] = 2 * p
    inputs = tokens * (NUM_AUX + 1) * s.hidden * act + tokens * s.draft_vocab * 4  # + teacher probs
    rows = ttt_rows_bytes(s, tokens, steps, act)
    scores = ttt_attention_bytes(s, tokens, block, steps, act)
    fused = ttt_attention_bytes(s, tokens, block, steps, act, fused=True, pad=sink_pad)
    # backward of the last step's attention: float32 gradient of its scores (and a bf16 one)
    square = (tokens // block) * s.d_heads * block * block
    backward = square * (4 + (act if act != 4 else 0))
    out = dict(fixed)
    out["batch inputs and teacher probabilities"] = inputs
    out[f"TTT activations, {steps} steps (norms, projections, MLP, logits)"] = rows
    if attention in FUSED:
        out[f"TTT attention, {attention} (kernel inputs and outputs, log-sum-exp; no "
            f"[heads, n, n] scores)"] = fused
    else:
        out[f"TTT attention scores [heads, n, n] float32, n = {block}"] = scores
        out["backward of one step's scores"] = backward
    return {"device": out, "attention": attention, "fused_attention": fused,
            "unfused_attention": scores + backward}


def fits(device_bytes: int) -> bool:
    return device_bytes <= GPU_USABLE * GPU_BYTES


# -- the plan for a run or a preset ----------------------------------------------------------

def plan(s: Shape, *, tokens: int, max_len: int | None, steps: int, batch_tokens: int,
         extract_max_len: int, target_dtype: str, store_dtype: str, shard_tokens: int,
         precision: str = "bfloat16", attention: str = "auto") -> dict:
    ext = extraction(s, batch_tokens, extract_max_len, target_dtype, store_dtype, shard_tokens)
    tr = training(s, tokens, max_len, steps, precision,
                  embed_dtype=target_dtype if target_dtype != "auto" else "bfloat16",
                  attention=attention)
    train_total = sum(tr["device"].values())
    fused = tr["attention"] in FUSED
    rest = train_total - (tr["fused_attention"] if fused else tr["unfused_attention"])
    return {
        "shape": asdict(s), "tokens_per_batch": tokens, "ttt_steps": steps,
        "attention": tr["attention"],
        "target_dtype": target_dtype, "precision": precision, "extract_batch_tokens": batch_tokens,
        "extract_max_len": extract_max_len,
        "target_params": target_params(s), "drafter_params": drafter_params(s),
        "extraction": ext, "extraction_device": sum(ext["device"].values()),
        "extraction_host": sum(ext["host"].values()),
        "training": tr["device"], "training_device": train_total,
        "training_device_fused_attention": rest + tr["fused_attention"],
        "training_device_eager_attention": rest + tr["unfused_attention"],
        "shard_bytes_per_token": bytes_per_token(s.hidden, NUM_AUX, store_dtype),
        "shard_tokens": shard_tokens,
        "shard_bytes": shard_tokens * bytes_per_token(s.hidden, NUM_AUX, store_dtype),
    }


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _fit_line(n: int) -> str:
    verdict = "fits" if fits(n) else "does NOT fit"
    return (f"{verdict} {GPU_NAME} ({gib(n)} of {gib(GPU_USABLE * GPU_BYTES)} usable, "
            f"{GPU_USABLE:.0%} of {gib(GPU_BYTES)})")


def render(p: dict, store_dtype: str) -> str:
    s = p["shape"]
    lines = [f"== {s['name']}: hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, "
             f"draft vocab {s['draft_vocab']}; {p['tokens_per_batch']} tokens per batch, "
             f"{p['ttt_steps']} TTT steps",
             f"   settings: target in {p['target_dtype']}, shards in {store_dtype}, extraction "
             f"batches of {p['extract_batch_tokens']} padded tokens, samples up to "
             f"{p['extract_max_len']} tokens, training in {p['precision']}",
             f"   target {p['target_params'] / 1e9:.2f}B parameters, drafter "
             f"{p['drafter_params'] / 1e6:.1f}M trainable"]
    for note in s["assumptions"]:
        lines.append(f"   assumed: {note}")
    lines.append("extraction (hf backend, one job)")
    for name, n in p["extraction"]["device"].items():
        lines.append(f"   device  {gib(n):>11}  {name}")
    lines.append(f"   device  {gib(p['extraction_device']):>11}  total: {_fit_line(p['extraction_device'])}")
    for name, n in p["extraction"]["host"].items():
        lines.append(f"   host    {gib(n):>11}  {name}")
    lines.append(f"   host    {gib(p['extraction_host']):>11}  total, for a shard of "
                 f"{p['shard_tokens']:,} tokens")
    lines.append(f"training (one rank, train.attention {p['attention']})")
    for name, n in p["training"].items():
        lines.append(f"   device  {gib(n):>11}  {name}")
    lines.append(f"   device  {gib(p['training_device']):>11}  total: {_fit_line(p['training_device'])}")
    if p["attention"] in FUSED:
        other = p["training_device_eager_attention"]
        lines.append(f"   device  {gib(other):>11}  with eager attention instead ([heads, n, n] "
                     f"float32 scores kept): {_fit_line(other)}")
    else:
        other = p["training_device_fused_attention"]
        lines.append(f"   device  {gib(other):>11}  with fused attention instead (sdpa/flex: no "
                     f"[heads, n, n] scores kept): {_fit_line(other)}")
    lines.append(f"disk: {p['shard_bytes_per_token']:,} bytes per token ({store_dtype}), "
                 f"{gib(p['shard_bytes'])} per {p['shard_tokens']:,}-token shard")
    return "\n".join(lines)


def shape_from_target_config(config: dict, draft_vocab: int, name: str) -> Shape:
    """A target's shape from its ``config.json`` (as ``DrafterConfig.from_target``); a
    mixture of experts counts its experts in ``target_params``."""
    c = config.get("text_config", config)
    heads = c["num_attention_heads"]
    shape = Shape(name, hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                  kv_heads=c.get("num_key_value_heads") or heads,
                  head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                  intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                  draft_vocab=draft_vocab,
                  tied_embeddings=bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))))
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    if experts:
        width = c.get("moe_intermediate_size") or c["intermediate_size"]
        layers = c["num_hidden_layers"] - (c.get("first_k_dense_replace") or 0)
        # without a width of their own, one expert is the MLP the dense count holds already
        extra = (experts + (c.get("n_shared_experts") or 0)
                 - (0 if c.get("moe_intermediate_size") else 1))
        shape.target_params = target_params(shape) + layers * extra * 3 * c["hidden_size"] * width
        shape.assumptions.append(f"target: {experts} experts of width {width} in {layers} "
                                 f"layers counted; attention as a dense layer's")
    return shape


def _run_shape(cfg: dict, results: Path) -> Shape | None:
    from eaglet.io import read_json
    target_json = results / "target" / "target.json"
    if not target_json.exists():
        return None
    config_path = Path(read_json(target_json)["path"]) / "config.json"
    if not config_path.exists():
        return None
    return shape_from_target_config(json.loads(config_path.read_text()),
                                    cfg["vocab"]["draft_vocab_size"], cfg["target"]["model"])


def _shard_tokens(results: Path) -> int | None:
    metas = sorted((results / "hidden").glob("shard_*.json"))
    tokens = []
    for meta in metas:
        try:
            tokens.append(int(json.loads(meta.read_text())["tokens"]))
        except (OSError, ValueError, KeyError):
            continue
    return max(tokens) if tokens else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    from eaglet.config import load_run_config
    parser = argparse.ArgumentParser(prog="eaglet plan", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None, help="results directory (default: the config's)")
    parser.add_argument("--config", default=None,
                        help="the run's config file, over the schema's defaults (not config.yaml)")
    parser.add_argument("--workflow", default=".", help="workflow directory (its config.yaml)")
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), default=[],
                        help="plan for a named target shape instead of the run's target "
                             "(repeatable)")
    parser.add_argument("--tokens", type=int, action="append", default=[],
                        help="tokens per training batch (and longest sample); repeatable "
                             "(default: the config's; for presets 2048 and 8192)")
    parser.add_argument("--shard-tokens", type=int, default=None,
                        help="tokens in one shard (default: the largest shard written so far, "
                             "else 1,000,000)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)

    results_hint = Path(args.results) if args.results else None
    if args.preset and not args.config:  # a GPU run at the schema's defaults
        from eaglet.config import validate
        cfg = validate({"target": {"dtype": "bfloat16"}})
    else:
        cfg = load_run_config(results_hint or Path("results"), args.config, Path(args.workflow))
    results = results_hint or Path(cfg["results_dir"])
    ext, train = cfg["extract"], cfg["train"]
    shard_tokens = args.shard_tokens or _shard_tokens(results) or 1_000_000
    precision = train["precision"] if train["precision"] != "auto" else "bfloat16"
    if args.preset:
        shapes = [PRESETS[name] for name in args.preset]
        tokens = args.tokens or [2048, 8192]
    else:
        shape = _run_shape(cfg, results)
        if shape is None:
            print(f"eaglet plan: the target of {results} is not prepared yet (no "
                  f"{results}/target/target.json with its config.json); run `snakemake "
                  f"{results}/target/target.json` first, or plan for a named shape: "
                  f"--preset {' --preset '.join(sorted(PRESETS))}", file=sys.stderr)
            return 2
        shapes = [shape]
        tokens = args.tokens or [train["max_tokens_per_batch"]]
    plans, texts = [], []
    for shape in shapes:
        for t in tokens:
            named = bool(args.tokens or args.preset)  # t is also the longest sample
            p = plan(shape, tokens=t, max_len=t if named else (train["max_len"] or t),
                     steps=train["ttt_steps"], batch_tokens=ext["batch_tokens"],
                     extract_max_len=t if named else ext["max_len"],
                     target_dtype=cfg["target"]["dtype"], store_dtype=ext["dtype"],
                     shard_tokens=shard_tokens, precision=precision,
                     attention=train["attention"])
            plans.append(p)
            texts.append(render(p, ext["dtype"]))
    if args.json:
        print(json.dumps(plans, indent=2))
    else:
        print("\n\n".join(texts))
        print("\nEstimates from shapes: tensors the code keeps at its peak; add about 0.5 GiB "
              "of CUDA context. Training's worst case: one sample fills the batch.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
