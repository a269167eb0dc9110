"""Snakemake entry point of rule train (rules/train.smk).

With resources.gpu > 1 the run starts under torchrun, one data-parallel process per GPU
(eaglet.stages.train.loop.main is the worker); otherwise it trains in this process. train.data stream:
one process per GPU of the trainer's own (train.gpus), or one on each of the server's
(train.gpus 0), the server on the first server.gpus of the job's.
"""

from pathlib import Path

from eaglet.core.rates import training_ranks
from eaglet.stages.scripting import run_stage
from eaglet.stages.train.loop import launch_torchrun, train
from eaglet.stages.train.stream import stream_devices
from eaglet.target.checkpoint import read_target
from eaglet.tools.model_card import write_card

smk = snakemake  # noqa: F821 (injected by Snakemake)
target = read_target(smk.input.target)
args = {
    # the settings that change the drafter (params), and those that only decide how the run
    # goes (core.config.RUN_ONLY), from the config
    "cfg": {**smk.config["train"], **smk.params.train},
    "shard_paths": list(smk.input.shards),
    "eval_shard_paths": list(smk.input.eval_shards),
    "vocab_map": smk.input.vocab,
    "target_dir": target["path"],
    "rate_key": target["spec"],
    "out_dir": str(Path(smk.output.weights).parent),
    "checkpoint_dir": smk.params.checkpoints,
    "progress_path": smk.params.progress,
    "log_path": smk.log[0],
    "manifest": smk.input.manifest,
}
if "start" in smk.input.keys():  # train.init_from: the drafter rule start_drafter wrote
    args["cfg"]["init_from"] = str(Path(smk.input.start).parent)
stream = smk.params.get("stream")
if stream is not None:  # train.data stream (eaglet.stages.train.stream)
    cfg = {
        "extract": {**smk.config["extract"], **stream["extract"]},
        "target": stream["target"],
        "server": smk.config["server"],
        "generate": smk.config["generate"],
        # whether training has GPUs of its own (train_stream.overlaps)
        "train": {"gpus": smk.config["train"]["gpus"]},
    }
    args["stream"] = {
        "cfg": cfg,
        "target_json": smk.input.target,
        "data": smk.input.data,
        "work_dir": stream["work"],
        "server_log": smk.log.server,
    }
gpus = int(smk.resources.get("gpu", 0))
# processes of the training, one per GPU of its own; a streaming job's resource counts the
# server's GPUs too, and with train.gpus 0 the trainer puts a rank on each of the server's
nproc = training_ranks(smk.config) if gpus else 1


def body() -> None:
    if stream is not None:  # the server's GPUs and the trainer's, apart (hold_gpus set them)
        args["stream"]["server_devices"] = stream_devices(
            smk.config["server"]["gpus"], smk.config["train"]["gpus"]
        )
    if nproc > 1:
        launch_torchrun(args, nproc)
    else:
        train(**args)
    # the exported drafter's model card (not evaluated yet: the evaluation rewrites it)
    write_card(smk.config["results_dir"], smk.config)


run_stage("train", smk.log[0], body, gpus=gpus)
