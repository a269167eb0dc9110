"""Training loop: learning, exact resume, non-finite loss, refused inputs, settings from the
schema, and DDP under torchrun on gloo.

Everything is tiny and built here: a random 4-layer Llama target saved with save_pretrained,
samples it answered greedily (so teacher and data agree as in the real pipeline), their
features written as eaglet shards, and a vocab map that leaves some of its tokens out.
"""

from __future__ import annotations

import csv
import json
import os
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.core.io import atomic_open
from eaglet.data import shards
from eaglet.stages.train.data import (
    Samples,
    TrainError,
    add_feature_noise,
    make_batch,
    step_micro_batches,
    steps_in,
)
from eaglet.stages.train.loop import Dist, Trainer, launch_torchrun, settings, train
from tests.helpers.paths import REPO, pythonpath_env

AUX_LAYERS = [1, 2, 3]
VOCAB, DRAFT_VOCAB = 256, 160
FAST = {
    "epochs": 2,
    "lr": 3e-3,
    "max_tokens_per_batch": 96,
    "ttt_steps": 3,
    "log_every": 1,
    "checkpoint_every": 2,
    "warmup_steps": 2,
    "seed": 0,
}


# -- the tiny world --------------------------------------------------------------------------


def make_target(directory: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a confident teacher, as trained models are (entropy ~1 nat)
        model.lm_head.weight.mul_(40)
    model.save_pretrained(directory)
    return model


@torch.no_grad()
def write_shards(
    model, directory: Path, n_shards: int, per_shard: int, seed: int, prefix: str = "s"
) -> list[str]:
    """Samples = random prompt + the target's greedy answer, with its features."""
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for s in range(n_shards):
        cols = {k: [] for k in ("ids", "mask", "argmax", "aux", "final")}
        lengths, sample_ids = [], []
        for i in range(per_shard):
            prompt_len = int(torch.randint(3, 9, (1,), generator=gen))
            answer_len = int(torch.randint(6, 30, (1,), generator=gen))
            ids = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
            for _ in range(answer_len):
                ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax()[None]])
            out = model(ids[None], output_hidden_states=True)
            cols["ids"].append(ids)
            cols["mask"].append(torch.cat([torch.zeros(prompt_len), torch.ones(answer_len)]))
            cols["argmax"].append(out.logits[0].argmax(-1))
            cols["aux"].append(torch.cat([out.hidden_states[a][0] for a in AUX_LAYERS], -1))
            cols["final"].append(model.model(ids[None]).last_hidden_state[0])
            lengths.append(ids.numel())
            sample_ids.append(f"{prefix}{s}-{i}")
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        path = shards.shard_path(directory, s)
        shards.write(
            path,
            torch.cat(cols["ids"]),
            torch.cat(cols["mask"]),
            offsets,
            torch.cat(cols["argmax"]),
            torch.cat(cols["aux"]),
            torch.cat(cols["final"]),
            sample_ids=sample_ids,
            aux_layer_ids=AUX_LAYERS,
            dtype="float32",
            target={"name": "tiny", "hidden_size": 64},
        )
        paths.append(str(path))
    return paths


