"""Snakemake entry point of rule vocab_map."""
from eaglet.core.io import read_jsonl
from eaglet.data.vocab import build_vocab_map
from eaglet.stages.scripting import run_stage
from eaglet.target.checkpoint import load_text_config, read_target

smk = snakemake  # noqa: F821 (injected by Snakemake)
run_stage("vocab_map", smk.log[0], lambda: build_vocab_map(
    read_jsonl(smk.input.data),
    vocab_size=load_text_config(read_target(smk.input.target)["path"])["vocab_size"],
    draft_vocab_size=smk.params.draft_vocab_size,
    out_path=smk.output.map, stats_path=smk.output.stats,
    # a gate, not an input of the map: read from the config, so that changing it reruns nothing
    min_coverage=smk.config["vocab"]["min_coverage"]))
