"""Snakemake entry point of rule extract_vllm (every shard from one vLLM server)."""

from eaglet.stages.extract.vllm import run_stage as run_extract
from eaglet.stages.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
cfg = {
    "extract": {**smk.config["extract"], **smk.params.extract},
    "target": smk.params.target,
    "server": smk.config["server"],
    "generate": smk.config["generate"],
}
splits = {
    "train": {
        "data": smk.input.train,
        "shards": list(smk.output.shards),
        "metas": list(smk.output.metas),
    },
    "eval": {
        "data": smk.input.eval,
        "shards": list(smk.output.eval_shards),
        "metas": list(smk.output.eval_metas),
    },
}
run_stage(
    "extract",
    smk.log.main,
    lambda: run_extract(
        cfg,
        smk.input.target,
        splits,
        work_dir=smk.params.work,
        server_log=smk.log.server,
        progress_path=smk.params.progress,
        log_path=smk.log.main,
    ),
    gpus=smk.resources.get("gpu", 0),
)