def write_vocab_map(paths: list[str], out: Path) -> str:
    """The DRAFT_VOCAB most frequent tokens of the data (ties by id), so a few of the target's
    argmaxes fall outside the draft vocabulary as on real data."""
    counts = torch.zeros(VOCAB)
    for p in paths:
        counts += torch.bincount(shards.load(p).input_ids, minlength=VOCAB)
    keep = torch.sort(torch.argsort(-counts, stable=True)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    with atomic_open(out, "wb") as handle:
        handle.write(save({"d2t": keep - torch.arange(DRAFT_VOCAB), "t2d": t2d}))
    return str(out)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    model = make_target(root / "target")
    train_paths = write_shards(model, root / "hidden", 2, 8, seed=1)
    eval_paths = write_shards(model, root / "heldout", 1, 4, seed=2, prefix="e")
    vocab = write_vocab_map(train_paths, root / "vocab_map.safetensors")
    return {
        "root": root,
        "target": str(root / "target"),
        "train": train_paths,
        "eval": eval_paths,
        "vocab": vocab,
    }


def run(world, tmp: Path, cfg: dict, name: str = "run", **kwargs) -> dict:
    return train(
        cfg,
        world["train"],
        world["eval"],
        world["vocab"],
        world["target"],
        out_dir=str(tmp / name / "drafter"),
        checkpoint_dir=str(tmp / name / "ckpt"),
        progress_path=str(tmp / name / "progress.json"),
        log_path=None,
        **kwargs,
    )


def read_log(path: Path) -> list[dict]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


# -- tests -----------------------------------------------------------------------------------


def test_training_reduces_loss_and_writes_the_drafter(world, tmp_path):
    result = run(world, tmp_path, {**FAST, "epochs": 6})
    out = tmp_path / "run" / "drafter"
    rows = read_log(out / "training_log.csv")
    train_rows = [r for r in rows if r["split"] == "train"]
    eval_rows = [r for r in rows if r["split"] == "eval"]
    assert list(rows[0]) == [
        "step",
        "epoch",
        "split",
        "loss",
        "acc_0",
        "acc_1",
        "acc_2",
        "sim_al",
        "lr",
        "tokens_per_s",
        "peak_rss_mb",
    ]
    first, last = float(train_rows[0]["loss"]), float(train_rows[-1]["loss"])
    assert last < 0.7 * first, (first, last)
    assert len(eval_rows) == 6  # one per epoch, the last one at the end
    assert float(eval_rows[-1]["loss"]) < float(eval_rows[0]["loss"])
    assert result["steps"] == int(train_rows[-1]["step"]) == int(eval_rows[-1]["step"])
    assert result["eval"]["sim_al"] == pytest.approx(float(eval_rows[-1]["sim_al"]))
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_LAYERS
    assert weights(out)["lm_head.weight"].shape == (DRAFT_VOCAB, 64)
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert (
        progress["state"] == "finished" and progress["done"] == progress["total"] == result["steps"]
    )


@pytest.mark.subprocess
def test_a_trainer_still_running_keeps_a_second_one_off_its_checkpoints(world, tmp_path):
    """kill -9 of Snakemake alone leaves its trainer running; the rerun's trainer refuses to
    start beside it (both wrote drafter_checkpoints/ before), naming the live pid."""
    import subprocess
    import sys

    from eaglet.core.io import DirectoryBusy

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom eaglet.core.io import hold_directory\n"
            "with hold_directory(sys.argv[1], 'train'):\n    print('held', flush=True)\n"
            "    time.sleep(60)\n",
            str(tmp_path / "run" / "ckpt"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryBusy, match=rf"pid {holder.pid} .*kill {holder.pid}"):
            run(world, tmp_path, FAST)
        assert not (tmp_path / "run" / "drafter").exists()
    finally:
        holder.kill()
        holder.wait()


def test_killed_and_resumed_run_ends_with_the_same_weights(world, tmp_path):
    run(world, tmp_path, FAST, "whole")
    stopped = run(world, tmp_path, FAST, "killed", stop_after_steps=5)
    assert stopped == {"stopped_at_step": 5}
    ckpt = tmp_path / "killed" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002", "step_00000004"]
    resumed = run(world, tmp_path, FAST, "killed")  # the rerun: replays step 5 from step 4
    assert resumed["resumed_from_step"] == 4
    whole, again = weights(tmp_path / "whole" / "drafter"), weights(tmp_path / "killed" / "drafter")
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.allclose(whole[name], again[name], rtol=1e-5, atol=1e-6), name
    log_whole = read_log(tmp_path / "whole" / "drafter" / "training_log.csv")
    log_again = read_log(tmp_path / "killed" / "drafter" / "training_log.csv")
    assert [(r["step"], r["split"]) for r in log_whole] == [
        (r["step"], r["split"]) for r in log_again
    ]
    for a, b in zip(log_whole, log_again):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-4)


def test_resume_refuses_a_checkpoint_of_other_settings_unless_told_to_start_over(world, tmp_path):
    run(world, tmp_path, FAST, stop_after_steps=4)
    with pytest.raises(TrainError, match=r"lr differ.*delete"):
        run(world, tmp_path, {**FAST, "lr": 1e-3})
    fresh = run(world, tmp_path, {**FAST, "lr": 1e-3, "resume": False}, stop_after_steps=2)
    assert fresh == {"stopped_at_step": 2}
    assert [p.name for p in (tmp_path / "run" / "ckpt").glob("step_*")] == ["step_00000002"]


def test_a_run_resumes_under_another_attention_kernel_with_the_same_weights(world, tmp_path):
    """train.attention picks a kernel, not the math: a run killed under eager resumes under
    sdpa (no fingerprint mismatch) and ends where an sdpa run does, within float rounding;
    a checkpoint written before the setting existed resumes too."""
    whole = run(world, tmp_path, {**FAST, "attention": "sdpa"}, "whole")
    assert run(world, tmp_path, {**FAST, "attention": "eager"}, "killed", stop_after_steps=4) == {
        "stopped_at_step": 4
    }
    newest = tmp_path / "killed" / "ckpt" / "step_00000004"
    state = json.loads((newest / "state.json").read_text())
    assert "attention" not in state["fingerprint"]["train"]
    resumed = run(world, tmp_path, {**FAST, "attention": "sdpa"}, "killed")
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == whole["steps"]
    a, b = weights(tmp_path / "whole" / "drafter"), weights(tmp_path / "killed" / "drafter")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(TrainError, match="train.attention: attention flex needs a CUDA"):
        run(world, tmp_path, {**FAST, "attention": "flex", "device": "cpu"}, "flex")


