"""Snakemake entry point of rule train (rules/train.smk).

With resources.gpu > 1 the run starts under torchrun, one data-parallel process per GPU
(eaglet.train.main is the worker); otherwise it trains in this process.
"""
from pathlib import Path

from eaglet.scripting import run_stage
from eaglet.target import read_target
from eaglet.train import launch_torchrun, train

smk = snakemake  # noqa: F821 (injected by Snakemake)
target = read_target(smk.input.target)
args = {"cfg": dict(smk.params.train), "shard_paths": list(smk.input.shards),
        "eval_shard_paths": list(smk.input.eval_shards), "vocab_map": smk.input.vocab,
        "target_dir": target["path"], "rate_key": target["spec"],
        "out_dir": str(Path(smk.output.weights).parent), "checkpoint_dir": smk.params.checkpoints,
        "progress_path": smk.params.progress, "log_path": smk.log[0],
        "manifest": smk.input.manifest}
stream = smk.params.get("stream")
if stream is not None:  # train.data stream (eaglet.train_stream)
    cfg = {"extract": {**smk.config["extract"], **stream["extract"]}, "target": stream["target"],
           "server": smk.config["server"], "generate": smk.config["generate"]}
    args["stream"] = {"cfg": cfg, "target_json": smk.input.target, "data": smk.input.data,
                      "work_dir": stream["work"], "server_log": smk.log.server}
gpus = int(smk.resources.get("gpu", 0))
# processes of the training: its own GPUs (a streaming job's resource counts the server's too)
nproc = gpus if stream is None else 1


run_stage("train", smk.log[0],
          (lambda: launch_torchrun(args, nproc)) if nproc > 1 else lambda: train(**args),
          gpus=gpus)
