"""Snakemake entry point of rule train (rules/train.smk).

With resources.gpu > 1 the run starts under torchrun, one data-parallel process per GPU
(eaglet.train.main is the worker); otherwise it trains in this process.
"""
import subprocess
import sys
from pathlib import Path

from eaglet.io import write_json
from eaglet.scripting import run_stage
from eaglet.target import read_target
from eaglet.train import train

smk = snakemake  # noqa: F821 (injected by Snakemake)
target = read_target(smk.input.target)
args = {"cfg": dict(smk.params.train), "shard_paths": list(smk.input.shards),
        "eval_shard_paths": list(smk.input.eval_shards), "vocab_map": smk.input.vocab,
        "target_dir": target["path"], "rate_key": target["spec"],
        "out_dir": str(Path(smk.output.weights).parent), "checkpoint_dir": smk.params.checkpoints,
        "progress_path": smk.params.progress, "log_path": smk.log[0],
        "manifest": smk.input.manifest}
gpus = int(smk.resources.get("gpu", 0))


def torchrun() -> None:
    args_path = Path(args["checkpoint_dir"]) / "torchrun_args.json"
    write_json(args_path, args)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={gpus}", "-m", "eaglet.train", str(args_path)], check=True)


run_stage("train", smk.log[0], torchrun if gpus > 1 else lambda: train(**args))
