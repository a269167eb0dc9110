"""Side by side with the peer trainer: vLLM's ``speculators`` against eaglet on the same data.

On the shards of a finished eaglet run (same synthetic data, same target, same draft
vocabulary, aux layers and TTT steps, same tokens per step, same CPU), this benchmark

1. converts eaglet's samples into speculators' own data format through its documented
   entry point: ``speculators prepare-data`` on pre-tokenized ``input_ids``/``loss_mask``
   rows, then one ``hidden_states/hs_{i}.safetensors`` per prepared row (``hidden_states``
   [n, aux+1, H], the last slot the target's final pre-norm state, and ``token_ids``),
   the file layout its ``file`` hidden-states backend reads; eaglet's vocabulary map goes in
   as ``d2t-<Vd>.npy``/``t2d-<Vd>.npy``;
2. runs ``speculators train`` (its CLI) on CPU and records how it fails, once per
   configuration tried (``--draft-attn-impl``, ``--num-workers`` ...);
3. trains speculators' EAGLE-3 model with its own library pieces (its config resolution,
   model builder, data loader, loss, optimizer and scheduler), stepping them in a plain CPU
   loop that does what its ``Trainer.train_epoch`` does per step (forward under its train
   kwargs, backward, clip 1.0, optimizer and scheduler step), because that trainer moves the
   model and every batch to accelerator index 0;
4. trains eaglet (``eaglet.stages.train.loop.train``) with the run's own train settings;
5. scores both on the run's held-out shards with one definition (eaglet's: per TTT step,
   top-1 agreement with the target's argmax at the positions eaglet counts; simulated AL =
   1 + sum_k prod_{j<=k} acc_j), and serves both in vLLM (``eaglet.stages.evaluate.stage.engine_runs``):
   acceptance length and speedup over the target alone at each concurrency.

Install speculators beside eaglet, never into its environment (``make peer-bench-install``)::

    python -m pip install --no-deps --target benchmarks/.peer speculators==0.9.0 hs-connectors==0.9.0

Run (after a workflow run has written hidden/, vocab/ and target/)::

    .venv/bin/python benchmarks/peer_speculators.py --results results

Writes ``benchmarks/results/peer_speculators.{json,md}``; the work directories (converted
data, checkpoints, server logs) go under ``benchmarks/results/peer/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from eaglet.core.config import validate
from eaglet.core.io import read_json, write_json
from eaglet.data import shards as shard_format
from eaglet.data.vocab import load_vocab_map
from eaglet.stages.train.data import make_batch
from eaglet.target.checkpoint import load_target_final_norm

HERE = Path(__file__).parent
PEER = HERE / ".peer"
OUT = HERE / "results"
PEER_VERSION = "0.9.0"
INSTALL = (
    f"python -m pip install --no-deps --target benchmarks/.peer "
    f"speculators=={PEER_VERSION} hs-connectors=={PEER_VERSION}"
)


def peer_env() -> dict:
    """Environment for speculators subprocesses: eaglet's path plus the benchmark-only install."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PEER.resolve())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


def import_peer():
    if str(PEER.resolve()) not in sys.path:
        sys.path.insert(0, str(PEER.resolve()))
    try:
        import speculators
    except ImportError as exc:
        raise SystemExit(
            f"speculators is not installed for this benchmark ({exc}); run: {INSTALL}"
        ) from None
    return speculators


# -- data: eaglet shards -> speculators' format -----------------------------------------------


def eaglet_samples(shard_paths: list[str], max_len: int):
    """(sample id, input_ids, loss_mask, shard path, local index) of every sample, cut to
    ``max_len`` tokens as eaglet's trainer cuts them."""
    for path in shard_paths:
        shard = shard_format.load(path)
        for i, sample_id in enumerate(shard.sample_ids):
            rows = shard.sample(i)
            rows = slice(rows.start, min(rows.stop, rows.start + max_len))
            yield sample_id, shard.input_ids[rows], shard.loss_mask[rows], path, i


def speculators_rows(samples) -> list[dict]:
    """Pre-tokenized rows in the format ``speculators prepare-data`` passes through."""
    return [
        {"id": sid, "input_ids": ids.tolist(), "loss_mask": mask.to(torch.int64).tolist()}
        for sid, ids, mask, *_ in samples
    ]


def final_norm_weight(target_dir: str) -> torch.Tensor:
    return load_target_final_norm(target_dir).float()


