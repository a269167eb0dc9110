EVALUATE_SETTINGS = dict(
    evaluate=stage_params(config, "evaluate"),
    target=config["target"],
    # prompts render through the chat template as generation rendered them
    **(
        {"chat_template_kwargs": config["generate"]["chat_template_kwargs"]}
        if config["generate"]["chat_template_kwargs"]
        else {}
    ),
)


rule evaluate:
    """Serve the target with vLLM: alone, with ngram speculation, and with the drafter at
    every k, each run at every concurrency of the sweep on every prompt set, at every
    temperature of evaluate.temperature; measure acceptance from the /metrics counters and
    the speedups; derive (at the last temperature, the served one), write and check the
    batch-size schedule of k (serve.json); replay the drafter offline (exactly at 0, its
    expected acceptance above)."""
    input:
        # the offline replay reads the target's states of the held-out answers from here
        # (** entries first: snakefmt puts them there, and would leave comments behind)
        **(
            {"held_out": hidden_files("eval", ".safetensors")}
            if config["evaluate"]["offline"]
            else {}
        ),
        target=f"{R}/{layout.TARGET_JSON}",
        drafter=f"{R}/{layout.DRAFTER_WEIGHTS}",
        drafter_config=f"{R}/{layout.DRAFTER_CONFIG}",
        prompts=f"{R}/{layout.PROMPTS_EVAL}",
        train_prompts=f"{R}/{layout.PROMPTS_TRAIN}",
        prompt_sets=[
            s["source"]["path"]
            for s in config["evaluate"]["prompt_sets"]
            if s["source"].get("path")
        ],
        # drafters served beside this run's for comparison: a new export reruns the sweep
        compared=[f"{d}/model.safetensors" for d in config["evaluate"]["compare_drafters"]],
        settings=settings_file("evaluate", EVALUATE_SETTINGS),
    output:
        acceptance=report(
            f"{R}/{layout.ACCEPTANCE}",
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
        serve=f"{R}/{layout.SERVE}",
    log:
        f"{R}/{layout.log_file('evaluate')}",
    conda:
        MODEL_ENV
    threads: MODEL_THREADS
    resources:
        **job_resources("evaluate", config["server"]["gpus"]),
    params:
        **EVALUATE_SETTINGS,
        log_dir=f"{R}/{layout.LOGS}",
        progress=f"{R}/{layout.progress_file('evaluate')}",
    script:
        "../scripts/evaluate.py"


rule plots:
    """Redraw every figure from existing results; runs no model."""
    input:
        acceptance=f"{R}/{layout.ACCEPTANCE}",
        training_log=f"{R}/{layout.TRAINING_LOG}",
    output:
        per_position=report(
            f"{R}/{layout.PER_POSITION_PNG}",
            caption="../report/per_position.rst",
            category="Evaluation",
        ),
        acceptance_length=report(
            f"{R}/{layout.ACCEPTANCE_LENGTH_PNG}",
            caption="../report/acceptance_length.rst",
            category="Evaluation",
        ),
        speedup=report(
            f"{R}/{layout.SPEEDUP_PNG}", caption="../report/speedup.rst", category="Evaluation"
        ),
        training=report(
            f"{R}/{layout.TRAINING_CURVES_PNG}",
            caption="../report/training_curves.rst",
            category="Training",
        ),
        summary=report(
            f"{R}/{layout.SUMMARY}", caption="../report/summary.rst", category="Evaluation"
        ),
    log:
        f"{R}/{layout.log_file('plots')}",
    conda:
        CPU_ENV
    script:
        "../scripts/plots.py"
