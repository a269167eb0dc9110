rule evaluate:
    """Serve the target with vLLM: alone, with ngram speculation, and with the drafter at
    every k; measure acceptance from the /metrics counters and the speedup."""
    input:
        target=f"{R}/target/target.json",
        drafter=f"{R}/drafter/model.safetensors",
        drafter_config=f"{R}/drafter/config.json",
        prompts=f"{R}/prompts/eval.jsonl",
    output:
        report(
            f"{R}/eval/acceptance.json",
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
    params:
        evaluate=config["evaluate"],
        target=config["target"],
        log_dir=f"{R}/logs",
        progress=f"{R}/progress/evaluate.json",
    resources:
        gpu=config["server"]["gpus"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
        runtime=config["resources"]["evaluate"]["runtime"],
    log:
        f"{R}/logs/evaluate.log",
    conda:
        ENV
    script:
        "../scripts/evaluate.py"


rule plots:
    """Redraw every figure from existing results; runs no model."""
    input:
        acceptance=f"{R}/eval/acceptance.json",
        training_log=f"{R}/drafter/training_log.csv",
    output:
        per_position=report(f"{R}/eval/per_position.png",
                            caption="../report/per_position.rst", category="Evaluation"),
        acceptance_length=report(f"{R}/eval/acceptance_length.png",
                                 caption="../report/acceptance_length.rst",
                                 category="Evaluation"),
        throughput=report(f"{R}/eval/throughput.png",
                          caption="../report/throughput.rst", category="Evaluation"),
        training=report(f"{R}/eval/training_curves.png",
                        caption="../report/training_curves.rst", category="Training"),
    log:
        f"{R}/logs/plots.log",
    conda:
        ENV
    script:
        "../scripts/plots.py"
