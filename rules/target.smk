rule prepare_target:
    """Resolve the target model; dequantize the embedded default into an HF directory."""
    output:
        f"{R}/target/target.json",
    params:
        model=config["target"]["model"],
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    log:
        f"{R}/logs/prepare_target.log",
    conda:
        CPU_ENV
    script:
        "../scripts/prepare_target.py"