def test_changed_settings_train_again_over_a_finished_training(world, tmp_path):
    """A finished training leaves nothing to resume: after a settings change the rerun starts
    over (and logs why) instead of refusing; a setting eaglet added later, left at the value
    that reproduces the earlier behaviour, counts as no change at all."""
    run(world, tmp_path, FAST)
    ckpt = tmp_path / "run" / "ckpt"
    newest = sorted(ckpt.glob("step_*"))[-1]
    state = json.loads((newest / "state.json").read_text())
    del state["fingerprint"]["train"]["feature_noise"]  # written before the setting existed
    (newest / "state.json").write_text(json.dumps(state))
    again = run(world, tmp_path, FAST)
    assert again["resumed_from_step"] == state["step"]  # the same settings: nothing to redo
    changed = run(world, tmp_path, {**FAST, "lr": 1e-3})
    assert changed["resumed_from_step"] == 0 and changed["steps"] == state["step"]
    assert sorted(p.name for p in ckpt.glob("step_*"))[-1] == newest.name  # written anew
    assert json.loads((newest / "state.json").read_text())["fingerprint"]["train"]["lr"] == 1e-3


def test_a_checkpoint_of_other_inputs_is_set_aside_never_resumed(world, tmp_path, caplog):
    """The same settings, sample ids and shard names, but other inputs: other hidden states
    (extraction rerun for other aux layers) or another vocabulary map. The finished run's
    checkpoint was resumed at its last step and its drafter shipped as this one's; now it
    is moved aside with one line saying which input differs, and training starts over."""
    first = run(world, tmp_path, FAST)
    ckpt = tmp_path / "run" / "ckpt"
    trained = weights(tmp_path / "run" / "drafter")

    # the same samples with other states: the shards rewritten from another target's layers
    other = tmp_path / "other"
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaForCausalLM.config_class.from_pretrained(world["target"]))
    other_train = write_shards(model.eval(), other / "hidden", 2, 8, seed=1)
    assert [Path(p).name for p in other_train] == [Path(p).name for p in world["train"]]
    caplog.set_level("WARNING", logger="eaglet.stages.train.loop")
    again = train(
        FAST,
        other_train,
        world["eval"],
        world["vocab"],
        world["target"],
        out_dir=str(tmp_path / "run" / "drafter"),
        checkpoint_dir=str(ckpt),
        progress_path=None,
        log_path=None,
    )
    assert again["resumed_from_step"] == 0 and again["steps"] == first["steps"]
    assert "trained on other inputs (shards_sha256 differ)" in caplog.text
    assert (
        sorted(p.name for p in (ckpt / "set_aside").glob("step_*"))[-1]
        == f"step_{first['steps']:08d}"
    )
    retrained = weights(tmp_path / "run" / "drafter")
    assert not torch.equal(retrained["fc.weight"], trained["fc.weight"])

    # another vocabulary map over the same shards: not resumed either (it crashed on d2t)
    caplog.clear()
    vocab = tmp_path / "vocab_other.safetensors"
    d2t_t2d = load_file(world["vocab"])
    t2d = d2t_t2d["t2d"].clone()
    dropped, added = int(t2d.nonzero()[-1]), int((~t2d).nonzero()[0])
    t2d[dropped], t2d[added] = False, True
    keep = t2d.nonzero()[:, 0]
    with atomic_open(vocab, "wb") as handle:
        handle.write(save({"d2t": keep - torch.arange(keep.numel()), "t2d": t2d}))
    third = train(
        FAST,
        other_train,
        world["eval"],
        str(vocab),
        world["target"],
        out_dir=str(tmp_path / "run" / "drafter"),
        checkpoint_dir=str(ckpt),
        progress_path=None,
        log_path=None,
    )
    assert third["resumed_from_step"] == 0
    assert "(vocab_map_sha256 differ)" in caplog.text


