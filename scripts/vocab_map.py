"""Snakemake entry point of rule vocab_map: the draft vocabulary from the data, or the starting
drafter's (train.init_from) with its coverage of the data."""

import torch
from safetensors.torch import load_file

from eaglet.core.io import read_jsonl
from eaglet.data.vocab import adopt_vocab_map, build_vocab_map
from eaglet.stages.scripting import run_stage
from eaglet.target.checkpoint import load_text_config, read_target

smk = snakemake  # noqa: F821 (injected by Snakemake)


def body() -> dict:
    records = read_jsonl(smk.input.data)
    if "start" in smk.input.keys():  # the starting drafter's map: its lm_head rows are those
        weights = load_file(smk.input.start)
        d2t = weights.get(
            "d2t", torch.zeros(int(weights["lm_head.weight"].shape[0]), dtype=torch.int64)
        )  # a full vocabulary
        return adopt_vocab_map(
            records,
            d2t,
            weights["t2d"],
            smk.config["train"]["init_from"],
            out_path=smk.output.map,
            stats_path=smk.output.stats,
        )
    return build_vocab_map(
        records,
        vocab_size=load_text_config(read_target(smk.input.target)["path"])["vocab_size"],
        draft_vocab_size=smk.params.draft_vocab_size,
        out_path=smk.output.map,
        stats_path=smk.output.stats,
        # a gate, not an input of the map: read from the config, so that changing it reruns
        # nothing
        min_coverage=smk.config["vocab"]["min_coverage"],
    )


run_stage("vocab_map", smk.log[0], body)
