# scaling.enabled: what more data buys, predicted (eaglet.stages.scaling); the Snakefile asks for
# eval/scaling.json only then.
import re

SCALING = config["scaling"]
SCALING_FRACTIONS = [layout.fraction_name(f) for f in SCALING["fractions"]]


rule scaling_train:
    """Train the drafter on a nested subset of the training samples (scaling.fractions) with
    the full run's train settings, under scaling/<fraction>/ (eaglet.stages.scaling)."""
    input:
        target=f"{R}/{layout.TARGET_JSON}",
        manifest=f"{R}/{layout.MANIFEST}",
        shards=hidden_files("train", ".safetensors"),
        eval_shards=hidden_files("eval", ".safetensors"),
        vocab=f"{R}/{layout.VOCAB_MAP}",
        settings=settings_file("train", TRAIN_SETTINGS),
    output:
        stats=f"{R}/{layout.SCALING_RUNS}/{{fraction}}/stats.json",
        subset=f"{R}/{layout.SCALING_RUNS}/{{fraction}}/subset.json",
    log:
        f"{R}/{layout.LOGS}/scaling/train_{{fraction}}.log",
    wildcard_constraints:
        fraction="|".join(re.escape(f) for f in SCALING_FRACTIONS) or "(?!)",
    # after the stages the verdict needs: the subsets only add the prediction
    priority: -1
    conda:
        MODEL_ENV
    threads: MODEL_THREADS
    resources:
        **job_resources("train", config["train"]["gpus"]),
    params:
        train=stage_params(config, "train", drop=("gpus",)),
        checkpoints=lambda w: f"{R}/{layout.SCALING_RUNS}/{w.fraction}/checkpoints",
        progress=lambda w: f"{R}/{layout.PROGRESS}/scaling_{w.fraction}.json",
    script:
        "../scripts/scaling.py"


rule scaling:
    """Fit held-out simulated AL against ln(training tokens) over the subsets and the full
    run, and predict the training tokens scaling.target_al needs (eval/scaling.json)."""
    input:
        subsets=expand(
            f"{R}/{layout.SCALING_RUNS}/{{fraction}}/stats.json", fraction=SCALING_FRACTIONS
        ),
        records=expand(
            f"{R}/{layout.SCALING_RUNS}/{{fraction}}/subset.json", fraction=SCALING_FRACTIONS
        ),
        # the full run's point: drafter/stats.json, written beside its weights
        full=f"{R}/{layout.DRAFTER_WEIGHTS}",
        target=f"{R}/{layout.TARGET_JSON}",
        synthetic=f"{R}/{layout.SYNTHETIC_STATS}",
        shards=hidden_files("train", ".safetensors"),
    output:
        f"{R}/{layout.SCALING}",
    log:
        f"{R}/{layout.LOGS}/scaling/fit.log",
    conda:
        CPU_ENV
    params:
        max_len=config["train"]["max_len"] or config["train"]["max_tokens_per_batch"],
        target_al=SCALING["target_al"],
        # generation's GPUs: the prediction's hours are GPU-hours where it held any
        gpus=config["server"]["gpus"],
    script:
        "../scripts/scaling.py"
