# Hidden states. Backend hf: one job per shard, extract.num_shards for the training samples,
# one for the held-out samples. Backend vllm: one job (one server) writes the same files.
# generate.capture_hidden_states: generation saved the states already; the vllm rule packs
# them (and starts a server only for samples whose states are missing).
# Each job declares the GPUs it holds, so it never overlaps another GPU stage.
TRAIN_SHARDS = [f"{i:05d}" for i in range(config["extract"]["num_shards"])]
EXTRACT_PARAMS = dict(
    extract={k: v for k, v in config["extract"].items() if k not in ("gpus", "device", "concurrency")},
    target=config["target"],
)
FROM_VLLM = config["extract"]["backend"] == "vllm" or CAPTURE
# backend vllm: the server holds the GPUs (server.gpus), for every shard at once
EXTRACT_GPUS = config["server"]["gpus"] if FROM_VLLM else config["extract"]["gpus"]


if FROM_VLLM:

    rule extract_vllm:
        """Hidden states of every shard (train and held-out) from one vLLM server: each
        sequence is a prefill request whose states eaglet's connector saves. Finished
        requests and packed shards under hidden/vllm/ survive an interruption."""
        input:
            target=f"{R}/target/target.json",
            train=f"{R}/synthetic/train.jsonl",
            eval=f"{R}/synthetic/eval.jsonl",
        output:
            shards=expand(f"{R}/hidden/shard_{{i}}.safetensors", i=TRAIN_SHARDS),
            metas=expand(f"{R}/hidden/shard_{{i}}.json", i=TRAIN_SHARDS),
            eval_shard=f"{R}/hidden/eval/shard_00000.safetensors",
            eval_meta=f"{R}/hidden/eval/shard_00000.json",
        params:
            **EXTRACT_PARAMS,
            server=config["server"],
            generate=GENERATE_PARAMS["generate"],
            work=f"{R}/hidden/vllm",
            progress=f"{R}/progress/extract_vllm.json",
        resources:
            gpu=EXTRACT_GPUS,
            mem_mb=config["resources"]["extract"]["mem_mb"],
            runtime=config["resources"]["extract"]["runtime"],
        log:
            main=f"{R}/logs/extract/vllm.log",
            server=f"{R}/logs/extract/vllm.server.log",
        conda:
            ENV
        script:
            "../scripts/extract_vllm.py"


else:

    rule extract:
        """Hidden states of training shard {wildcards.i}."""
        input:
            target=f"{R}/target/target.json",
            data=f"{R}/synthetic/train.jsonl",
        output:
            shard=f"{R}/hidden/shard_{{i}}.safetensors",
            meta=f"{R}/hidden/shard_{{i}}.json",
        wildcard_constraints:
            i=r"\d{5}",
        params:
            **EXTRACT_PARAMS,
            num_shards=len(TRAIN_SHARDS),
            progress=lambda w: f"{R}/progress/extract_{w.i}.json",
        resources:
            gpu=config["extract"]["gpus"],
            mem_mb=config["resources"]["extract"]["mem_mb"],
            runtime=config["resources"]["extract"]["runtime"],
        log:
            f"{R}/logs/extract/shard_{{i}}.log",
        conda:
            ENV
        script:
            "../scripts/extract.py"


    rule extract_eval:
        """Hidden states of the held-out samples (the drafter's validation set)."""
        input:
            target=f"{R}/target/target.json",
            data=f"{R}/synthetic/eval.jsonl",
        output:
            shard=f"{R}/hidden/eval/shard_{{i}}.safetensors",
            meta=f"{R}/hidden/eval/shard_{{i}}.json",
        wildcard_constraints:
            i=r"\d{5}",
        params:
            **EXTRACT_PARAMS,
            num_shards=1,
            progress=lambda w: f"{R}/progress/extract_eval.json",
        resources:
            gpu=config["extract"]["gpus"],
            mem_mb=config["resources"]["extract"]["mem_mb"],
            runtime=config["resources"]["extract"]["runtime"],
        log:
            f"{R}/logs/extract/eval_shard_{{i}}.log",
        conda:
            ENV
        script:
            "../scripts/extract.py"


rule hidden_manifest:
    """Verify every shard, the held-out one too (hash, layers, dtype, target), re-extract any
    that fail, and list them with their sha256 and teacher agreement."""
    input:
        target=f"{R}/target/target.json",
        data=f"{R}/synthetic/train.jsonl",
        shards=expand(f"{R}/hidden/shard_{{i}}.safetensors", i=TRAIN_SHARDS),
        metas=expand(f"{R}/hidden/shard_{{i}}.json", i=TRAIN_SHARDS),
        eval_data=f"{R}/synthetic/eval.jsonl",
        eval_shards=[f"{R}/hidden/eval/shard_00000.safetensors"],
        eval_metas=[f"{R}/hidden/eval/shard_00000.json"],
    output:
        f"{R}/hidden/manifest.json",
    params:
        **EXTRACT_PARAMS,
        num_shards=len(TRAIN_SHARDS),
        hidden_dir=lambda wildcards, output: os.path.dirname(output[0]),
        server=config["server"],
        generate=GENERATE_PARAMS["generate"],
    resources:
        gpu=EXTRACT_GPUS,
        mem_mb=config["resources"]["extract"]["mem_mb"],
        runtime=config["resources"]["extract"]["runtime"],
    log:
        f"{R}/logs/hidden_manifest.log",
    conda:
        ENV
    script:
        "../scripts/hidden_manifest.py"
