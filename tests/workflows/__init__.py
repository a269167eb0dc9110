"""Small test workflows and helpers that run snakemake on them."""
