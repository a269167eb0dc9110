"""Snakemake entry point of rule evaluate."""

from pathlib import Path

from eaglet.stages.evaluate.stage import run_stage as evaluate_stage
from eaglet.stages.scripting import run_stage
from eaglet.tools.model_card import write_card

smk = snakemake  # noqa: F821 (injected by Snakemake)
cfg = {
    "evaluate": {**smk.config["evaluate"], **smk.params.evaluate},
    "target": smk.params.target,
    "server": smk.config["server"],
    "generate": {"chat_template_kwargs": smk.params.get("chat_template_kwargs")},
}


def body() -> None:
    evaluate_stage(
        cfg,
        smk.input.target,
        str(Path(smk.input.drafter).parent.resolve()),
        smk.input.prompts,
        smk.output.acceptance,
        smk.params.log_dir,
        progress_path=smk.params.progress,
        log_path=smk.log[0],
        serve_path=smk.output.serve,
        train_prompts_path=smk.input.train_prompts,
        held_out_paths=list(smk.input.get("held_out", [])),
    )
    # the drafter's model card, now with the verdict and the serve config
    write_card(smk.config["results_dir"], smk.config)


# its engine runs are measured together (their speedups compare like with like): a rerun
# measures them all again
run_stage("evaluate", smk.log[0], body, gpus=smk.resources.get("gpu", 0), resumes=False)
