"""Snakemake entry point of rule hidden_manifest."""

from eaglet.stages.extract.manifest import build_manifest
from eaglet.stages.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
cfg = {
    "extract": {**smk.config["extract"], **smk.params.extract},
    "target": smk.params.target,
    "server": smk.config["server"],
    "generate": smk.config["generate"],
}
run_stage(
    "hidden_manifest",
    smk.log[0],
    lambda: build_manifest(
        cfg,
        smk.input.target,
        smk.input.data,
        num_shards=smk.params.num_shards,
        hidden_dir=smk.params.hidden_dir,
        manifest_path=smk.output[0],
        eval_data_path=smk.input.eval_data,
        num_eval_shards=len(smk.input.eval_shards),
    ),
    gpus=smk.resources.get("gpu", 0),
)
