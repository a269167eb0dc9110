"""The extraction stage: the target's hidden states of every training and held-out sequence,
packed into shards (``hidden/shard_{i:05d}.safetensors``) with what the drafter learns from.

Two backends compute the states: :mod:`eaglet.stages.extract.hf` runs the target with
transformers (one job per shard, or one for all), :mod:`eaglet.stages.extract.vllm` asks the
serving engine through one capture server for all shards (or packs what generation captured).
:mod:`eaglet.stages.extract.manifest` verifies the shards of either, re-extracts the ones that
fail and writes ``hidden/manifest.json``. What both backends share (the teacher check, the
shard write, the checks before extraction) is :mod:`eaglet.target.states`.
"""
