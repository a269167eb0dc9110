rule vocab_map:
    """Draft vocabulary: the most frequent completion tokens, as vLLM's d2t/t2d maps."""
    input:
        target=f"{R}/target/target.json",
        data=f"{R}/synthetic/train.jsonl",
    output:
        map=f"{R}/vocab/vocab_map.safetensors",
        stats=f"{R}/vocab/stats.json",
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
    log:
        f"{R}/logs/vocab_map.log",
    conda:
        CPU_ENV
    script:
        "../scripts/vocab_map.py"
