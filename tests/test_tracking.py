"""train.report_to: training-log rows as tracker metrics (``eaglet.stages.train.tracking``)."""

from __future__ import annotations

import importlib.util

import pytest

from eaglet.stages.train.data import TrainError
from eaglet.stages.train.loop import settings
from eaglet.stages.train.tracking import Trackers, TrackingError, metrics_of


def test_a_log_row_becomes_metrics_named_by_split_at_its_step():
    row = {
        "step": 40,
        "epoch": 1.5,
        "split": "eval",
        "loss": 2.25,
        "acc_0": 0.5,
        "acc_1": 0.25,
        "sim_al": 1.625,
        "lr": "",
        "tokens_per_s": "",
    }
    assert metrics_of(row) == {
        "eval/epoch": 1.5,
        "eval/loss": 2.25,
        "eval/acc_0": 0.5,
        "eval/acc_1": 0.25,
        "eval/sim_al": 1.625,
    }


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_names_the_package_to_install(tmp_path, name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(TrackingError, match=rf"not installed: pip install {name}"):
        Trackers([name], tmp_path, {})


def test_report_to_is_a_train_setting_checked_by_the_schema():
    assert settings({})["report_to"] == []
    assert settings({"report_to": ["tensorboard"]})["report_to"] == ["tensorboard"]
    with pytest.raises(TrainError, match=r"train.report_to.0: 'neptune' is not one of"):
        settings({"report_to": ["neptune"]})
