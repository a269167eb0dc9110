"""Drafter training throughput (tokens/s, MFU) on random features, and lm_head init comparison.

Throughput: one packed batch of random features through the full training step (TTT forward
over all steps, teacher, loss, backward, grad clip, AdamW), timed after warm-up. The model
FLOPs count every matmul of forward and backward (3x forward) plus the teacher's head; MFU is
against --peak-flops (default: the measured 800 TFLOP/s bf16 matmul of an H200). Run:

    .venv/bin/python benchmarks/train.py                      # embedded target's shape, CPU
    .venv/bin/python benchmarks/train.py --shape llama3-8b    # on a GPU: bf16 autocast
    .venv/bin/python benchmarks/train.py --attention eager,sdpa  # kernels side by side
    .venv/bin/python benchmarks/train.py --loss plain,fused      # the fused loss beside autograd's

Several attention kernels (``train.attention``) take turns step by step on the same model
in one process, so that a machine shared with other work slows them alike and their ratio
holds. Memory: the bytes autograd keeps for backward in one step (counted once per
storage; what the GPU must hold, and independent of the machine's load), and the process's
peak RSS when one kernel runs alone.

Results are merged into benchmarks/results/train.json and rendered as train.md.

lm_head init: trains twice on real shards, lm_head_init target vs random, everything else
equal, and tabulates the held-out curves side by side (benchmarks/results/lm_head_init.md):

    .venv/bin/python benchmarks/train.py --compare-lm-head-init --shards 'results/hidden/shard_*' \\
        --eval-shards 'results/hidden/eval/shard_*' --vocab-map results/vocab/vocab_map.safetensors \\
        --target-dir results/target [--train '{"epochs": 4}']
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import json
import platform
import resource
import time
from pathlib import Path

import torch

from eaglet.core.io import read_json, write_json
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter, count_flops_per_token, num_params
from eaglet.stages.train.data import make_batch
from eaglet.stages.train.loop import train
from eaglet.stages.train.step import batch_sums

OUT = Path(__file__).parent / "results"

SHAPES = {
    # the embedded default target, SmolLM2-135M-Instruct
    "smollm2-135m": {
        "target": {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        },
        "draft_vocab": 8192,
    },
    "llama3-8b": {
        "target": {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rms_norm_eps": 1e-5,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_theta": 500000.0,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        "draft_vocab": 32000,
    },
}


def random_batch(config: DrafterConfig, tokens: int, sample_len: int, ttt_steps: int, t2d):
    """Whole samples of random features, every position scored (all completion tokens, the
    target's argmax always in the draft vocabulary)."""
    pieces = []
    for s in range(tokens // sample_len):
        ids = torch.randint(0, config.vocab_size, (sample_len,))
        argmax = torch.randint(
            0, config.draft_vocab_size, (sample_len,)
        )  # d2t = 0: draft = target id
        pieces.append(
            (
                f"r{s}",
                ids,
                torch.ones(sample_len, dtype=torch.uint8),
                argmax,
                torch.randn(sample_len, config.fc_input_size),
                torch.randn(sample_len, config.hidden_size),
            )
        )
    return make_batch(pieces, ttt_steps, t2d)


def throughput(args) -> list[dict]:
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    shape = SHAPES[args.shape]
    config = DrafterConfig.from_target(shape["target"], shape["draft_vocab"], [2, 16, 29])
    torch.manual_seed(0)
    t2d = torch.arange(config.vocab_size) < config.draft_vocab_size
    embed = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    kernels = [
        (kernel, loss) for kernel in args.attention.split(",") for loss in args.loss.split(",")
    ]
    model = Eagle3Drafter(
        config, embed, torch.zeros(config.draft_vocab_size, dtype=torch.long), t2d
    ).to(device)
    teacher_head = (torch.randn(config.draft_vocab_size, config.hidden_size) * 0.02).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    batch = random_batch(
        config, args.tokens, args.sample_len or args.tokens, args.ttt_steps, t2d
    ).to(device)
    weights = 0.8 ** torch.arange(args.ttt_steps, dtype=torch.float32, device=device)
    counts = batch.counts().to(device).float()
    bf16 = device.type == "cuda" and not args.fp32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = {k: [] for k in kernels}
    saved = {k: {} for k in kernels}

    def keeper(kernel):
        def keep(tensor):  # bytes autograd keeps for backward, once per storage
            storage = tensor.untyped_storage()
            saved[kernel][storage.data_ptr()] = storage.nbytes()
            return tensor

        return keep

    for step in range(args.warmup + args.steps):
        for kernel in kernels:  # the variants take turns: the same load on each
            model.attention = kernel[0]
            sync()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            counting = (
                torch.autograd.graph.saved_tensors_hooks(keeper(kernel), lambda t: t)
                if step == 0
                else contextlib.nullcontext()
            )
            with autocast, counting:
                ce, _ = batch_sums(model, batch, teacher_head, fused=kernel[1] == "fused")
                loss = (weights * ce / counts).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            sync()
            if step >= args.warmup:
                times[kernel].append(time.perf_counter() - start)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return [
        result(
            args,
            device,
            config,
            model,
            batch,
            bf16,
            kernel,
            times[kernel],
            sum(n for ptr, n in saved[kernel].items() if ptr not in own),
            len(kernels),
        )
        for kernel in kernels
    ]


def result(args, device, config, model, batch, bf16, variant, times, saved, kernels) -> dict:
    kernel, loss = variant
    seconds = sorted(times)[len(times) // 2]
    tokens_per_s = batch.num_tokens / seconds
    sample_len = args.sample_len or args.tokens
    flops = count_flops_per_token(config, args.ttt_steps, context=(sample_len + 1) / 2)
    result = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "precision": "bf16 autocast" if bf16 else "fp32",
        "tokens": batch.num_tokens,
        "sample_len": sample_len,
        "ttt_steps": args.ttt_steps,
        "trainable_params_m": round(num_params(model) / 1e6, 1),
        "step_s": round(seconds, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "model_tflops_per_s": round(flops * tokens_per_s / 1e12, 3),
        "mfu": round(flops * tokens_per_s / args.peak_flops, 4) if device.type == "cuda" else None,
        "peak_flops": args.peak_flops,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda" and kernels == 1
        else None,  # one kernel alone: its own peak
        "attention": kernel,
        "loss": loss,
        "saved_for_backward_mib": round(saved / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        if kernels == 1
        else None,
        "interleaved_with": [
            f"{k}/{lo}"
            for k in args.attention.split(",")
            for lo in args.loss.split(",")
            if (k, lo) != variant
        ],
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%d"),
    }
    return result


def write_results(result: dict) -> None:
    path = OUT / "train.json"
    runs = read_json(path) if path.exists() else {}
    # rows measured before train.attention existed ran the eager kernel alone
    turns = result.get("interleaved_with")
    runs[
        f"{result['shape']} | {result['device']} | {result['precision']} | "
        f"{result['tokens']}/{result['sample_len']}"
        + (f" | {result['attention']}" if result.get("attention", "eager") != "eager" else "")
        + (f" | {result['loss']} loss" if result.get("loss", "plain") != "plain" else "")
        + (f" | turns with {','.join(turns)}" if turns else "")
    ] = result
    write_json(path, runs)
    lines = [
        "# Drafter training throughput (random features, full training step)",
        "",
        "Peak memory: the GPU's allocator peak, or on CPU the process's peak RSS (with "
        "PyTorch itself); saved: the bytes autograd keeps for backward in one step. "
        "Kernels that took turns step by step ran in one process on a machine shared "
        "with other work: compare such rows with each other (a ratio), not with the "
        "others.",
        "",
        "| shape | device | precision | tokens | sample length | TTT steps | attention | "
        "params (M) | step (s) | tokens/s | model TFLOP/s | MFU (vs peak) | peak memory | "
        "saved for backward |",
        "|" + "---|" * 14,
    ]
    for r in runs.values():
        mfu = f"{r['mfu']:.1%} of {r['peak_flops'] / 1e12:.0f}T" if r["mfu"] is not None else "-"
        peak = (
            f"{r['peak_memory_gib']} GiB"
            if r.get("peak_memory_gib") is not None
            else f"{r['peak_rss_mib']:.0f} MiB RSS"
            if r.get("peak_rss_mib")
            else "-"
        )
        saved = f"{r['saved_for_backward_mib']:.0f} MiB" if r.get("saved_for_backward_mib") else "-"
        lines.append(
            f"| {r['shape']} | {r['device']} | {r['precision']} | {r['tokens']} | "
            f"{r['sample_len']} | {r['ttt_steps']} | {r.get('attention', 'eager')}"
            f"{', ' + r['loss'] + ' loss' if r.get('loss', 'plain') != 'plain' else ''}"
            f"{' (turns with ' + ', '.join(r['interleaved_with']) + ')' if r.get('interleaved_with') else ''} | "
            f"{r['trainable_params_m']} | {r['step_s']} | {r['tokens_per_s']} | "
            f"{r['model_tflops_per_s']} | {mfu} | {peak} | {saved} |"
        )
    (OUT / "train.md").write_text("\n".join(lines) + "\n")


def compare_lm_head_init(args) -> None:
    """Train with lm_head_init target and random, the rest equal; tabulate held-out curves."""
    shards = sorted(glob.glob(args.shards))
    eval_shards = sorted(glob.glob(args.eval_shards)) if args.eval_shards else []
    if not shards:
        raise SystemExit(f"no shards match {args.shards}")
    cfg = json.loads(args.train)
    root = Path(args.out)
    curves = {}
    for init in ("target", "random"):
        run_dir = root / f"lm_head_{init}"
        metrics = train(
            {**cfg, "lm_head_init": init},
            shards,
            eval_shards,
            args.vocab_map,
            args.target_dir,
            str(run_dir / "drafter"),
            str(run_dir / "checkpoints"),
            None,
            None,
        )
        with open(run_dir / "drafter" / "training_log.csv") as handle:
            rows = list(csv.DictReader(handle))
        split = "eval" if eval_shards else "train"
        curves[init] = {int(r["step"]): r for r in rows if r["split"] == split}
        print(f"lm_head_init {init}: {metrics}")
    steps = sorted(set(curves["target"]) & set(curves["random"]))
    lines = [
        f"# lm_head init: target vs random ({'held-out' if eval_shards else 'training'} rows)",
        "",
        f"train settings: `{json.dumps(cfg)}`; shards: {len(shards)}",
        "",
        "| step | loss target | loss random | acc_0 target | acc_0 random | "
        "sim_al target | sim_al random |",
        "|" + "---|" * 7,
    ]
    for s in steps:
        t, r = curves["target"][s], curves["random"][s]
        lines.append(
            f"| {s} | {float(t['loss']):.4f} | {float(r['loss']):.4f} | "
            f"{float(t['acc_0']):.3f} | {float(r['acc_0']):.3f} | "
            f"{float(t['sim_al']):.3f} | {float(r['sim_al']):.3f} |"
        )
    (OUT / "lm_head_init.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the packed batch")
    parser.add_argument(
        "--sample-len",
        type=int,
        default=None,
        help="length of each packed sample (default: one sample of --tokens)",
    )
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    parser.add_argument(
        "--attention",
        default="sdpa",
        help="TTT attention kernel (train.attention), or several separated by "
        "commas, taking turns step by step",
    )
    parser.add_argument(
        "--loss",
        default="plain",
        help="comma-separated, of plain (autograd's) and fused (train.fused_loss):"
        " variants take turns step by step like the attention kernels",
    )
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=800e12,
        help="FLOP/s that MFU is measured against (H200 bf16 matmul, measured)",
    )
    parser.add_argument("--compare-lm-head-init", action="store_true")
    parser.add_argument("--shards", help="glob of training shards (--compare-lm-head-init)")
    parser.add_argument("--eval-shards", help="glob of held-out shards")
    parser.add_argument("--vocab-map")
    parser.add_argument("--target-dir")
    parser.add_argument("--train", default="{}", help="train settings as JSON")
    parser.add_argument("--out", default=str(OUT / "lm_head_init"), help="run directories")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.compare_lm_head_init:
        compare_lm_head_init(args)
        return
    results = throughput(args)
    for result in results:
        write_results(result)
    print(json.dumps(results, indent=2))
    base = results[0]
    for r in results[1:]:
        print(
            f"{r['attention']}/{r['loss']} vs {base['attention']}/{base['loss']}: "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, saved for backward "
            f"{r['saved_for_backward_mib']:.0f} vs {base['saved_for_backward_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