def prenorm_surrogate(final_hidden: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """eaglet stores the target's final-norm output ``w * x / rms(x)``; speculators wants the
    pre-norm state and applies the norm itself. ``final / w`` has rms 1, so the target's
    RMSNorm maps it back to the stored output exactly (up to eps): the same teacher."""
    return final_hidden.float() / norm_weight


def write_hidden_states(
    data_dir: Path, shard_paths: list[str], target_dir: str, max_len: int
) -> int:
    """One ``hidden_states/hs_{i}.safetensors`` per row of the prepared dataset, found by its
    token ids among eaglet's samples (prepare-data shuffles the rows)."""
    from datasets import load_from_disk
    from safetensors.torch import save_file

    dataset = load_from_disk(str(data_dir))
    where = {}
    for _, ids, _, path, index in eaglet_samples(shard_paths, max_len):
        where[tuple(ids.tolist())] = (path, index)
    norm = final_norm_weight(target_dir)
    out = data_dir / "hidden_states"
    out.mkdir(exist_ok=True)
    loaded: dict[str, shard_format.Shard] = {}
    for row in range(len(dataset)):
        ids = dataset[row]["input_ids"]
        path, index = where[tuple(torch.as_tensor(ids).tolist())]
        shard = loaded.get(path) or loaded.setdefault(path, shard_format.load(path))
        if len(loaded) > 2:
            loaded.pop(next(iter(loaded)))
        rows = shard.sample(index)
        rows = slice(rows.start, rows.start + len(ids))
        aux = shard.aux_hidden[rows].reshape(len(ids), -1, norm.numel())
        last = prenorm_surrogate(shard.final_hidden[rows], norm).unsqueeze(1)
        save_file(
            {
                "hidden_states": torch.cat([aux, last], 1).contiguous(),
                "token_ids": shard.input_ids[rows].contiguous(),
            },
            str(out / f"hs_{row}.safetensors"),
        )
    return len(dataset)


def write_vocab(data_dir: Path, vocab_map: str) -> int:
    import numpy as np

    d2t, t2d = load_vocab_map(vocab_map)
    np.save(data_dir / f"d2t-{d2t.numel()}.npy", d2t.numpy())
    np.save(data_dir / f"t2d-{d2t.numel()}.npy", t2d.numpy())
    return d2t.numel()


def compare_vocab(data_dir: Path, vocab_map: str, target_vocab: int) -> dict:
    """speculators' own draft vocabulary (from the token frequencies prepare-data counted)
    against eaglet's: how many draft ids they share, and each one's coverage of the
    completion tokens."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = load_vocab_map(vocab_map)
    freq = torch.load(data_dir / "token_freq.pt", weights_only=True)
    s_d2t, s_t2d = build_vocab_mappings_from_distribution(freq, d2t.numel(), target_vocab)
    total = sum(freq.values())
    covered = lambda mask: sum(c for t, c in freq.items() if bool(mask[t])) / total  # noqa: E731
    return {
        "draft_vocab": d2t.numel(),
        "shared_ids": int((t2d & s_t2d.bool()).sum()),
        "eaglet_coverage": covered(t2d),
        "speculators_coverage": covered(s_t2d.bool()),
    }


def prepare(results: Path, work: Path, cfg: dict, log) -> dict:
    """Convert the run's training shards into a speculators data directory (once)."""
    data_dir = work / "data"
    shards = sorted(glob.glob(str(results / "hidden" / "shard_*.safetensors")))
    max_len = cfg["train"]["max_len"] or cfg["train"]["max_tokens_per_batch"]
    done = data_dir / "eaglet_conversion.json"
    if done.exists():
        return read_json(done)
    work.mkdir(parents=True, exist_ok=True)
    rows_path = work / "rows.jsonl"
    rows = speculators_rows(eaglet_samples(shards, max_len))
    with open(rows_path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    command = [
        sys.executable,
        "-m",
        "speculators",
        "prepare-data",
        "--model",
        str(results / "target"),
        "--data",
        str(rows_path),
        "--output",
        str(data_dir),
        "--seq-length",
        str(max_len),
        "--num-preprocessing-workers",
        "1",
        "--no-skip-token-freq",
        "--overwrite",
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, env=peer_env(), capture_output=True, text=True)
    prepare_s = time.perf_counter() - start
    log(f"prepare-data exit {proc.returncode} in {prepare_s:.1f} s")
    if proc.returncode:
        raise SystemExit(f"speculators prepare-data failed:\n{proc.stderr[-3000:]}")
    start = time.perf_counter()
    n = write_hidden_states(data_dir, shards, str(results / "target"), max_len)
    hidden_s = time.perf_counter() - start
    vocab = write_vocab(data_dir, str(results / "vocab" / "vocab_map.safetensors"))
    info = {
        "samples": len(rows),
        "rows": n,
        "tokens": sum(len(r["input_ids"]) for r in rows),
        "draft_vocab": vocab,
        "prepare_data_s": prepare_s,
        "hidden_states_s": hidden_s,
        "prepare_data_command": " ".join(command[1:]),
    }
    write_json(done, info)
    return info


# -- speculators: its CLI, then its library pieces in a CPU loop --------------------------------


def train_argv(
    results: Path, work: Path, cfg: dict, info: dict, aux: list[int], extra: list[str]
) -> list[str]:
    """``speculators train`` flags for the same drafter shape and data as eaglet's run."""
    t = cfg["train"]
    n = info["rows"]
    return [
        "--verifier-name-or-path",
        str(results / "target"),
        "--data-path",
        str(work / "data"),
        "--save-path",
        str(work / "checkpoints"),
        "--speculator-type",
        "eagle3",
        "--num-layers",
        "1",
        "--full-attention-indices",
        "0",
        "--draft-vocab-size",
        str(info["draft_vocab"]),
        "--target-layer-ids",
        *[str(a) for a in aux],
        "--ttt-steps",
        str(t["ttt_steps"]),
        "--total-seq-len",
        str(t["max_tokens_per_batch"]),
        "--epochs",
        str(t["epochs"]),
        "--lr",
        str(t["lr"]),
        # every prepared row trains but one (speculators needs a non-empty val split);
        # held-out scoring uses the run's own held-out shards
        "--train-data-ratio",
        str((n - 0.5) / n),
        "--seed",
        str(t["seed"]),
        "--logger",
        "",
        *extra,
    ]


# ``speculators train`` as documented, then with every CPU-relevant setting it offers: flex
# attention has no CPU backward, its fused loss is a Triton GPU kernel, bf16 is emulated on
# these CPUs, and 12 spawned loader workers only compete for 2 cores
CPU_SETTINGS = [
    "--draft-attn-impl",
    "sdpa",
    "--loss-implementation",
    "eager",
    "--hidden-states-dtype",
    "float32",
    "--num-workers",
    "0",
]
CLI_TRIES = [
    ("defaults", []),
    (" ".join(CPU_SETTINGS), CPU_SETTINGS),
]


def try_cli(argv: list[str], timeout_s: int) -> dict:
    """Run ``speculators train`` for up to ``timeout_s``: its exit and the error it ends with."""
    command = [sys.executable, "-m", "speculators", "train", *argv]
    start = time.perf_counter()
    try:
        # plain Python tracebacks, not typer's boxed ones, so the raising frame can be read
        proc = subprocess.run(
            command,
            env={**peer_env(), "_TYPER_STANDARD_TRACEBACK": "1"},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"exit": "timeout", "seconds": timeout_s, "error": "still running (trained)"}
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    error = next(
        (line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1:] or [""]
    )
    # the last frame inside speculators, its path from the package on
    trace = [
        line.strip()
        for line in lines
        if line.strip().startswith('File "') and "/speculators/" in line
    ]
    where = None
    if trace:
        where = "speculators/" + trace[-1].split("/speculators/", 1)[1].replace('"', "")
    return {
        "exit": proc.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "error": error if isinstance(error, str) else error[0],
        "raised_at": where,
    }


def train_speculators(argv: list[str], budget_s: float | None, eval_fn, log) -> dict:
    """speculators' model, data loader, loss, optimizer and scheduler, stepped on CPU."""
    import speculators.train.cli as spec_cli
    from hs_connectors import HiddenStatesBackend
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.distributed import maybe_setup_distributed
    from speculators.train.trainer import Trainer, TrainerConfig

    cfg = TrainConfig.resolve(argv)
    args = argparse.Namespace(**cfg.flatten())
    spec_cli.set_seed(args.seed)
    maybe_setup_distributed()
    d2t, t2d, vd = spec_cli.parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry["eagle3"]
    model = spec_cli.build_draft_model(args, model_class, t2d, d2t, vd)
    dtype = getattr(torch, args.hidden_states_dtype)
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(
        args, args.data_path
    )
    train_loader, _ = create_train_val_loaders(
        data_path=args.data_path,
        total_seq_len=args.total_seq_len,
        hidden_states_dtype=dtype,
        transfer=transfer,
        vllm_endpoint=args.vllm_endpoint,
        on_missing="raise",
        verifier_name_or_path=args.verifier_name_or_path,
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=model.config.transformer_layer_config.hidden_size,
        num_target_layers=len(model.target_layer_ids),
        num_workers=args.num_workers,
        prefetch_factor=args.prefetch_factor,
        preprocess=shift_batch,
        train_data_ratio=args.train_data_ratio,
        seed=args.seed,
    )
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    tcfg = TrainerConfig(
        num_epochs=args.epochs,
        save_path=args.save_path,
        lr=args.lr,
        resume_from_checkpoint=False,
        train_call_kwargs=train_kwargs,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
        hidden_states_dtype=dtype,
        max_steps=args.max_steps,
    )
    # its optimizers and schedulers, built by its own Trainer.setup_optimizer
    trainer = Trainer.__new__(Trainer)
    trainer.model, trainer.config, trainer.train_loader = model, tcfg, train_loader
    trainer.resume_from_checkpoint = False
    trainer.setup_optimizer()
    # bf16 autocast where asked (its trainer autocasts to hidden_states_dtype); CPU autocast
    # takes no float32, which is the same as none
    autocast = (
        torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    )
    model.train()
    curve, tokens, step_times, train_s, stopped = [], 0, [], 0.0, False
    for epoch in range(args.epochs):
        if hasattr(train_loader.batch_sampler, "set_epoch"):
            train_loader.batch_sampler.set_epoch(epoch)
        start = time.perf_counter()
        for batch in train_loader:
            t0 = time.perf_counter()
            batch = {
                k: v
                for k, v in batch.items()
                if k not in ("error_records",) and not k.startswith("_")
            }
            with autocast:
                _, loss, _ = model(**batch, **train_kwargs)
            trainer._optimizers_zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            trainer._optimizers_step()
            trainer._schedulers_step()
            n = int((batch["document_ids"] != -1).sum())
            tokens += n
            step_times.append((n, time.perf_counter() - t0))
            if budget_s is not None and train_s + time.perf_counter() - start > budget_s:
                stopped = True
                break
        train_s += time.perf_counter() - start
        model.eval()
        e0 = time.perf_counter()
        held_out = eval_fn(model)
        eval_s = time.perf_counter() - e0
        train_s += eval_s  # eaglet's wall time includes its per-epoch held-out pass too
        model.train()
        curve.append({"epoch": epoch + 1, "minutes": train_s / 60, **held_out})
        log(f"speculators epoch {epoch + 1}: {train_s:.0f} s, held-out {held_out}")
        if stopped:
            break
    return {
        "model": model,
        "curve": curve,
        "tokens": tokens,
        "wall_s": train_s,
        "stopped_by_budget": stopped,
        "step_times": step_times,
        "settings": {
            k: getattr(args, k)
            for k in (
                "optimizer",
                "lr",
                "scheduler_type",
                "loss_fn",
                "ttt_step_loss_decay",
                "norm_before_residual",
                "norm_before_fc",
                "norm_output",
                "draft_attn_impl",
                "loss_implementation",
                "hidden_states_dtype",
                "num_workers",
                "total_seq_len",
                "epochs",
            )
        },
    }


# -- one held-out score for both ---------------------------------------------------------------


@torch.no_grad()
def speculators_held_out(
    model,
    eval_shards: list[str],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    ttt_steps: int,
    max_len: int,
) -> dict:
    """eaglet's held-out statistic for a speculators model: per TTT step, the share of the
    positions eaglet scores (``make_batch(...).rows``) where the draft's top-1, mapped to
    target ids, equals the target's argmax. speculators' row t (after its shift) embeds
    token t+1 and its step k predicts token t+2+k, as eaglet's row t does."""
    agree = torch.zeros(ttt_steps, dtype=torch.float64)
    counts = torch.zeros(ttt_steps, dtype=torch.float64)
    dtype = next(model.parameters()).dtype
    for path in eval_shards:
        shard = shard_format.load(path)
        for i, sid in enumerate(shard.sample_ids):
            rows = shard.sample(i)
            rows = slice(rows.start, min(rows.stop, rows.start + max_len))
            piece = (
                sid,
                shard.input_ids[rows],
                shard.loss_mask[rows],
                shard.teacher_argmax[rows],
                shard.aux_hidden[rows],
                shard.final_hidden[rows],
            )
            batch = make_batch([piece], ttt_steps, t2d)
            n = piece[1].numel()
            if n < 3:
                continue
            drafts = model(
                hidden_states=piece[4][:-1].unsqueeze(0).to(dtype),
                input_ids=piece[1][1:].unsqueeze(0),
                document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                position_ids=torch.arange(1, n).unsqueeze(0),
                ttt_steps=ttt_steps,
            )
            for k, (tokens, scored) in enumerate(zip(drafts, batch.rows)):
                draft = tokens[0, scored]
                target_ids = draft + d2t[draft]
                agree[k] += (target_ids == piece[3][scored + 1 + k]).sum()
                counts[k] += scored.numel()
    acc = (agree / counts.clamp(min=1)).tolist()
    sim_al = 1.0
    running = 1.0
    for a in acc:
        running *= a
        sim_al += running
    return {"acc": [round(a, 4) for a in acc], "sim_al": round(sim_al, 4)}


# -- eaglet ------------------------------------------------------------------------------------


def train_eaglet(results: Path, work: Path, cfg: dict, log) -> dict:
    import csv

    from eaglet.stages.train.loop import train

    shards = sorted(glob.glob(str(results / "hidden" / "shard_*.safetensors")))
    eval_shards = sorted(glob.glob(str(results / "hidden" / "eval" / "shard_*.safetensors")))
    t = {k: v for k, v in cfg["train"].items() if k != "gpus"}
    t["resume"] = False
    start = time.perf_counter()
    metrics = train(
        t,
        shards,
        eval_shards,
        str(results / "vocab" / "vocab_map.safetensors"),
        str(results / "target"),
        str(work / "eaglet" / "drafter"),
        str(work / "eaglet" / "checkpoints"),
        None,
        None,
    )
    wall = time.perf_counter() - start
    with open(work / "eaglet" / "drafter" / "training_log.csv") as handle:
        rows = list(csv.DictReader(handle))
    lengths = [
        min(n, t.get("max_len") or t["max_tokens_per_batch"]) for p in shards for n in _lengths(p)
    ]
    tokens = sum(lengths) * t["epochs"]
    rates = sorted(
        float(r["tokens_per_s"]) for r in rows if r["split"] == "train" and r["tokens_per_s"]
    )
    steps_per_epoch = max(1, metrics["steps"] // t["epochs"])
    curve = [
        {
            "epoch": round(int(r["step"]) / steps_per_epoch, 2),
            "acc": [round(float(r[f"acc_{k}"]), 4) for k in range(t["ttt_steps"])],
            "sim_al": round(float(r["sim_al"]), 4),
        }
        for r in rows
        if r["split"] == "eval"
    ]
    log(f"eaglet: {metrics['steps']} steps in {wall:.0f} s, held-out {curve[-1]}")
    return {
        "wall_s": wall,
        "tokens": tokens,
        "median_window_tokens_per_s": rates[len(rates) // 2],
        "curve": curve,
        "drafter": str(work / "eaglet" / "drafter"),
        "settings": {
            k: t[k]
            for k in (
                "lr",
                "epochs",
                "ttt_steps",
                "ttt_decay",
                "max_tokens_per_batch",
                "lm_head_init",
                "layer_init",
                "grad_clip",
                "warmup_steps",
            )
        },
    }


def _lengths(path: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        offsets = handle.get_tensor("offsets")
    return (offsets[1:] - offsets[:-1]).tolist()


# -- vLLM ----------------------------------------------------------------------------------------


def serve_both(
    results: Path, work: Path, cfg: dict, drafters: dict[str, str], k: int, ev_overrides: dict, log
) -> list[dict]:
    """The target alone, then each drafter at k, through eaglet's evaluation (one server at a
    time), on the held-out split and the run's configured prompt sets."""
    from eaglet.stages.evaluate.runs import load_prompt_sets
    from eaglet.stages.evaluate.stage import engine_runs
    from eaglet.stages.evaluate.statistics import add_speedups

    run_cfg = {
        **cfg,
        "evaluate": {**cfg["evaluate"], **ev_overrides},
        "server": {**cfg["server"], "memory_utilization": 0.15},
    }
    ev = run_cfg["evaluate"]
    sets, _ = load_prompt_sets(
        ev, str(results / "prompts" / "eval.jsonl"), str(results / "prompts" / "train.jsonl")
    )
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan = [{"name": "baseline", "method": "baseline"}] + [
        {"name": name, "method": "eagle3", "k": k, "drafter": path}
        for name, path in drafters.items()
    ]
    runs = []
    for run in plan:
        log(f"vLLM: {run['name']}")
        runs += engine_runs(run_cfg, str(results / "target"), [run], sets, str(logs))
    add_speedups(runs, ev["concurrency"])
    return runs


def level_summary(run: dict, concurrency: int) -> dict:
    """AL over every prompt set at a concurrency, and the pooled speedup there."""
    levels = [lv for lv in run["levels"] if lv["concurrency"] == concurrency]
    drafts = sum(lv["drafts"] or 0 for lv in levels)
    accepted = sum(lv["accepted_tokens"] or 0 for lv in levels)
    speed = next(e["speedup"] for e in run["by_concurrency"] if e["concurrency"] == concurrency)
    tps = next(
        e["output_tokens_per_s"] for e in run["by_concurrency"] if e["concurrency"] == concurrency
    )
    return {"al": 1 + accepted / drafts if drafts else None, "speedup": speed, "tokens_per_s": tps}


# -- the table ---------------------------------------------------------------------------------


def render(r: dict) -> str:
    e, s = r["eaglet"], r["speculators"]

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    rows = [
        (
            "training tokens/s (wall, incl. per-epoch held-out pass)",
            e["tokens_per_s"],
            s["tokens_per_s"],
        ),
        ("training tokens/s (steady steps)", e["step_tokens_per_s"], s["step_tokens_per_s"]),
        ("training minutes", e["train_min"], s["train_min"]),
        ("epochs trained", e["epochs"], s["epochs"]),
        ("held-out sim AL (final)", e["sim_al"], s["sim_al"]),
        (
            "held-out sim AL gain per training minute ((AL-1)/min)",
            e["gain_per_min"],
            s["gain_per_min"],
        ),
    ]
    for c in r["concurrency"]:
        rows += [
            (f"vLLM AL at concurrency {c}", e["vllm"][str(c)]["al"], s["vllm"][str(c)]["al"]),
            (
                f"vLLM speedup at concurrency {c}",
                e["vllm"][str(c)]["speedup"],
                s["vllm"][str(c)]["speedup"],
            ),
        ]
    vs = r.get("vllm_settings", {})
    lines = [
        "# eaglet vs speculators (vLLM's trainer) on the same data",
        "",
        r["about"] + " The budget is checked after each speculators step, and both "
        "trainers' minutes include their per-epoch held-out pass.",
        "",
        f"vLLM: one server at a time (0.15 of memory), k = TTT steps, greedy; AL pooled "
        f"over the held-out split and the configured prompt sets; speedup = output "
        f"tokens/s over the target alone at the same concurrency "
        f"(`{json.dumps(vs)}`).",
        "",
        "On a shared 2-core machine every tokens/s figure carries the other users' load "
        "(the three servers ran minutes apart): compare the two drafters' columns with "
        "each other before comparing a speedup with 1.0.",
        "",
        "| measure | eaglet | speculators | eaglet / speculators |",
        "|---|---|---|---|",
    ]
    for name, a, b in rows:
        fa = f"{a:.3f}" if isinstance(a, float) else str(a)
        fb = f"{b:.3f}" if isinstance(b, float) else str(b)
        lines.append(f"| {name} | {fa} | {fb} | {ratio(a, b)} |")
    lines += [
        "",
        "Held-out curves (sim AL by epoch):",
        "",
        "| epoch | eaglet | speculators minutes | speculators |",
        "|---|---|---|---|",
    ]
    for i in range(max(len(e["curve"]), len(s["curve"]))):
        ec = e["curve"][i] if i < len(e["curve"]) else {}
        sc = s["curve"][i] if i < len(s["curve"]) else {}
        lines.append(
            f"| {i + 1} | {ec.get('sim_al', '-')} | "
            f"{round(sc['minutes'], 2) if sc else '-'} | {sc.get('sim_al', '-')} |"
        )
    v = r["vocab"]
    lines += [
        "",
        f"Draft vocabulary (both trained with eaglet's, {v['draft_vocab']} ids): "
        f"speculators' own mapping from prepare-data's token counts shares "
        f"{v['shared_ids']} ids with eaglet's; completion-token coverage "
        f"{v['eaglet_coverage']:.4f} (eaglet) vs {v['speculators_coverage']:.4f} "
        f"(speculators).",
        "",
        "`speculators train` on CPU:",
        "",
    ]
    for t in r["cli_tries"]:
        lines.append(
            f"- {t['config']}: exit {t['exit']} after {t['seconds']} s: "
            f"`{t['error']}`" + (f" at `{t['raised_at']}`" if t.get("raised_at") else "")
        )
    lines += [
        "",
        "Settings:",
        "",
        f"- eaglet: `{json.dumps(e['settings'])}`",
        f"- speculators: `{json.dumps(s['settings'])}`",
        "",
        "## Verdict",
        "",
    ]
    for name, a, b in (
        ("held-out sim AL gain per training minute", e["gain_per_min"], s["gain_per_min"]),
        ("training tokens/s (wall)", e["tokens_per_s"], s["tokens_per_s"]),
    ):
        if a and b:
            lines.append(
                f"- {name}: eaglet {'ahead' if a >= b else 'behind'}, {a / b:.2f}x speculators'."
            )
    lines += ["", LEARN]
    return "\n".join(lines) + "\n"


LEARN = """## What speculators does that eaglet should learn from

- Its EAGLE-3 recipe differs from eaglet's in four places, all read by vLLM 0.32 from its
  config: an RMSNorm over the concatenated aux states before `fc` (`norm_before_fc`), the
  post-norm state fed back across TTT steps (`norm_output`), the norm before the residual
  (`norm_before_residual`), and a KL-divergence loss with every TTT step weighted equally
  (eaglet: soft cross-entropy, decay 0.8). Its default optimizer is Muon on the 2-D weights.
  Each is a switch eaglet could offer and measure with `benchmarks/recipe.py`.
- Its data preparation takes pre-tokenized `input_ids`/`loss_mask` rows as they are and counts
  token frequencies on the way, and its loader can ask a running vLLM for missing hidden
  states (`on_missing: generate`) instead of needing every shard on disk first.
- On GPUs it avoids materializing [T, T] attention scores (flex attention with block masks)
  and the [T, Vd] softmax (a fused Triton loss). eaglet's blocked manual TTT attention and
  plain softmax are what run on CPU; the GPU path should look at both.
- Where eaglet is ahead: speculators' `Trainer` cannot run without an accelerator (it moves
  the model and each batch to device index 0: `Trainer.setup_model` and `train_epoch`), and
  its defaults (flex attention, which has no CPU backward; the Triton fused loss; bf16
  autocast; 12 spawned loader workers) each need changing on a CPU. No configuration gets
  past the first: the table's speculators column is its model, data loader, loss, optimizer
  and scheduler stepped by this benchmark's loop.
- Not yet explained: both start lm_head from the target's rows of the draft vocabulary, but
  speculators keeps it frozen, and its Muon optimizer ran at the lr both were given (its
  muon_lr defaults to lr), small for Muon. Whether a Muon-sized lr or a trained lm_head
  closes the held-out gap was not measured here.
- Not profiled: on the demo's data (512-token steps) a speculators step took about 40 s on
  this CPU against eaglet's 0.65 s, so the same wall budget bought it a few steps to
  eaglet's hundreds; where its step spends that time (Muon's Newton-Schulz iterations in
  float32, the eager KL loss over the draft vocabulary, its loader) is the next question.
"""


def serve_and_record(
    args,
    results: Path,
    work: Path,
    cfg: dict,
    summary: dict,
    eaglet_dir: str,
    spec_dir: str,
    k: int,
    log,
) -> None:
    overrides = {"concurrency": args.concurrency}
    if args.max_prompts:
        overrides["max_prompts"] = args.max_prompts
    if args.max_tokens:
        overrides["max_tokens"] = args.max_tokens
    if args.set_limit:
        overrides["prompt_sets"] = [
            {**entry, "source": {**entry["source"], "limit": args.set_limit}}
            for entry in cfg["evaluate"]["prompt_sets"]
        ]
    runs = serve_both(
        results,
        work,
        cfg,
        {"eaglet": os.path.relpath(eaglet_dir), "speculators": os.path.relpath(spec_dir)},
        k,
        overrides,
        log,
    )
    summary["vllm_runs"] = [
        {key: v for key, v in run.items() if key != "levels"}
        | {
            "levels": [
                {key: v for key, v in lv.items() if not key.startswith("_")} for lv in run["levels"]
            ]
        }
        for run in runs
    ]
    write_json(OUT / "peer_speculators.json", summary)
    by_name = {run["name"]: run for run in runs}
    for who in ("eaglet", "speculators"):
        summary[who]["vllm"] = {str(c): level_summary(by_name[who], c) for c in args.concurrency}
    summary["vllm_settings"] = overrides
    write_json(OUT / "peer_speculators.json", summary)
    (OUT / "peer_speculators.md").write_text(render(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="a finished run's results dir")
    parser.add_argument("--work", default=str(OUT / "peer"), help="work directory")
    parser.add_argument("--epochs", type=int, help="override train.epochs for both")
    parser.add_argument(
        "--cli-timeout", type=int, default=240, help="seconds each `speculators train` try may run"
    )
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--max-prompts", type=int, help="override evaluate.max_prompts")
    parser.add_argument("--max-tokens", type=int, help="override evaluate.max_tokens")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16])
    parser.add_argument(
        "--set-limit",
        type=int,
        help="prompts read from each configured prompt set (its source limit)",
    )
    parser.add_argument(
        "--cli-only",
        action="store_true",
        help="only retry `speculators train` and update peer_speculators.json",
    )
    parser.add_argument(
        "--vllm-only", action="store_true", help="only serve the drafters already trained in --work"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only redraw peer_speculators.md from peer_speculators.json",
    )
    args = parser.parse_args()
    if args.render:
        (OUT / "peer_speculators.md").write_text(render(read_json(OUT / "peer_speculators.json")))
        return
    results, work = Path(args.results), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    import_peer()
    cfg = validate(read_json(results / "run" / "config.json"))
    if args.epochs:
        cfg["train"]["epochs"] = args.epochs
    cfg["train"]["max_len"] = cfg["train"]["max_len"] or cfg["train"]["max_tokens_per_batch"]
    manifest = read_json(results / "hidden" / "manifest.json")
    aux = (
        manifest.get("aux_layer_ids")
        or shard_format.read_metadata(
            sorted(glob.glob(str(results / "hidden" / "shard_*.safetensors")))[0]
        )["aux_layer_ids"]
    )
    target_vocab = read_json(results / "target" / "config.json")["vocab_size"]

    if args.vllm_only:
        summary = read_json(OUT / "peer_speculators.json")
        serve_and_record(
            args,
            results,
            work,
            cfg,
            summary,
            str(work / "eaglet" / "drafter"),
            str(work / "speculators" / "drafter"),
            cfg["train"]["ttt_steps"],
            log,
        )
        print(render(summary))
        return
    info = prepare(results, work, cfg, log)
    log(f"converted: {info}")
    vocab = compare_vocab(
        work / "data", str(results / "vocab" / "vocab_map.safetensors"), target_vocab
    )

    tries = []
    for label, extra in CLI_TRIES:
        argv = train_argv(
            results, work, cfg, info, aux, extra + ["--save-path", str(work / "cli_checkpoints")]
        )
        outcome = try_cli(argv, args.cli_timeout)
        log(f"speculators train [{label}]: {outcome}")
        tries.append({"config": label, **outcome})
    if args.cli_only:
        summary = read_json(OUT / "peer_speculators.json")
        summary["cli_tries"] = tries
        write_json(OUT / "peer_speculators.json", summary)
        (OUT / "peer_speculators.md").write_text(render(summary))
        return

    eaglet = train_eaglet(results, work, cfg, log)

    d2t, t2d = load_vocab_map(str(results / "vocab" / "vocab_map.safetensors"))
    eval_shards = sorted(glob.glob(str(results / "hidden" / "eval" / "shard_*.safetensors")))
    K, max_len = cfg["train"]["ttt_steps"], cfg["train"]["max_len"]
    argv = train_argv(results, work, cfg, info, aux, CPU_SETTINGS + ["--no-resume-from-checkpoint"])
    spec = train_speculators(
        argv,
        eaglet["wall_s"],
        lambda m: speculators_held_out(m, eval_shards, d2t, t2d, K, max_len),
        log,
    )
    spec_dir = work / "speculators" / "drafter"
    spec["model"].save_pretrained(str(spec_dir))

    times = sorted(n / s for n, s in spec.pop("step_times"))
    s_final, e_final = spec["curve"][-1], eaglet["curve"][-1]
    summary = {
        "about": (
            f"Same data ({info['samples']} training samples, {info['tokens']} tokens; "
            f"held-out: the run's eval shards), target, draft vocabulary "
            f"({info['draft_vocab']}), aux layers {aux}, {K} TTT steps, "
            f"{cfg['train']['max_tokens_per_batch']} tokens per step, one decoder "
            f"layer, float32 on the same {os.cpu_count()}-core CPU (shared). "
            f"speculators gets at most eaglet's training wall time. Results: "
            f"`{results.name}`."
        ),
        "concurrency": args.concurrency,
        "conversion": info,
        "vocab": vocab,
        "cli_tries": tries,
        "eaglet": {
            "tokens_per_s": eaglet["tokens"] / eaglet["wall_s"],
            "step_tokens_per_s": eaglet["median_window_tokens_per_s"],
            "train_min": eaglet["wall_s"] / 60,
            "epochs": cfg["train"]["epochs"],
            "sim_al": e_final["sim_al"],
            "gain_per_min": (e_final["sim_al"] - 1) / (eaglet["wall_s"] / 60),
            "curve": eaglet["curve"],
            "settings": eaglet["settings"],
        },
        "speculators": {
            "tokens_per_s": spec["tokens"] / spec["wall_s"],
            "step_tokens_per_s": times[len(times) // 2],
            "train_min": spec["wall_s"] / 60,
            "epochs": len(spec["curve"]),
            "stopped_by_budget": spec["stopped_by_budget"],
            "sim_al": s_final["sim_al"],
            "gain_per_min": (s_final["sim_al"] - 1) / (spec["wall_s"] / 60),
            "curve": spec["curve"],
            "settings": spec["settings"],
        },
    }
    for who in ("eaglet", "speculators"):
        summary[who]["vllm"] = {str(c): {"al": None, "speedup": None} for c in args.concurrency}
    write_json(OUT / "peer_speculators.json", summary)
    (OUT / "peer_speculators.md").write_text(render(summary))
    if not args.skip_vllm:
        serve_and_record(
            args, results, work, cfg, summary, eaglet["drafter"], str(spec_dir), K, log
        )
    print(render(summary))


if __name__ == "__main__":
    main()
