"""Snakemake entry point of rule start_drafter (train.init_from): the starting drafter, read in
its own format, checked against the target and written in eaglet's export layout, with the
record of which tensors came from it."""

from pathlib import Path

from eaglet.core.io import write_json
from eaglet.model.published import convert, read
from eaglet.stages.scripting import run_stage
from eaglet.target.checkpoint import read_target

smk = snakemake  # noqa: F821 (injected by Snakemake)


def body() -> dict:
    out = Path(smk.output.weights).parent
    record = convert(
        read(smk.params.init_from), read_target(smk.input.target)["path"], out, seed=smk.params.seed
    )
    write_json(smk.output.record, record)
    return record


run_stage("start_drafter", smk.log[0], body)