def test_non_finite_loss_names_step_and_samples_and_keeps_the_checkpoint(world, tmp_path):
    bad = tmp_path / "bad"
    paths = []
    for i, path in enumerate(world["train"]):
        shard = shards.load(path)
        aux = shard.aux_hidden.clone()
        if i == 1:
            aux[shard.sample(3)] = float("nan")  # sample s1-3
        shards.write(
            bad / Path(path).name,
            shard.input_ids,
            shard.loss_mask,
            shard.offsets,
            shard.teacher_argmax,
            aux,
            shard.final_hidden,
            sample_ids=shard.sample_ids,
            aux_layer_ids=AUX_LAYERS,
            dtype="float32",
            target=shard.target,
        )
        paths.append(str(bad / Path(path).name))
    cfg = {**FAST, "shuffle": False, "checkpoint_every": 1}
    with pytest.raises(TrainError) as err:
        train(
            cfg,
            paths,
            [],
            world["vocab"],
            world["target"],
            str(tmp_path / "out"),
            str(tmp_path / "ckpt"),
            None,
            None,
        )
    message = str(err.value)
    assert "non-finite loss" in message and "s1-3" in message
    step = int(message.split("at step ")[1].split()[0])
    assert step > 1
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert kept[-1] == f"step_{step - 1:08d}" and str(tmp_path / "ckpt" / kept[-1]) in message
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_loss_check_once_per_step_names_only_the_non_finite_micro_batches(tmp_path):
    """The losses of a step's micro-batches are checked together after them (one host sync
    per optimizer step); the error still names only the micro-batches that went wrong."""
    trainer = types.SimpleNamespace(
        dist=Dist(),
        device=torch.device("cpu"),
        step=6,
        epoch=0,
        next_in_epoch=6,
        checkpoint_dir=tmp_path,
    )
    trainer.fail = lambda what, *batches: Trainer.fail(trainer, what, *batches)
    batches = [types.SimpleNamespace(sample_ids=[f"s-{i}a", f"s-{i}b"]) for i in range(4)]
    Trainer.check_losses(trainer, [torch.tensor(v) for v in (1.0, 2.0, 0.5, 3.0)], batches)
    losses = [torch.tensor(v) for v in (1.0, float("nan"), 0.5, float("inf"))]
    with pytest.raises(TrainError) as err:
        Trainer.check_losses(trainer, losses, batches)
    message = str(err.value)
    assert "non-finite loss (nan, inf here) at step 7" in message
    assert "samples in these 2 micro-batches: s-1a, s-1b, s-3a, s-3b." in message
    assert "s-0a" not in message and "s-2a" not in message


