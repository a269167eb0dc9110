# generate.capture_hidden_states: the server saves every answer's hidden states where the
# vllm extraction rule packs them from.
CAPTURE = config["generate"]["capture_hidden_states"]
GENERATE_PARAMS = dict(
    generate=stage_params(config, "generate"),
    **({"capture": {"dir": f"{R}/hidden/vllm/requests",
                    "aux_layer_ids": config["extract"]["aux_layer_ids"]}} if CAPTURE else {}),
)


rule generate:
    """Serve the target with vLLM and keep exactly what it answers to every prompt (the
    eval split too: its answers are the drafter's held-out set). Resumes from
    synthetic/generate.partial.jsonl after an interruption."""
    input:
        target=f"{R}/target/target.json",
        train=f"{R}/prompts/train.jsonl",
        eval=f"{R}/prompts/eval.jsonl",
    output:
        train=f"{R}/synthetic/train.jsonl",
        eval=f"{R}/synthetic/eval.jsonl",
        stats=f"{R}/synthetic/stats.json",
    params:
        # what changes the samples; server lifecycle settings are read from config
        target=config["target"],
        **GENERATE_PARAMS,
        partial=f"{R}/synthetic/generate.partial.jsonl",
        progress=f"{R}/progress/generate.json",
    resources:
        gpu=config["server"]["gpus"],
        mem_mb=config["resources"]["generate"]["mem_mb"],
        runtime=config["resources"]["generate"]["runtime"],
    log:
        main=f"{R}/logs/generate.log",
        server=f"{R}/logs/generate.server.log",
    conda:
        ENV
    script:
        "../scripts/generate.py"
