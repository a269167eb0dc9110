"""Training checkpoints: ``checkpoint_dir/step_XXXXXXXX/`` holds the weights, the optimizer,
the schedule, the RNG states and the data position, each directory built under a temporary
name and renamed into place whole, so a crash leaves either the old or the new one. A rerun
continues from the newest checkpoint of the same settings and data (its fingerprint) and ends
with the weights an uninterrupted run would have. Checkpoints trained on other inputs (other
shard contents, aux layers or vocabulary map) are never resumed: they are moved aside to
``checkpoint_dir/set_aside/`` with one line saying why.

Beside them, ``checkpoint_dir/best_step_XXXXXXXX/`` holds the weights of the best held-out
evaluation so far (the drafter that ships; ``state.json``: its step, epoch, simulated AL and
the fingerprint of the training that made it). A checkpoint's state names the best it knew, so
a resumed run ships what an uninterrupted one would; a best is kept while a kept checkpoint
names it or while it is newer than the newest checkpoint (then a rerun would compute it again).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from eaglet.core.config import ADDED_LATER
from eaglet.core.io import atomic_open, human_size, read_json, write_json
from eaglet.stages.train.data import ShardInfo, TrainError

log = logging.getLogger("eaglet.stages.train.loop")

# keys that may change between a run and its resumption without changing the result
# (attention: another kernel for the same math)
RESUME_FREE = {
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "device",
    "precision",
    "export_dtype",
    "report_to",
    "host_ram_mb",
    "prefetch_batches",
    "attention",
    "stream_cache_gib",
    "stream_ahead",
    "stream_kv_cache_gib",
    "stream_overlap",
}


BEST = "best_step_"


def checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def bests(directory: Path) -> list[Path]:
    """The kept weights of best held-out evaluations, oldest first."""
    return sorted(
        p for p in directory.glob(BEST + "*") if p.is_dir() and p.name[len(BEST) :].isdigit()
    )


def _step_of(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[1])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fingerprint_differences(was: dict, now: dict) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's; settings added to
    eaglet later count only when set away from the behaviour before them."""
    later = ADDED_LATER["train"]
    what = sorted(
        k
        for k in set(was["train"]) | set(now["train"])
        if was["train"].get(k, later.get(k)) != now["train"].get(k, later.get(k))
    )
    return what + [
        k for k in ("shards", "sample_ids_sha256", "micro_batches_per_step") if was.get(k) != now[k]
    ]


def input_differences(was: dict, now: dict) -> list[str]:
    """Which inputs the weights depend on differ between a checkpoint's fingerprint and this
    run's (a checkpoint written before inputs were recorded differs in all of them: nothing
    says it was trained on these)."""
    before = dict(was.get("inputs") or {})
    if before.get("vocab_map_sha256") == now.get("vocab_map_file_sha256"):
        # an earlier eaglet's checkpoint recorded the map's bytes: the same file is the same map
        before["vocab_map_sha256"] = now["inputs"]["vocab_map_sha256"]
    return [k for k in now["inputs"] if before.get(k) != now["inputs"][k]]


def _shard_identity(info: ShardInfo) -> str:
    """The manifest's sha256 of a shard; without a manifest (benchmarks, tests) its size and
    modification time, which a rewrite changes."""
    if info.sha256:
        return info.sha256
    stat = os.stat(info.path)
    return f"size {stat.st_size} mtime_ns {stat.st_mtime_ns}"


def same_training(was: dict | None, now: dict | None) -> bool:
    """Whether weights of fingerprint ``was`` belong to the training of fingerprint ``now``
    (a Trainer built without one, as benchmarks do, matches only another without one)."""
    if was is None or now is None:
        return was == now
    return not input_differences(was, now) and not fingerprint_differences(was, now)


def fingerprint(cfg: dict, infos: list[ShardInfo], group: int, vocab_map_sha256: str) -> dict:
    """What a checkpoint must share with the run that resumes it: the settings, the data's
    order, and (``inputs``) every input the weights depend on: each shard's contents, the aux
    layers its states are of, and the vocabulary map (``vocab_map_sha256``: the digest of
    its tensors and metadata, :func:`eaglet.data.shard_format.safetensors_digest`, which an
    identical rebuild keeps)."""
    samples = hashlib.sha256(json.dumps([i.sample_ids for i in infos]).encode()).hexdigest()
    return {
        "train": {k: v for k, v in cfg.items() if k not in RESUME_FREE},
        "shards": [Path(i.path).name for i in infos],
        "sample_ids_sha256": samples,
        "micro_batches_per_step": group,
        "inputs": {
            "shards_sha256": [_shard_identity(i) for i in infos],
            "aux_layer_ids": list(infos[0].aux_layer_ids) if infos else [],
            "vocab_map_sha256": vocab_map_sha256,
        },
    }


def save(
    directory: Path, step: int, model: torch.nn.Module, optimizer, scheduler, state: dict, keep: int
) -> None:
    """Write checkpoint ``step`` (``state``: the JSON-able data position, log and
    fingerprint) and keep the newest ``keep``."""
    final = directory / f"step_{step:08d}"
    tmp = directory / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _writing(tmp, f"checkpoint step {step}"):
        _write_weights(tmp / "model.safetensors", model)
        with atomic_open(tmp / "trainer.pt", "wb") as handle:
            torch.save(
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": {
                        "torch": torch.get_rng_state(),
                        "python": random.getstate(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    },
                },
                handle,
            )
        write_json(tmp / "state.json", state)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(directory)
    for old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    _prune_bests(directory)


# below this much free space after a failed write, the disk is what failed it
FULL_DISK_BYTES = 64 * 2**20


