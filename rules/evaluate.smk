rule evaluate:
    """Serve the target with vLLM: alone, with ngram speculation, and with the drafter at
    every k, each run at every concurrency of the sweep on every prompt set, at every
    temperature of evaluate.temperature; measure acceptance from the /metrics counters and
    the speedups; derive (at the last temperature, the served one), write and check the
    batch-size schedule of k (serve.json); replay the drafter offline (exactly at 0, its
    expected acceptance above)."""
    input:
        target=f"{R}/target/target.json",
        drafter=f"{R}/drafter/model.safetensors",
        drafter_config=f"{R}/drafter/config.json",
        prompts=f"{R}/prompts/eval.jsonl",
        train_prompts=f"{R}/prompts/train.jsonl",
        prompt_sets=[s["source"]["path"] for s in config["evaluate"]["prompt_sets"]
                     if s["source"].get("path")],
        # the offline replay reads the target's states of the held-out answers from here
        **({"held_out": hidden_files("eval", ".safetensors")} if config["evaluate"]["offline"]
           else {}),
        # drafters served beside this run's for comparison: a new export reruns the sweep
        compared=[f"{d}/model.safetensors" for d in config["evaluate"]["compare_drafters"]],
    output:
        acceptance=report(
            f"{R}/eval/acceptance.json",
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
        serve=f"{R}/eval/serve.json",
    params:
        evaluate=stage_params(config, "evaluate"),
        target=config["target"],
        # prompts render through the chat template as generation rendered them
        **({"chat_template_kwargs": config["generate"]["chat_template_kwargs"]}
           if config["generate"]["chat_template_kwargs"] else {}),
        log_dir=f"{R}/logs",
        progress=f"{R}/progress/evaluate.json",
    threads: MODEL_THREADS
    resources:
        **job_resources("evaluate", config["server"]["gpus"]),
    log:
        f"{R}/logs/evaluate.log",
    conda:
        MODEL_ENV
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
        speedup=report(f"{R}/eval/speedup.png",
                       caption="../report/speedup.rst", category="Evaluation"),
        training=report(f"{R}/eval/training_curves.png",
                        caption="../report/training_curves.rst", category="Training"),
        summary=report(f"{R}/eval/summary.csv",
                       caption="../report/summary.rst", category="Evaluation"),
    log:
        f"{R}/logs/plots.log",
    conda:
        CPU_ENV
    script:
        "../scripts/plots.py"
