"""`eaglet plan`: memory per stage, estimated from shapes before a run starts.

The command: it reads the run's config and its target's files (the prepared target, else its
config and tokenizer files alone; the run's shards and generated samples where there are any;
a fine-tune's starting drafter), sizes each stage with :func:`eaglet.tools.memory_plan.plan`
(what is counted, and what is not, is said there), and renders the numbers as text or JSON:
each stage's tensors and totals against a GPU, the dataset's disk in each ``train.data``
mode, and the capture server and a training rank sharing the node's GPUs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eaglet.core import methods
from eaglet.core.config import ConfigError, eval_shard_count, load_run_config, validate
from eaglet.core.gpus import GPU_BYTES, GPU_NAME, GPU_USABLE
from eaglet.core.io import human_size
from eaglet.core.layout import HIDDEN, SHARD_GLOB, START_DRAFTER, SYNTHETIC_STATS, TARGET_JSON
from eaglet.engine.support import (
    ask_in_subprocess,
    mtp_note,
    refusal,
    template_kwargs_refusal,
)
from eaglet.model import published
from eaglet.model.sizes import PRESETS, shape_from_target_config, target_size, with_drafter
from eaglet.target.checkpoint import TEACHER_CHUNK_ROWS as TEACHER_CHUNK
from eaglet.target.checkpoint import TargetError, local_dir, read_target, snapshot
from eaglet.tools.memory_plan import FUSED, GiB, fits, plan


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
    info = read_target(target_json)
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
    served = mtp = None
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
            refused = template_kwargs_refusal(
                target[1], cfg["generate"].get("chat_template_kwargs")
            ) or refusal(
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
            mtp = mtp_note(target[1], cfg["evaluate"].get("mtp", True))
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
    if mtp is not None:
        for p in plans:
            p["mtp_weights"] = {"held": mtp[0], "note": mtp[1]}
        texts.append(f"The target's MTP layers: {mtp[1]}.")
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