@contextmanager
def _writing(tmp: Path, what: str):
    """Write ``what`` into the temporary directory ``tmp``; where the write fails, remove
    what it left and say so, naming a full disk where that is the cause (torch's own words
    for it are "[enforce fail at inline_container.cc] unexpected pos"). The checkpoints
    written before stay: a rerun resumes from the newest."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(tmp.parent).free
        cause = (
            f"the disk is full ({human_size(free)} free on {tmp.parent}): free space, lower "
            f"train.keep_checkpoints, or point results_dir at a larger disk"
            if free < FULL_DISK_BYTES or getattr(error, "errno", None) == errno.ENOSPC
            else f"{type(error).__name__}: {error}"
        )
        raise TrainError(
            f"writing {what} failed: {cause}. The checkpoints written before it are kept; "
            f"a rerun resumes from the newest."
        ) from error


def _write_weights(path: Path, model: torch.nn.Module) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(
            save_safetensors(
                {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
            )
        )


def _prune_bests(directory: Path) -> None:
    """Drop the best weights no kept checkpoint names, except one newer than the newest
    checkpoint (the best since it, which the next checkpoint will name)."""
    kept = checkpoints(directory)
    newest = _step_of(kept[-1]) if kept else -1
    named = {(read_json(p / "state.json").get("best") or {}).get("step") for p in kept}
    for path in bests(directory):
        if _step_of(path) not in named and _step_of(path) <= newest:
            shutil.rmtree(path, ignore_errors=True)


def save_best(
    directory: Path, record: dict, model: torch.nn.Module, fingerprint: dict | None
) -> Path:
    """Keep ``model``'s weights as the best held-out evaluation ``record`` (step, epoch,
    sim_al) names. A best newer than the newest checkpoint is replaced (no checkpoint names
    it; were this write lost, the rerun from that checkpoint would compute it again)."""
    kept = checkpoints(directory)
    newest = _step_of(kept[-1]) if kept else -1
    for old in bests(directory):
        if _step_of(old) > newest:
            shutil.rmtree(old, ignore_errors=True)
    final = directory / f"{BEST}{record['step']:08d}"
    tmp = directory / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _writing(tmp, f"the best held-out weights (step {record['step']})"):
        _write_weights(tmp / "model.safetensors", model)
        write_json(tmp / "state.json", {**record, "fingerprint": fingerprint})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def best_path(directory: Path, record: dict, now: dict | None) -> Path | None:
    """The kept weights of the best held-out evaluation ``record`` names, or None when they
    are gone or are not of this training (other step or AL, other settings or inputs)."""
    path = directory / f"{BEST}{record['step']:08d}"
    try:
        state = read_json(path / "state.json")
    except (OSError, ValueError):
        return None
    if (state.get("step"), state.get("sim_al")) != (record["step"], record["sim_al"]):
        return None
    if not (path / "model.safetensors").is_file():
        return None
    return path if same_training(state.get("fingerprint"), now) else None


def load_best(path: Path) -> dict[str, torch.Tensor]:
    with open(path / "model.safetensors", "rb") as handle:
        return load_safetensors(handle.read())


def to_resume(directory: Path, now: dict, resume: bool, rank: int) -> Path | None:
    """The checkpoint this run continues from, or None to start over (old checkpoints that
    would get in the way are deleted); raise when an unfinished training of other settings
    or data would be lost."""
    found = checkpoints(directory)
    if found and not resume:  # start over: an old step number must not win later
        log.warning(
            "train.resume is false: deleting %d old checkpoints in %s", len(found), directory
        )
        _delete(found + bests(directory), rank)
        return None
    if not found:  # best weights without a checkpoint: of a training that starts over
        _delete(bests(directory), rank)
        return None
    path = found[-1]
    state = read_json(path / "state.json")
    inputs = input_differences(state["fingerprint"], now)
    if inputs:
        _set_aside(found, directory, inputs, rank)
        return None
    what = fingerprint_differences(state["fingerprint"], now)
    if what and state["step"] >= state.get("total_steps", float("inf")):
        # a finished training with other settings: nothing of it to resume (its drafter is
        # what this run replaces), so changed settings simply train again
        log.warning(
            "the checkpoints in %s are of a finished training with other settings "
            "or data (%s differ): deleting them and starting over",
            directory,
            ", ".join(what),
        )
        _delete(found + bests(directory), rank)
        return None
    if what:
        raise TrainError(
            f"the checkpoint {path} of an unfinished training (step "
            f"{state['step']}) belongs to other settings or data "
            f"({', '.join(what)} differ): restore them to resume it, or delete "
            f"{directory} (or set train.resume: false) to start over"
        )
    # best weights newer than the checkpoint belong to steps this run trains again
    _delete([p for p in bests(directory) if _step_of(p) > state["step"]], rank)
    return path


def load(path: Path, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, schedule and RNG states from ``path``; its state.json."""
    with open(path / "model.safetensors", "rb") as handle:
        model.load_state_dict(load_safetensors(handle.read()))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"]["torch"])
    random.setstate(trainer["rng"]["python"])
    if trainer["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(trainer["rng"]["cuda"])
    return read_json(path / "state.json")


def _set_aside(found: list[Path], directory: Path, inputs: list[str], rank: int) -> None:
    """Move the checkpoints of a training on other inputs to ``directory/set_aside/`` (the
    previous set aside there goes), so this run starts over and none of them is resumed."""
    aside = directory / "set_aside"
    log.warning(
        "the checkpoints in %s were trained on other inputs (%s differ): moved to %s, "
        "training starts over",
        directory,
        ", ".join(inputs),
        aside,
    )
    if rank != 0:
        return
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    for old in found + bests(directory):
        os.replace(old, aside / old.name)


def _delete(found: list[Path], rank: int) -> None:
    if rank == 0:
        for old in found:
            shutil.rmtree(old)
