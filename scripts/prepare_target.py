"""Snakemake entry point of rule prepare_target."""

from eaglet.core.methods import words
from eaglet.engine.support import require_drafter_support
from eaglet.stages.scripting import run_stage
from eaglet.target.checkpoint import prepare_target

smk = snakemake  # noqa: F821 (injected by Snakemake)
# the settings checked against the target come from the config, not params: changing them
# must not redo this stage (and so everything after it); the Snakefile checks them too
# and vLLM is asked whether it serves the run's drafter for the target, before any server starts
run_stage(
    "prepare_target",
    smk.log[0],
    lambda: require_drafter_support(
        prepare_target(
            smk.params.model,
            smk.params.out_dir,
            draft_vocab_size=smk.config["vocab"]["draft_vocab_size"],
            aux_layer_ids=smk.config["extract"]["aux_layer_ids"],
        )["path"]
        + "/config.json",
        words(smk.config["train"]["method"]),
        smk.params.model,
    ),
)