def rewrite(path: str, out: Path, **changes) -> str:
    shard = shards.load(path)
    fields = dict(
        input_ids=shard.input_ids,
        loss_mask=shard.loss_mask,
        offsets=shard.offsets,
        teacher_argmax=shard.teacher_argmax,
        aux_hidden=shard.aux_hidden,
        final_hidden=shard.final_hidden,
    )
    meta = dict(
        sample_ids=shard.sample_ids,
        aux_layer_ids=shard.aux_layer_ids,
        dtype="float32",
        target=shard.target,
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for key, value in changes.items():
        (fields if key in fields else meta)[key] = value
    shards.write(out, *fields.values(), **meta)
    return str(out)


@pytest.mark.parametrize(
    "change, message",
    [
        ("aux_layer_ids", r"aux_layer_ids \[1, 2, 4\].*different extract runs"),
        ("target", r"has target .*different extract runs"),
        ("hidden", r"hidden size 32 but the target has 64"),
        ("token", r"input_ids holds id 256 outside the target vocabulary of 256"),
    ],
)
def test_mismatched_shards_are_refused(world, tmp_path, change, message):
    first = world["train"][0]
    shard = shards.load(first)
    second = tmp_path / "shard_00001.safetensors"
    if change == "aux_layer_ids":
        rewrite(first, second, aux_layer_ids=[1, 2, 4])
    elif change == "target":
        rewrite(first, second, target={"name": "other", "hidden_size": 64})
    elif change == "hidden":
        rewrite(
            first,
            second,
            aux_hidden=shard.aux_hidden[:, :96],
            final_hidden=shard.final_hidden[:, :32],
        )
    else:
        ids = shard.input_ids.clone()
        ids[5] = VOCAB
        rewrite(first, second, input_ids=ids)
    with pytest.raises(TrainError, match=message):
        train(
            FAST,
            [first, str(second)],
            [],
            world["vocab"],
            world["target"],
            str(tmp_path / "out"),
            str(tmp_path / "ckpt"),
            None,
            None,
        )


def test_shards_of_one_model_from_two_runs_train_together(world, tmp_path):
    """Two runs' copies of one target sit at different paths: the checkpoint's hashes say
    they are one model; other hashes are refused."""
    from eaglet.stages.train.data import same_model

    here = {"spec": "m", "path": "/runs/a/target", "source_sha256": "s", "config_sha256": "c"}
    assert same_model(here, {**here, "path": "/runs/b/target"})
    assert not same_model(here, {**here, "path": "/runs/b/target", "source_sha256": "t"})
    assert not same_model({"name": "m"}, {"name": "other"})
    from eaglet.target.checkpoint import model_identity

    hashed = {
        "spec": "tiny",
        "source_sha256": "s",
        "config_sha256": model_identity(Path(world["target"]))["config_sha256"],
    }
    runs = [
        rewrite(
            world["train"][0],
            tmp_path / run / "shard_00000.safetensors",
            target={**hashed, "path": f"/runs/{run}/target"},
        )
        for run in ("a", "b")
    ]
    train(
        FAST,
        runs,
        [],
        world["vocab"],
        world["target"],
        str(tmp_path / "out"),
        str(tmp_path / "ckpt"),
        None,
        None,
    )


def test_training_checks_disk_for_its_checkpoints_before_the_first_step(
    world, tmp_path, monkeypatch
):
    import eaglet.stages.train.loop as train_mod

    real = train_mod.shutil.disk_usage
    monkeypatch.setattr(train_mod.shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    with pytest.raises(
        TrainError,
        match=r"not enough disk for training: about .* still to write "
        r"\(3 checkpoints of .* and the drafter\), 4.00 KiB free"
        r".*train.keep_checkpoints",
    ):
        run(world, tmp_path, FAST)
    assert not list((tmp_path / "run" / "ckpt").glob("step_*"))


def test_vocab_map_of_another_target_is_refused(world, tmp_path):
    other = tmp_path / "vocab.safetensors"
    with atomic_open(other, "wb") as handle:
        handle.write(save({"d2t": torch.zeros(4, dtype=torch.int64), "t2d": torch.arange(300) < 4}))
    with pytest.raises(
        TrainError, match=r"t2d covers 300 tokens but the target's vocab_size is 256"
    ):
        train(
            FAST,
            world["train"],
            [],
            str(other),
            world["target"],
            str(tmp_path / "o"),
            str(tmp_path / "c"),
            None,
            None,
        )


# -- shards verified against the manifest ----------------------------------------------------


def hidden_dir(world, tmp: Path) -> tuple[list[str], list[str], str]:
    """The world's shards laid out as the workflow does (hidden/, hidden/eval/), with a
    manifest.json recording their sha256 as hidden_manifest writes it."""
    hidden = tmp / "hidden"
    (hidden / "eval").mkdir(parents=True)
    train_paths, eval_paths = [], []
    for src, paths, sub in [(p, train_paths, "") for p in world["train"]] + [
        (p, eval_paths, "eval/") for p in world["eval"]
    ]:
        dst = hidden / sub / Path(src).name
        dst.write_bytes(Path(src).read_bytes())
        paths.append(str(dst))
    listing = {
        key: [
            {"file": Path(p).relative_to(hidden).as_posix(), "sha256": shards.digest_path(p)}
            for p in paths
        ]
        for key, paths in (("shards", train_paths), ("eval_shards", eval_paths))
    }
    (hidden / "manifest.json").write_text(json.dumps(listing))
    return train_paths, eval_paths, str(hidden / "manifest.json")


def train_verified(world, tmp: Path, train_paths, eval_paths, manifest, cfg=FAST) -> dict:
    return train(
        cfg,
        train_paths,
        eval_paths,
        world["vocab"],
        world["target"],
        str(tmp / "out"),
        str(tmp / "ckpt"),
        None,
        None,
        manifest=manifest,
    )


@pytest.mark.parametrize("in_memory", [0, 1])
def test_a_bit_flipped_shard_with_its_mtime_kept_is_refused_and_set_aside(
    world, tmp_path, in_memory
):
    train_paths, eval_paths, manifest = hidden_dir(world, tmp_path)
    bad = Path(train_paths[1])
    stat = bad.stat()
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the hidden states: every header check still passes
    bad.write_bytes(bytes(data))
    os.utime(bad, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # invisible to make-style mtimes
    with pytest.raises(TrainError) as err:
        train_verified(
            world,
            tmp_path,
            train_paths,
            eval_paths,
            manifest,
            {**FAST, "shards_in_memory": in_memory},
        )
    message = str(err.value)
    assert f"{bad} is damaged" in message and "sha256" in message and "rerun" in message
    # moved aside: the workflow sees the shard missing and extracts it again
    assert not bad.exists() and bad.with_name(bad.name + ".damaged").read_bytes() == bytes(data)
    assert all(Path(p).exists() for p in train_paths[:1] + eval_paths)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_truncated_eval_shard_is_named_and_set_aside(world, tmp_path):
    train_paths, eval_paths, manifest = hidden_dir(world, tmp_path)
    bad = Path(eval_paths[0])
    bad.write_bytes(bad.read_bytes()[:100])  # cut inside the safetensors header
    with pytest.raises(TrainError) as err:
        train_verified(world, tmp_path, train_paths, eval_paths, manifest)
    message = str(err.value)
    assert f"{bad} is damaged" in message and "cannot be read" in message
    assert not bad.exists() and bad.with_name(bad.name + ".damaged").exists()


def test_verified_shards_train_to_the_weights_unverified_ones_give(world, tmp_path):
    """Checking the shards against the manifest only reads them: the same shards without a
    manifest train to the same weights and log."""
    train_paths, eval_paths, manifest = hidden_dir(world, tmp_path)
    cfg = {**FAST, "epochs": 1}
    verified = train_verified(world, tmp_path, train_paths, eval_paths, manifest, cfg)
    unverified = train(
        cfg,
        train_paths,
        eval_paths,
        world["vocab"],
        world["target"],
        str(tmp_path / "unverified" / "out"),
        str(tmp_path / "unverified" / "ckpt"),
        None,
        None,
    )
    assert verified["steps"] == unverified["steps"] > 0
    a, b = weights(tmp_path / "out"), weights(tmp_path / "unverified" / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    log_a = read_log(tmp_path / "out" / "training_log.csv")
    log_b = read_log(tmp_path / "unverified" / "out" / "training_log.csv")
    assert [(r["step"], r["split"], r["loss"], r["acc_0"]) for r in log_a] == [
        (r["step"], r["split"], r["loss"], r["acc_0"]) for r in log_b
    ]


def test_a_shard_missing_from_the_manifest_is_refused(world, tmp_path):
    train_paths, eval_paths, manifest = hidden_dir(world, tmp_path)
    listing = json.loads(Path(manifest).read_text())
    del listing["eval_shards"]  # a manifest written before eval shards were listed
    Path(manifest).write_text(json.dumps(listing))
    with pytest.raises(
        TrainError,
        match=r"shard_00000.safetensors is not listed in .*manifest.json"
        r".*forcerun hidden_manifest",
    ):
        train_verified(world, tmp_path, train_paths, eval_paths, manifest)


# -- streamed data: mapped shards and the prefetcher ------------------------------------------


class EagerSamples(Samples):
    """The data path before shards were mapped: every shard loaded whole and widened to
    float32 by shards.load, samples sliced from it."""

    def get(self, index, max_len):
        number = self.shard_of[index]
        if not hasattr(self, "loaded"):
            self.loaded = {}
        if number not in self.loaded:
            self.loaded[number] = shards.load(self.infos[number].path, self.infos[number].sha256)
        shard, local = self.loaded[number], index - self.first[number]
        rows = shard.sample(local)
        rows = slice(rows.start, min(rows.stop, rows.start + max_len))
        return (
            shard.sample_ids[local],
            shard.input_ids[rows],
            shard.loss_mask[rows],
            shard.teacher_argmax[rows],
            shard.aux_hidden[rows],
            shard.final_hidden[rows],
        )


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_streamed_training_equals_the_eager_data_path(world, tmp_path, monkeypatch, dtype):
    """Mapped shards in their stored dtype, converted a micro-batch at a time, with batches
    built ahead by the prefetcher, train to the same weights and log as shards loaded whole
    in float32 and packed in the loop."""
    paths = [rewrite(p, tmp_path / "hidden" / Path(p).name, dtype=dtype) for p in world["train"]]
    cfg = {**FAST, "feature_noise": 0.1}  # the noise stays in the loop's random stream

    def fit(name, **extra):
        return train(
            {**cfg, **extra},
            paths,
            world["eval"],
            world["vocab"],
            world["target"],
            str(tmp_path / name / "out"),
            str(tmp_path / name / "ckpt"),
            None,
            None,
        )

    streamed = fit("streamed", prefetch_batches=3, host_ram_mb=64)
    with monkeypatch.context() as patch:
        patch.setattr("eaglet.stages.train.loop.Samples", EagerSamples)
        eager = fit("eager", prefetch_batches=0)
    assert streamed["steps"] == eager["steps"] > 4
    a, b = weights(tmp_path / "streamed" / "out"), weights(tmp_path / "eager" / "out")
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-6, atol=1e-7), name
    log_a = read_log(tmp_path / "streamed" / "out" / "training_log.csv")
    log_b = read_log(tmp_path / "eager" / "out" / "training_log.csv")
    assert [(r["step"], r["split"], r["acc_0"]) for r in log_a] == [
        (r["step"], r["split"], r["acc_0"]) for r in log_b
    ]
    for x, y in zip(log_a, log_b):
        assert float(x["loss"]) == pytest.approx(float(y["loss"]), rel=1e-5)
    peaks = [float(r["peak_rss_mb"]) for r in log_a if r["split"] == "train"]
    assert all(p > 50 for p in peaks) and peaks == sorted(peaks)  # a running peak, in MiB
    assert streamed["peak_rss_mb"] >= peaks[-1]


def test_a_trainer_built_from_files_resolves_the_prefetch_default_for_its_device(world, tmp_path):
    """train.prefetch_batches null: none ahead on the CPU; resolved where the data budget is
    split (a null there would not count)."""
    cfg = settings(FAST)
    assert cfg["prefetch_batches"] is None
    trainer = Trainer.from_files(
        cfg,
        world["train"],
        [],
        world["vocab"],
        world["target"],
        str(tmp_path / "ckpt"),
        torch.device("cpu"),
        Dist(),
    )
    assert trainer.cfg["prefetch_batches"] == 0 and trainer.prefetcher() is None


def test_prefetched_batches_are_the_loops_from_any_resumed_position(world, tmp_path):
    """The prefetcher's sequence, started where a checkpoint left off (mid-epoch, over an
    epoch boundary, with grad_accum), is the sequence of micro-batches the loop trains on,
    and the batches it builds are those the loop would build."""
    cfg = settings(
        {**FAST, "epochs": 3, "grad_accum": 2, "max_tokens_per_batch": 64, "prefetch_batches": 2}
    )  # set: on the CPU its default is none ahead
    trainer = Trainer.from_files(
        cfg,
        world["train"],
        [],
        world["vocab"],
        world["target"],
        str(tmp_path / "ckpt"),
        torch.device("cpu"),
        Dist(),
    )

    def loop_order():  # what Trainer.run steps through, position by position
        out, step, epoch, at = [], trainer.step, trainer.epoch, trainer.next_in_epoch
        while step < trainer.total_steps and epoch < cfg["epochs"]:
            plan = trainer.plan(epoch)
            if at >= steps_in(plan, trainer.group):
                epoch, at = epoch + 1, 0
                continue
            out += [
                ((epoch, at, i), m)
                for i, m in enumerate(step_micro_batches(plan, at, trainer.group))
            ]
            step, at = step + 1, at + 1
        return out

    first_epoch = steps_in(trainer.plan(0), trainer.group)
    assert first_epoch > 2
    for step, epoch, at in [(0, 0, 0), (first_epoch - 1, 0, first_epoch - 1), (first_epoch, 1, 0)]:
        trainer.step, trainer.epoch, trainer.next_in_epoch = step, epoch, at
        expected = loop_order()
        ahead = list(trainer.upcoming())
        assert ahead == expected and ahead[0][0] == (epoch, at, 0)
        feed = trainer.prefetcher()
        try:
            for key, indices in expected[:6]:
                got, want = feed.take(key), trainer.host_batch(trainer.train_data, indices)
                assert got.sample_ids == want.sample_ids
                assert torch.equal(got.aux, want.aux) and torch.equal(got.step_ids, want.step_ids)
        finally:
            feed.close()


# -- data parallel ---------------------------------------------------------------------------


@pytest.mark.subprocess
def test_ddp_on_two_processes_equals_one_process_accumulating_both(world, tmp_path):
    """The launch path of rule train with two GPUs, on CPU: torchrun starts two gloo
    processes of eaglet.stages.train.loop's worker, which must train exactly as one process that
    accumulates both micro-batches."""
    cfg = {**FAST, "epochs": 1, "checkpoint_every": 100}
    launch_torchrun(
        {
            "cfg": cfg,
            "shard_paths": world["train"],
            "eval_shard_paths": world["eval"],
            "vocab_map": world["vocab"],
            "target_dir": world["target"],
            "out_dir": str(tmp_path / "ddp" / "drafter"),
            "checkpoint_dir": str(tmp_path / "ddp" / "ckpt"),
            "progress_path": str(tmp_path / "ddp" / "progress.json"),
            "log_path": None,
        },
        nproc=2,
    )
    single = run(world, tmp_path, {**cfg, "grad_accum": 2}, "single")
    ddp, one = weights(tmp_path / "ddp" / "drafter"), weights(tmp_path / "single" / "drafter")
    for name in one:
        assert torch.allclose(ddp[name], one[name], rtol=1e-4, atol=1e-6), name
    ddp_log = read_log(tmp_path / "ddp" / "drafter" / "training_log.csv")
    one_log = read_log(tmp_path / "single" / "drafter" / "training_log.csv")
    assert len(ddp_log) == len(one_log) and single["steps"] == int(one_log[-1]["step"])
    for a, b in zip(ddp_log, one_log):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-4)
        assert a["acc_0"] == b["acc_0"]
    assert float(one_log[-2]["loss"]) < float(one_log[0]["loss"])


def test_settings_take_their_defaults_from_the_config_schema_and_keep_the_cross_key_check():
    from eaglet.core.config import validate

    schema_defaults = validate({})["train"]
    got = settings({"lr": 1e-3, "max_tokens_per_batch": 512})
    assert got["lr"] == 1e-3 and got["max_len"] == 512  # null max_len: one batch
    assert {k: v for k, v in got.items() if k not in ("lr", "max_tokens_per_batch", "max_len")} == {
        k: v
        for k, v in schema_defaults.items()
        if k not in ("lr", "max_tokens_per_batch", "max_len", "gpus")
    }
    with pytest.raises(TrainError, match=r"train.lm_head_init: 'copied' is not one of"):
        settings({"lm_head_init": "copied"})
    with pytest.raises(TrainError, match=r"unknown key epoch under train"):
        settings({"epoch": 3})
    with pytest.raises(TrainError, match=r"max_len 600 exceeds train.max_tokens_per_batch 512"):
        settings({"max_len": 600, "max_tokens_per_batch": 512})


def test_loss_on_prompt_counts_the_prompt_positions_too():
    """Row t predicts token t+2 at step 0: the answer (loss_mask 1) starts at token 3, so
    rows 1..3 count; with train.loss_on_prompt row 0 (predicting prompt token 2) counts too."""
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    piece = (
        "s",
        ids,
        torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.uint8),
        ids.clone(),
        torch.zeros(6, 6),
        torch.zeros(6, 2),
    )
    t2d = torch.ones(16, dtype=torch.bool)
    assert make_batch([piece], 1, t2d).rows[0].tolist() == [1, 2, 3]
    assert make_batch([piece], 1, t2d, prompt_loss=True).rows[0].tolist() == [0, 1, 2, 3]
    # as extraction stores it: the argmax only where the target predicts an answer token
    stored = ("s", ids, piece[2], torch.tensor([-1, -1, 8, 9, 10, -1]), *piece[4:])
    t2d[-1] = False  # -1 must not read the vocabulary's last token (rarely a draft token)
    assert make_batch([stored], 1, t2d).rows[0].tolist() == [1, 2, 3]
    assert make_batch([stored], 1, t2d, prompt_loss=True).rows[0].tolist() == [0, 1, 2, 3]
    t2d[9] = False  # an answer token the draft vocabulary lacks still does not count
    assert make_batch([stored], 1, t2d, prompt_loss=True).rows[0].tolist() == [0, 1, 3]


def test_feature_noise_is_scaled_to_each_layers_rms_per_row():
    """Layers of very different magnitude (deep layers grow) each get noise of scale x their
    own RMS, row by row; the noise is fresh per call and nothing else changes."""
    T, H = 4000, 64
    magnitudes = torch.tensor([1.0, 30.0, 400.0])
    aux = (torch.randn(T, 3, H) * magnitudes[None, :, None]).view(T, 3 * H)
    aux[0] *= 10  # one loud row
    generator = torch.Generator().manual_seed(0)
    noisy = add_feature_noise(aux, 3, 0.2, generator)
    assert noisy.shape == aux.shape and noisy.dtype == aux.dtype
    noise = (noisy - aux).view(T, 3, H)
    rms = aux.view(T, 3, H).pow(2).mean(-1).sqrt()  # [T, 3]
    ratio = noise.pow(2).mean(-1).sqrt() / rms  # per row and layer ~0.2
    assert ratio.mean(0).sub(0.2).abs().max() < 0.01
    assert ratio[0].sub(0.2).abs().max() < 0.08  # the loud row's own scale
    assert not torch.equal(add_feature_noise(aux, 3, 0.2, generator), noisy)
    assert torch.equal(add_feature_noise(aux, 3, 0.0), aux)


SIGTERMED = """
import json, os, signal, sys
from pathlib import Path
from eaglet.stages.train import loop
from tests.test_train import FAST, run

world, tmp = json.loads(sys.argv[1]), Path(sys.argv[2])
step, taken = loop.Trainer.train_step, []

def step_then_terminated(self, *args, **kwargs):  # SIGTERM during step 3, as a scheduler
    out = step(self, *args, **kwargs)           # sends it at a time limit or on preemption
    taken.append(1)
    if len(taken) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return out

loop.Trainer.train_step = step_then_terminated
run(world, tmp, {**FAST, "checkpoint_every": 100}, "term")
"""


@pytest.mark.subprocess
def test_sigterm_checkpoints_and_says_so_and_the_rerun_resumes_to_the_same_weights(world, tmp_path):
    """A scheduler ends a job with SIGTERM at its time limit or on preemption, then SIGKILL
    after a grace period. The trainer stops after its current step, writes a checkpoint (even
    between its regular ones) and says so; the requeued job resumes from it and ships the
    weights an uninterrupted run ships."""
    import json
    import subprocess
    import sys

    env = pythonpath_env(REPO)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SIGTERMED,
            json.dumps(
                {
                    k: (v if isinstance(v, str) else [str(p) for p in v])
                    for k, v in world.items()
                    if k != "root"
                }
            ),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode != 0
    assert "received SIGTERM at step" in done.stderr and "checkpoint written" in done.stderr
    saved = sorted(p.name for p in (tmp_path / "term" / "ckpt").glob("step_*"))
    assert saved and not (tmp_path / "term" / "drafter" / "model.safetensors").exists()
    stopped_at = int(saved[-1].split("_")[1])
    assert stopped_at == 3  # the step it was in, not a regular checkpoint (every 100 steps)
    resumed = run(world, tmp_path, {**FAST, "checkpoint_every": 100}, "term")
    assert resumed["resumed_from_step"] == stopped_at
    run(world, tmp_path, {**FAST, "checkpoint_every": 100}, "whole")
    ours, theirs = weights(tmp_path / "term" / "drafter"), weights(tmp_path / "whole" / "drafter")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6), name


def test_a_checkpoint_that_fills_the_disk_says_so_and_leaves_the_earlier_ones(
    tmp_path, monkeypatch
):
    """A disk that fills while a checkpoint is written: torch's own error ("[enforce fail at
    inline_container.cc:672] . unexpected pos") said nothing of the disk and left its
    temporary directory behind. The stage names the full disk and the fix; the checkpoints
    written before it stay, for the rerun to resume from."""
    import shutil as shutil_module
    from collections import namedtuple

    from eaglet.stages.train import checkpoints as ckpt
    from eaglet.stages.train.data import TrainError

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt.save(tmp_path, 1, model, optimizer, scheduler, {"step": 1}, keep=2)

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: usage(10**9, 10**9, 2**20))
    with pytest.raises(TrainError, match="disk is full") as raised:
        ckpt.save(tmp_path, 2, model, optimizer, scheduler, {"step": 2}, keep=2)
    assert "checkpoint step 2" in str(raised.value) and "resumes" in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
