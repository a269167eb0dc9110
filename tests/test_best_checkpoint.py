"""Which weights ship: those of the best held-out evaluation (highest simulated AL, a tie to
the later one), not the last; the last when there is no held-out split; the best of a run
that was killed and resumed, from the weights kept beside the checkpoints.

The held-out curve is recorded, not learned: the real evaluation runs on the tiny world of
test_train.py and its simulated AL is replaced by the curve's value for that epoch, so the
curve can turn as real ones do on small data. Every evaluation's weights are kept here to
compare the shipped drafter with.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eaglet.stages.train import checkpoints as ckpt
from eaglet.stages.train.loop import Trainer, train
from tests.test_train import FAST, run, weights, world  # noqa: F401 (world: the fixture)

EPOCHS = 4
CFG = {**FAST, "epochs": EPOCHS, "checkpoint_every": 1}  # a checkpoint at every step


@pytest.fixture
def curve(monkeypatch):
    """``curve["als"]``: the held-out simulated AL of each epoch's evaluation (set by the
    test); ``curve["seen"]``: the weights at each evaluated step; ``curve["evaluated"]``:
    the steps evaluated, in order."""
    real = Trainer.evaluate
    state = {"als": None, "seen": {}, "evaluated": []}

    def recorded(self):
        metrics = real(self)
        metrics["sim_al"] = state["als"][self.epoch]  # at an epoch's end: that epoch's index
        state["seen"][self.step] = {
            k: v.detach().clone() for k, v in self.model.state_dict().items()
        }
        state["evaluated"].append(self.step)
        return metrics

    monkeypatch.setattr(Trainer, "evaluate", recorded)
    return state


def same_weights(shipped: dict, state: dict) -> bool:
    """Whether the exported drafter holds exactly these weights (the export keeps the
    training names, in float32)."""
    return all(torch.equal(shipped[name], state[name]) for name in shipped)


def test_the_best_heldout_epoch_ships_when_the_curve_turns(world, tmp_path, curve, caplog):  # noqa: F811
    curve["als"] = [1.2, 1.6, 1.4, 1.3]
    caplog.set_level("INFO", logger="eaglet.stages.train.loop")
    result = run(world, tmp_path, CFG)
    evaluated = curve["evaluated"]
    assert len(evaluated) == EPOCHS and evaluated[-1] == result["steps"]
    shipped = weights(tmp_path / "run" / "drafter")
    assert same_weights(shipped, curve["seen"][evaluated[1]])
    assert not same_weights(shipped, curve["seen"][evaluated[-1]])  # the last did not ship
    choice = result["shipped"]
    assert choice | {"note": None} == {
        "choice": "best",
        "step": evaluated[1],
        "epoch": 2.0,
        "heldout_al": 1.6,
        "best_step": evaluated[1],
        "best_epoch": 2.0,
        "best_heldout_al": 1.6,
        "last_epoch": 4.0,
        "last_epoch_al": 1.3,
        "chosen_from_step": 0,
        "note": None,
    }
    line = (
        f"the best held-out weights ship (epoch 2, step {evaluated[1]}): held-out "
        f"simulated AL 1.600, against 1.300 at the last evaluation (epoch 4, step "
        f"{evaluated[-1]})"
    )
    assert choice["note"] == line and line in caplog.text
    stats = json.loads((tmp_path / "run" / "drafter" / "stats.json").read_text())
    assert stats["shipped"] == choice and stats["steps"] == result["steps"]
    # the training log is the whole run's, the last evaluation included
    assert result["eval"]["step"] == evaluated[-1] and result["eval"]["sim_al"] == 1.3


@pytest.mark.parametrize(
    "als, ships",
    [
        ([1.2, 1.5, 1.5, 1.3], 3),  # a tie goes to the later epoch
        ([1.2, 1.5, 1.3, 1.5], 4),  # ... the last one too: the last weights, none loaded
    ],
)
def test_a_tie_goes_to_the_later_epoch(world, tmp_path, curve, als, ships):  # noqa: F811
    curve["als"] = als
    result = run(world, tmp_path, CFG)
    step = curve["evaluated"][ships - 1]
    assert same_weights(weights(tmp_path / "run" / "drafter"), curve["seen"][step])
    choice = result["shipped"]
    assert (choice["step"], choice["epoch"], choice["heldout_al"]) == (step, float(ships), 1.5)
    assert choice["choice"] == ("last" if ships == EPOCHS else "best")
    if ships == EPOCHS:
        assert choice["note"] == (
            f"the last weights ship (epoch 4, step {step}): their "
            f"held-out simulated AL 1.500 is the best"
        )


def test_without_a_heldout_split_the_last_weights_ship_and_the_log_says_so(
    world,
    tmp_path,  # noqa: F811
    caplog,
):
    caplog.set_level("INFO", logger="eaglet.stages.train.loop")
    out, checkpoints = tmp_path / "drafter", tmp_path / "ckpt"
    result = train(
        CFG,
        world["train"],
        [],
        world["vocab"],
        world["target"],
        str(out),
        str(checkpoints),
        None,
        None,
    )
    choice = result["shipped"]
    assert choice["choice"] == "last" and choice["step"] == result["steps"]
    assert choice["epoch"] == 4.0 and choice["heldout_al"] is None
    assert choice["best_heldout_al"] is None and choice["last_epoch_al"] is None
    assert choice["note"] == (
        f"no held-out split, so no held-out simulated AL to choose by: "
        f"the last weights ship (epoch 4, step {result['steps']})"
    )
    assert choice["note"] in caplog.text
    newest = checkpoints / f"step_{result['steps']:08d}" / "model.safetensors"
    assert same_weights(weights(out), load_file(str(newest)))
    assert not ckpt.bests(checkpoints)  # nothing to keep
    assert json.loads((out / "stats.json").read_text())["shipped"] == choice


def test_a_killed_and_resumed_run_still_ships_the_best_epoch(world, tmp_path, curve, caplog):  # noqa: F811
    """Killed one step into epoch 4: the checkpoint of epoch 2's end is gone (two are kept),
    but the best's weights stay beside the checkpoints, and the rerun, which evaluates only
    epoch 4, ships them. With those weights deleted it says so and chooses among what it
    evaluated itself."""
    curve["als"] = [1.2, 1.6, 1.4, 1.3]
    whole = run(world, tmp_path, CFG, "whole")
    ends = list(curve["evaluated"])
    assert whole["shipped"]["step"] == ends[1]
    curve["evaluated"].clear()

    stop = ends[2] + 1
    assert stop < ends[3]
    assert run(world, tmp_path, CFG, "killed", stop_after_steps=stop) == {"stopped_at_step": stop}
    checkpoints = tmp_path / "killed" / "ckpt"
    assert [p.name for p in ckpt.checkpoints(checkpoints)] == [
        f"step_{ends[2]:08d}",
        f"step_{stop:08d}",
    ]
    assert [p.name for p in ckpt.bests(checkpoints)] == [f"best_step_{ends[1]:08d}"]
    best_state = json.loads((ckpt.bests(checkpoints)[0] / "state.json").read_text())
    newest_state = json.loads((checkpoints / f"step_{stop:08d}" / "state.json").read_text())
    assert best_state["fingerprint"] == newest_state["fingerprint"]
    assert newest_state["best"] == {"step": ends[1], "epoch": 2.0, "sim_al": 1.6}
    best_weights = curve["seen"][ends[1]]
    shutil.copytree(tmp_path / "killed", tmp_path / "lost")

    curve["evaluated"].clear()
    resumed = run(world, tmp_path, CFG, "killed")
    assert resumed["resumed_from_step"] == stop and curve["evaluated"] == [ends[3]]
    shipped = weights(tmp_path / "killed" / "drafter")
    assert same_weights(shipped, best_weights)  # read back from disk, bit for bit
    a = weights(tmp_path / "whole" / "drafter")
    for name in a:
        assert torch.allclose(a[name], shipped[name], rtol=1e-5, atol=1e-6), name
    assert resumed["shipped"] | {"note": None} == whole["shipped"] | {"note": None}
    assert [p.name for p in ckpt.bests(checkpoints)] == [f"best_step_{ends[1]:08d}"]

    # the best's weights deleted: the rerun warns and ships the best of its own evaluations
    shutil.rmtree(ckpt.bests(tmp_path / "lost" / "ckpt")[0])
    caplog.set_level("INFO", logger="eaglet.stages.train.loop")
    lost = run(world, tmp_path, CFG, "lost")
    assert (
        f"the weights of the best held-out evaluation before step {stop} (step "
        f"{ends[1]}, simulated AL 1.600) are not in"
    ) in caplog.text
    choice = lost["shipped"]
    assert choice["choice"] == "last" and choice["chosen_from_step"] == stop
    assert choice["best_step"] == ends[3] and choice["note"].endswith(
        f"; chosen among the evaluations from step {stop} on"
    )


def fingerprint(lr: float = 1e-3, vocab: str = "v") -> dict:
    return {
        "train": {"lr": lr},
        "shards": ["shard_00000.safetensors"],
        "sample_ids_sha256": "s",
        "micro_batches_per_step": 1,
        "inputs": {"shards_sha256": ["h"], "aux_layer_ids": [1, 2, 3], "vocab_map_sha256": vocab},
    }


def test_best_weights_are_kept_while_a_checkpoint_names_them_and_only_for_their_training(tmp_path):
    """The bookkeeping beside the checkpoints: a best is kept while a kept checkpoint names
    it or it is newer than the newest checkpoint; a newer best replaces an unnamed one; a
    resumed run drops the bests newer than its checkpoint; a best of other settings or
    inputs is never read; starting over deletes them, and other inputs set them aside."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    fp = fingerprint()

    def best(step, al):
        record = {"step": step, "epoch": step / 4, "sim_al": al}
        ckpt.save_best(tmp_path, record, model, fp)
        return record

    def checkpoint(step, named):
        ckpt.save(
            tmp_path,
            step,
            model,
            optimizer,
            scheduler,
            {"step": step, "total_steps": 100, "fingerprint": fp, "best": named},
            keep=1,
        )

    def kept():
        return [int(p.name.rsplit("_", 1)[1]) for p in ckpt.bests(tmp_path)]

    three = best(3, 1.5)
    checkpoint(4, three)
    five = best(5, 1.6)
    assert kept() == [3, 5]
    six = best(6, 1.7)  # replaces 5: no checkpoint names it
    assert kept() == [3, 6]
    checkpoint(7, six)  # checkpoint 4 goes (keep 1), and the best it named with it
    assert kept() == [6]
    best(8, 1.8)
    assert ckpt.to_resume(tmp_path, fp, True, 0) == tmp_path / "step_00000007"
    assert kept() == [6]  # 8 is of steps the resumed run trains again

    assert ckpt.best_path(tmp_path, six, fp) == tmp_path / "best_step_00000006"
    assert torch.equal(ckpt.load_best(ckpt.best_path(tmp_path, six, fp))["weight"], model.weight)
    assert ckpt.best_path(tmp_path, {**six, "sim_al": 1.71}, fp) is None
    assert ckpt.best_path(tmp_path, five, fp) is None
    assert ckpt.best_path(tmp_path, six, fingerprint(lr=2e-3)) is None
    assert ckpt.best_path(tmp_path, six, fingerprint(vocab="other")) is None

    assert ckpt.to_resume(tmp_path, fingerprint(vocab="other"), True, 0) is None
    assert kept() == [] and sorted(p.name for p in (tmp_path / "set_aside").iterdir()) == [
        "best_step_00000006",
        "step_00000007",
    ]
    best(2, 1.0)
    checkpoint(3, None)
    assert kept() == []  # a best no checkpoint names, older than the newest, goes at once
    best(4, 1.1)
    assert ckpt.to_resume(tmp_path, fp, False, 0) is None  # resume false: start over
    assert kept() == [] and not ckpt.checkpoints(tmp_path)
