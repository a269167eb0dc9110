"""Snakemake entry point of rule plots (redraws figures from results; runs no model)."""

from eaglet.stages.scripting import run_stage
from eaglet.tools.plots import draw_all

smk = snakemake  # noqa: F821 (injected by Snakemake)
run_stage(
    "plots",
    smk.log[0],
    lambda: draw_all(
        smk.input.acceptance,
        smk.input.training_log,
        {
            name: smk.output[name]
            for name in ("per_position", "acceptance_length", "speedup", "training", "summary")
        },
    ),
)
