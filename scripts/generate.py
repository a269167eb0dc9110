"""Snakemake entry point of rule generate."""

from eaglet.stages.generate.stage import run_stage as generate_stage
from eaglet.stages.scripting import run_stage

smk = snakemake  # noqa: F821 (injected by Snakemake)
capture = smk.params.get("capture")
cfg = {
    "target": smk.params.target,
    "server": smk.config["server"],
    "generate": {**smk.config["generate"], **smk.params.generate},
    "extract": {"aux_layer_ids": capture["aux_layer_ids"] if capture else None},
}
run_stage(
    "generate",
    smk.log.main,
    lambda: generate_stage(
        cfg,
        target_json=smk.input.target,
        prompts={"train": smk.input.train, "eval": smk.input.eval},
        outputs={"train": smk.output.train, "eval": smk.output.eval},
        stats_path=smk.output.stats,
        partial_path=smk.params.partial,
        progress_path=smk.params.progress,
        log_path=smk.log.main,
        server_log_path=smk.log.server,
        capture_dir=capture["dir"] if capture else None,
    ),
    gpus=smk.resources.get("gpu", 0),
)
