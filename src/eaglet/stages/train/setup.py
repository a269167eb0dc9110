"""Setting up a training run from its files: the inputs read and checked against the target
(the vocabulary map, the training and held-out shards, or the feed of streamed states), the
drafter built from the target, and the run's fingerprint with the samples it trains on.
``eaglet.stages.train.loop.Trainer.from_files`` takes these steps in this order.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.core.io import read_json
from eaglet.core.layout import START_RECORD_NAME
from eaglet.data.shard_format import safetensors_digest, sha256_path
from eaglet.data.vocab import load_vocab_map
from eaglet.model import methods
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.init import init_lm_head
from eaglet.stages.train import checkpoints as ckpt
from eaglet.stages.train.data import (
    ShardInfo,
    TrainError,
    check_shards,
    check_vocab_map,
    index_shard,
    manifest_hashes,
)
from eaglet.stages.train.stream import StreamSamples, open_stream
from eaglet.target.checkpoint import (
    load_target_embedding,
    load_target_lm_head,
    read_target_config,
    text_config,
)

log = logging.getLogger("eaglet.stages.train.loop")


@dataclass
class Inputs:
    """A run's inputs, checked against the target: the target's config (``text``: its text
    model's), the vocabulary map, and the descriptions of the training samples' shards
    (``infos``) and of the held-out ones (``eval_infos``). ``streamed``: the feed of the
    training samples' states from the capture server, whose shards ``infos`` describes; None
    where they are read from shards."""

    target_config: dict
    text: dict
    d2t: torch.Tensor
    t2d: torch.Tensor
    infos: list[ShardInfo]
    eval_infos: list[ShardInfo]
    streamed: StreamSamples | None


def read_inputs(
    cfg: dict,
    shard_paths: list[str],
    eval_shard_paths: list[str],
    vocab_map: str,
    target_dir: str,
    dist_,
    manifest: str | None,
    stream: dict | None,
) -> Inputs:
    """Check the shards and the vocabulary map against the target; each shard is hashed
    against ``manifest`` where one is given. ``stream``: the training samples' states come
    from the capture server (:func:`eaglet.stages.train.stream.open_stream`'s argument), not
    from ``shard_paths``. ``dist_``: the ranks (:class:`eaglet.stages.train.loop.Dist`)."""
    if not shard_paths and stream is None:
        raise TrainError("no training shards: the extract stage produced none")
    target_config = read_target_config(target_dir)
    text = text_config(target_config)
    d2t, t2d = load_vocab_map(vocab_map)
    check_vocab_map(text, d2t, t2d)
    hashes = manifest_hashes(manifest, shard_paths + eval_shard_paths) if manifest else {}
    eval_infos = [index_shard(p, t2d.numel(), hashes.get(p)) for p in eval_shard_paths]
    streamed = None
    if stream is not None:
        streamed = open_stream(stream, cfg, dist_.rank, dist_.world, dist_)
        infos = streamed.infos
    else:
        infos = [index_shard(p, t2d.numel(), hashes.get(p)) for p in shard_paths]
    check_shards(infos + eval_infos, text, target_dir)
    return Inputs(target_config, text, d2t, t2d, infos, eval_infos, streamed)


def build_drafter(
    cfg: dict, inputs: Inputs, target_dir: str, rank: int
) -> tuple[Eagle3Drafter, torch.Tensor, dict]:
    """The drafter of train.method, seeded by train.seed and built from the target's
    embedding (and lm_head rows and last layer, as configured); with the teacher's head (the
    target's lm_head rows of the draft vocabulary) and the record of what the drafter's layer
    started from (``train()``'s summary holds it). Rank 0 logs what the layer took."""
    d2t, t2d = inputs.d2t, inputs.t2d
    torch.manual_seed(cfg["seed"])
    if cfg.get("init_from"):
        return start_drafter(cfg["init_from"], inputs, target_dir, rank)
    config = DrafterConfig.from_target(
        inputs.target_config,
        d2t.numel(),
        inputs.infos[0].aux_layer_ids,
        cfg["drafter_attention"],
        cfg["drafter_variant"],
    )
    embed = load_target_embedding(target_dir)
    teacher_head = load_target_lm_head(target_dir, torch.arange(d2t.numel()) + d2t)
    model = methods.make_drafter(
        cfg["method"], inputs.target_config, config, embed, d2t, t2d, cfg["dflash_layers"]
    )
    if cfg["lm_head_init"] == "target":
        init_lm_head(model, teacher_head)
    layer_init = {"setting": cfg["layer_init"]}
    if cfg["layer_init"] == "target":  # only the parts of the target's layer that fit
        fit = methods.init_layer_from_target(
            model, target_dir, inputs.text["num_hidden_layers"] - 1
        )
        layer_init = fit.record()
        if rank == 0:
            log.log(logging.WARNING if fit.reasons else logging.INFO, "%s", fit.message())
    return model, teacher_head, layer_init


def start_drafter(
    start_dir: str, inputs: Inputs, target_dir: str, rank: int
) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    """``train.init_from``: the starting drafter, as rule start_drafter wrote it in eaglet's
    export layout (``start_dir``), to be fine-tuned; its vocabulary map is the run's (the vocab
    stage adopted it) and its aux layers the shards' (extraction captured them). Rank 0 logs
    which tensors came from the drafter and which are new."""
    model = methods.load(start_dir, target_dir)
    if not (torch.equal(model.d2t.cpu(), inputs.d2t) and torch.equal(model.t2d.cpu(), inputs.t2d)):
        raise TrainError(
            f"the starting drafter in {start_dir} drafts another vocabulary than "
            f"the run's map: the vocab stage adopts the drafter's (rerun it)"
        )
    aux = list(inputs.infos[0].aux_layer_ids)
    if list(model.config.aux_layer_ids) != aux:
        raise TrainError(
            f"the starting drafter in {start_dir} reads target layers "
            f"{list(model.config.aux_layer_ids)}, the shards hold {aux}: extraction "
            f"captures the drafter's layers (rerun it)"
        )
    record = read_json(Path(start_dir) / START_RECORD_NAME)
    if rank == 0:
        log.info(
            "fine-tuning the drafter of %s (%s): %d tensors from it%s%s%s",
            record["source"],
            record["format"],
            len(record["from_drafter"]),
            f"; new (initialized): {', '.join(record['new'])}" if record["new"] else "",
            f"; derived: {', '.join(record['derived'])}" if record["derived"] else "",
            f"; left out (not the drafter's): {', '.join(record['left_out'])}"
            if record["left_out"]
            else "",
        )
    teacher_head = load_target_lm_head(target_dir, torch.arange(inputs.d2t.numel()) + inputs.d2t)
    return (
        model.train(),
        teacher_head,
        {
            "setting": "init_from",
            "source": record["source"],
            "format": record["format"],
            "new": record["new"],
        },
    )


def fingerprint_and_subset(
    cfg: dict, infos: list[ShardInfo], group: int, vocab_map: str, train_samples: list[str] | None
) -> tuple[dict, set[int] | None]:
    """The run's fingerprint (what a checkpoint must match to be resumed; ``group``: the
    micro-batches of one optimizer step) and the global indices of ``train_samples``, the ids
    of the samples to train on (None: all, and no subset)."""
    fingerprint = ckpt.fingerprint(cfg, infos, group, safetensors_digest(vocab_map))
    if cfg.get("init_from"):  # the starting drafter's weights, not only where they lie
        fingerprint["start_drafter"] = safetensors_digest(
            Path(cfg["init_from"]) / "model.safetensors"
        )
    # what checkpoints of an earlier eaglet recorded: the file's bytes (matched once, below)
    fingerprint["vocab_map_file_sha256"] = sha256_path(vocab_map)
    subset = None
    if train_samples is not None:
        index = {sid: i for i, sid in enumerate(s for info in infos for s in info.sample_ids)}
        missing = [sid for sid in train_samples if sid not in index]
        if missing or not train_samples:
            raise TrainError(
                f"{len(missing)} of the {len(train_samples)} samples to train on "
                f"are in no training shard (first: {missing[:1]}): name at least "
                "one, each from this run's hidden/manifest.json"
            )
        subset = {index[sid] for sid in train_samples}
        # a checkpoint of another subset of the same shards must not resume this one
        fingerprint["sample_ids_sha256"] = hashlib.sha256(
            json.dumps([fingerprint["sample_ids_sha256"], sorted(train_samples)]).encode()
        ).hexdigest()
    return fingerprint, subset
