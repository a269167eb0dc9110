"""Experiment tracking: the rows of ``training_log.csv`` sent, as they are logged, to the
trackers named in ``train.report_to`` (tensorboard, wandb, mlflow), as peer trainers do.

Each tracker is imported only when asked for; a missing one is an error that names the
package to install. Metrics are named ``<split>/<column>`` (``train/loss``, ``eval/acc_0``)
at the row's optimizer step.
"""

from __future__ import annotations

from pathlib import Path

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackingError(RuntimeError):
    pass


def metrics_of(row: dict) -> dict[str, float]:
    """The numeric columns of a training-log row, named by its split (empty cells skipped)."""
    return {
        f"{row['split']}/{key}": float(value)
        for key, value in row.items()
        if key not in ("step", "split") and value not in ("", None)
    }


def _missing(name: str) -> TrackingError:
    return TrackingError(
        f"train.report_to names {name}, which is not installed: "
        f"pip install {PACKAGES[name]} (or drop {name} from train.report_to)"
    )


class Trackers:
    """The trackers of ``names``, logging under ``log_dir`` (tensorboard's event files, wandb's
    run directory); ``config`` (the train settings) is recorded with the run."""

    def __init__(self, names: list[str], log_dir: str | Path, config: dict):
        self.log_dir = Path(log_dir)
        self._log, self._close = [], []
        for name in names:
            getattr(self, f"_open_{name}")(config)

    def _open_tensorboard(self, config: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's module needs the tensorboard package
            raise _missing("tensorboard") from None
        writer = SummaryWriter(str(self.log_dir / "tensorboard"))
        writer.add_text("train settings", repr(config))
        self._log.append(
            lambda metrics, step: [writer.add_scalar(k, v, step) for k, v in metrics.items()]
        )
        self._close.append(writer.close)

    def _open_wandb(self, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        run = wandb.init(project="eaglet", config=config, dir=str(self.log_dir))
        self._log.append(lambda metrics, step: run.log(metrics, step=step))
        self._close.append(run.finish)

    def _open_mlflow(self, config: dict) -> None:
        try:
            import mlflow
        except ImportError:
            raise _missing("mlflow") from None
        mlflow.start_run()
        mlflow.log_params({k: str(v) for k, v in config.items()})
        self._log.append(lambda metrics, step: mlflow.log_metrics(metrics, step=step))
        self._close.append(mlflow.end_run)

    def log(self, row: dict) -> None:
        metrics = metrics_of(row)
        for send in self._log:
            send(metrics, int(row["step"]))

    def close(self) -> None:
        for close in self._close:
            close()
