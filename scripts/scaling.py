"""Snakemake entry point of rules scaling_train and scaling (rules/scaling.smk)."""

from pathlib import Path

from eaglet.stages.scaling import train_subset, write_prediction
from eaglet.stages.scripting import run_stage
from eaglet.target.checkpoint import read_target

smk = snakemake  # noqa: F821 (injected by Snakemake)

if smk.rule == "scaling_train":
    gpus = int(smk.resources.get("gpu", 0))
    run_stage(
        "scaling",
        smk.log[0],
        lambda: train_subset(
            {**smk.config["train"], **smk.params.train},  # RUN_ONLY settings from the config
            float(smk.wildcards.fraction),
            list(smk.input.shards),
            list(smk.input.eval_shards),
            smk.input.vocab,
            read_target(smk.input.target)["path"],
            str(Path(smk.output.stats).parent),
            smk.params.checkpoints,
            smk.params.progress,
            smk.log[0],
            smk.input.manifest,
            gpus,
        ),
        gpus=gpus,
    )
else:
    results = Path(smk.input.full).parent.parent
    run_stage(
        "scaling",
        smk.log[0],
        lambda: write_prediction(
            results,
            [Path(p).parent for p in smk.input.subsets],
            list(smk.input.shards),
            smk.params.max_len,
            smk.params.target_al,
            smk.output[0],
            smk.params.gpus,
        ),
    )
