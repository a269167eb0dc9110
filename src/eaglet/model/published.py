"""A published drafter to start training from (``train.init_from``), in any format a user
finds, read from its files (never from a repository's name):

- eaglet's own export and vLLM's EAGLE-3 layout: ``config.json`` with ``eagle_config`` (or
  the P-EAGLE flag, or DFlash's architecture) and ``model.safetensors``;
- the speculators format: ``config.json`` with ``speculators_config``, the layer's shape in
  ``transformer_layer_config`` and the EAGLE-3 fields at the top;
- the EAGLE authors' checkpoints: a Llama ``config.json`` with ``draft_vocab_size`` and
  ``pytorch_model.bin`` (no aux layer ids: vLLM's default layers of the target);
- SpecForge's output: the same config with ``model.safetensors``.

Every EAGLE-3 format names the layer's tensors as vLLM's loader reads them: ``midlayer.`` or
``layers.0.``, optionally under ``model.``; ``embed_tokens`` (the target's, which vLLM shares)
and a verifier's head are not the drafter's own and are left out, said so.

:func:`read` is torch-free (the Snakefile reads the run's settings from it); :func:`convert`
writes the drafter in eaglet's export layout, reporting which tensors came from the drafter and
which start new.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.core import methods
from eaglet.core.io import read_json
from eaglet.model.config import MLA_FIELDS, NORM_FLAGS, norm_flags
from eaglet.target.checkpoint import safetensors_tensors

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# tensors a published EAGLE-3 checkpoint may hold that are not the drafter's own
NOT_THE_DRAFTERS = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")


class DrafterFormatError(ValueError):
    """A starting drafter that cannot be read, or does not fit the run's target."""


@dataclass
class Published:
    """A starting drafter as read from its files."""

    path: Path
    format: str  # in words
    config: dict  # its config as eaglet exports it (vLLM's EAGLE-3 config.json)
    method: methods.Method
    weights: list[Path] = field(default_factory=list)

    @property
    def aux_layer_ids(self) -> list[int] | None:
        """The target layers it reads (None: vLLM's default layers of the target)."""
        return (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")

    @property
    def attention(self) -> str:
        return "mla" if self.config.get("model_type") == "deepseek_v2" else "llama"

    def settings(self) -> dict[str, object]:
        """The run's settings it decides (dotted keys): its method, variant, attention, depth,
        draft vocabulary and the target layers it reads."""
        out = {
            "train.method": self.method.name,
            "train.drafter_variant": methods.variant_of(norm_flags(self.config)).name,
            "train.drafter_attention": self.attention,
            "vocab.draft_vocab_size": self.config["draft_vocab_size"],
        }
        if self.method.block:
            out["train.dflash_layers"] = self.config.get("num_hidden_layers", 1)
        if self.aux_layer_ids is not None:
            out["extract.aux_layer_ids"] = list(self.aux_layer_ids)
        return out


# how much of each weight file the fingerprint reads, at its start, middle and end
FINGERPRINT_BYTES = 1 << 20


def fingerprint(spec: str | os.PathLike) -> dict[str, str]:
    """What identifies the files of the starting drafter ``spec`` names, so that another
    drafter put under the same name reruns the start and the training after it: config.json's
    sha256, and each weight file's size with the sha256 of its first, middle and last
    :data:`FINGERPRINT_BYTES` (the safetensors header, the tensors' layout, and weights at
    three places: another drafter differs there). Every Snakefile parse computes it, so a
    drafter of gigabytes is not read whole."""
    published = read(spec)
    out = {"config.json": hashlib.sha256((published.path / "config.json").read_bytes()).hexdigest()}
    for path in published.weights:
        size = path.stat().st_size
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for offset in sorted({0, max(0, size // 2), max(0, size - FINGERPRINT_BYTES)}):
                handle.seek(offset)
                digest.update(handle.read(FINGERPRINT_BYTES))
        out[path.name] = f"{size} {digest.hexdigest()}"
    return out


def locate(spec: str) -> Path:
    """The local directory of ``train.init_from``: a directory, else a Hugging Face id
    downloaded into the HF cache (its config and weights)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if spec.startswith(("/", ".", "~")) or spec.count("/") != 1 or path.exists():
        raise DrafterFormatError(
            f"train.init_from {spec!r}: no directory there (a Hugging Face "
            f"id reads organization/name)"
        )
    if path.parent.is_dir():  # organization/name, where "organization" is a local directory
        held = sorted(p.name for p in path.parent.iterdir() if p.is_dir())
        raise DrafterFormatError(
            f"train.init_from {spec!r}: no directory {path.resolve()} (its parent holds "
            f"{', '.join(held[:8]) or 'no directory'}); for a Hugging Face id of the same "
            f"spelling, run from a directory without a {path.parent} in it"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.pt"])
        )
    except Exception as error:  # offline, gated, or a typo
        raise DrafterFormatError(
            f"train.init_from {spec!r}: no directory {path.resolve()}, and it could not be "
            f"got from the Hugging Face hub ({error}). Check the path or the id, log in for a "
            f"gated repository (`huggingface-cli login`), or download it and set "
            f"train.init_from to the local directory"
        ) from error


def read(spec: str | os.PathLike) -> Published:
    """The starting drafter ``spec`` names (a directory or a hub id), its format read from its
    files."""
    path = locate(str(spec))
    config_path = path / "config.json"
    if not config_path.is_file():
        raise DrafterFormatError(
            f"train.init_from {spec}: no config.json in {path}, so it is "
            f"no drafter checkpoint eaglet can read"
        )
    raw = read_json(config_path)
    weights = [path / name for name in WEIGHT_FILES if (path / name).is_file()]
    if not weights:
        weights = sorted(path.glob("model-*.safetensors"))
    if not weights:
        raise DrafterFormatError(
            f"train.init_from {spec}: no weights in {path} (looked for {', '.join(WEIGHT_FILES)})"
        )
    if raw.get("speculators_config"):
        algorithm = raw["speculators_config"].get("algorithm")
        if algorithm != methods.EAGLE3.served_as:
            raise DrafterFormatError(
                f"train.init_from {spec}: a speculators {algorithm!r} "
                f"model; eaglet starts from EAGLE-3 speculators only"
            )
        return Published(path, "speculators", from_speculators(raw), methods.EAGLE3, weights)
    method = methods.from_config(raw)
    if raw.get("eagle_config") or method is not methods.EAGLE3:
        return Published(path, "eaglet / vLLM EAGLE-3 layout", dict(raw), method, weights)
    if "draft_vocab_size" not in raw:
        raise DrafterFormatError(
            f"train.init_from {spec}: its config.json has neither speculators_config nor "
            f"eagle_config nor draft_vocab_size (architectures {raw.get('architectures')}), "
            f"so it is no EAGLE-3 drafter eaglet knows"
        )
    made = (
        "EAGLE original (pytorch_model.bin)"
        if weights[0].suffix == ".bin"
        else "EAGLE-3 checkpoint without eagle_config (SpecForge's or the EAGLE authors')"
    )
    return Published(path, made, from_plain(raw), methods.EAGLE3, weights)


def from_speculators(raw: dict) -> dict:
    """A speculators Eagle-3 config as eaglet's export writes it: the layer's shape from
    ``transformer_layer_config``, the EAGLE-3 fields from the top. A norm flag it omits is
    read as vLLM reads a speculators config: ``norm_before_residual`` true, the others false."""
    layer = dict(raw.get("transformer_layer_config") or {})
    config = {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": raw["draft_vocab_size"],
        "target_hidden_size": raw.get("target_hidden_size") or layer["hidden_size"],
        "eagle_config": {},
    }
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(
            raw["eagle_aux_hidden_state_layer_ids"]
        )
    for flag in NORM_FLAGS:
        config[flag] = bool(raw.get(flag, flag == "norm_before_residual"))
    return _complete(config)


def from_plain(raw: dict) -> dict:
    """An EAGLE-3 config without ``eagle_config`` (the EAGLE authors', SpecForge's) as
    eaglet's export writes it; the aux layers stay unnamed (the target's default)."""
    config = {**raw, "eagle_config": {}}
    config.setdefault("target_hidden_size", raw["hidden_size"])
    return _complete(config)


def _complete(config: dict) -> dict:
    """The fields eaglet's reader needs that a published config may leave to defaults."""
    heads = config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    config.setdefault("head_dim", config["hidden_size"] // heads)
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("max_position_embeddings", 8192)
    return config


def check_fits(published: Published, target: dict) -> None:
    """Refuse a starting drafter that does not fit the target (its text config ``target``),
    naming what differs: it reads the target's hidden states and embedding, and drafts in
    its vocabulary."""
    c, name = published.config, published.path
    problems = []
    for key, want in (
        ("target_hidden_size", target["hidden_size"]),
        ("hidden_size", target["hidden_size"]),
        ("vocab_size", target["vocab_size"]),
    ):
        if c.get(key) is not None and c[key] != want:
            problems.append(f"its {key} is {c[key]}, the target's {want}")
    layers = target["num_hidden_layers"]
    aux = published.aux_layer_ids
    if aux and not all(0 <= i < layers for i in aux):
        problems.append(f"it reads target layers {aux}, and the target has {layers}")
    if published.attention == "mla":
        missing = [f for f in MLA_FIELDS if c.get(f) != target.get(f)]
        if missing:
            problems.append(f"its MLA attention differs from the target's in {missing}")
    if problems:
        raise DrafterFormatError(
            f"train.init_from {name} ({published.format}) does not fit "
            f"this target: {'; '.join(problems)}. Start from a drafter "
            f"trained for this target, or train from scratch (no "
            f"train.init_from)"
        )


def size(published: Published) -> dict:
    """Its weights' ``bytes`` on disk and, where their headers say (safetensors), its
    ``parameters`` (None for a pickled checkpoint, which is not read to count)."""
    params = 0
    for path in published.weights:
        if path.suffix != ".safetensors":
            params = None
            break
        params += sum(math.prod(t["shape"]) for t in safetensors_tensors(path).values())
    return {"bytes": sum(p.stat().st_size for p in published.weights), "parameters": params}


def eaglet_name(name: str) -> str | None:
    """A published EAGLE-3 tensor's name as eaglet's drafter calls it, None where it is not
    the drafter's own (the target's embedding, a verifier's head)."""
    name = name.removeprefix("model.")
    if name.startswith(NOT_THE_DRAFTERS):
        return None
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def _load_file(path: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors' and torch's own errors name no file
        raise DrafterFormatError(
            f"train.init_from: {path} cannot be read ({type(error).__name__}: {error}): it is "
            f"damaged or was cut short; copy or download the drafter again"
        ) from error


def convert(
    published: Published, target_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0
) -> dict:
    """Write the starting drafter in eaglet's export layout into ``out_dir`` (what training
    starts from and the evaluation serves beside the fine-tuned drafter); returns the record
    of its tensors: ``from_drafter``, ``new`` (absent from the files: initialized as training
    initializes them, with ``seed``), ``derived`` (t2d from d2t, an identity d2t) and
    ``left_out`` (in the files, not the drafter's)."""
    import torch

    from eaglet.model import methods as providers
    from eaglet.model.config import config_from_vllm
    from eaglet.target.checkpoint import load_target_embedding, read_target_config, text_config

    target = text_config(read_target_config(target_dir))
    check_fits(published, target)
    config = dict(published.config)
    if not (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        config["eagle_config"] = {
            **config.get("eagle_config", {}),
            "eagle_aux_hidden_state_layer_ids": methods.default_aux_layer_ids(
                target["num_hidden_layers"]
            ),
        }
    record = {
        "source": str(published.path),
        "format": published.format,
        "method": published.method.name,
        "from_drafter": [],
        "new": [],
        "derived": [],
        "left_out": [],
    }
    if published.method is not methods.EAGLE3:  # eaglet's own export of P-EAGLE or DFlash
        model = providers.load(published.path, target_dir, method=published.method.name)
        record["from_drafter"] = sorted(model.state_dict())
    else:
        loaded = {}
        for path in published.weights:
            for name, tensor in _load_file(path).items():
                mine = eaglet_name(name)
                if mine is None:
                    record["left_out"].append(name)
                else:
                    loaded[mine] = tensor
        drafter_config = config_from_vllm(config)
        vd, v = drafter_config.draft_vocab_size, drafter_config.vocab_size
        if "d2t" not in loaded:
            if vd != v:
                raise DrafterFormatError(
                    f"train.init_from {published.path}: a draft vocabulary "
                    f"of {vd} of {v} tokens, and no d2t map to say which"
                )
            loaded["d2t"] = torch.zeros(vd, dtype=torch.int64)
            record["derived"].append("d2t (the identity: a full vocabulary)")
        d2t = loaded["d2t"].to(torch.int64)
        if "t2d" not in loaded:
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[torch.arange(vd) + d2t] = True
            loaded["t2d"] = t2d
            record["derived"].append("t2d (from d2t)")
        torch.manual_seed(seed)
        model = providers.make_drafter(
            published.method.name,
            target,
            drafter_config,
            load_target_embedding(target_dir),
            d2t,
            loaded["t2d"].to(torch.bool),
        )
        state = model.state_dict()
        for name, tensor in state.items():
            if name not in loaded:
                record["new"].append(name)
                continue
            if tuple(loaded[name].shape) != tuple(tensor.shape):
                raise DrafterFormatError(
                    f"train.init_from {published.path}: {name} has shape "
                    f"{tuple(loaded[name].shape)}, its config.json gives {tuple(tensor.shape)}"
                )
            state[name] = loaded[name].to(tensor.dtype)
            record["from_drafter"].append(name)
        record["left_out"] += sorted(set(loaded) - set(state))
        model.load_state_dict(state, strict=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    providers.export(model.eval(), out_dir)
    return record


def apply(cfg: dict, start_dir: str, target_config: str | os.PathLike | None = None) -> list[str]:
    """Give the run ``cfg`` (validated) the settings its starting drafter decides
    (``train.init_from``; :meth:`Published.settings`), and serve that drafter, converted into
    ``start_dir``, beside the fine-tuned one (``evaluate.compare_drafters``). Returns a line per
    setting it changed. ``target_config``: the prepared target's config.json where it exists:
    aux layers equal to the target's default ones leave ``extract.aux_layer_ids`` unset (set,
    they would count as changed settings and redo a finished extraction)."""
    spec = cfg["train"].get("init_from")
    if not spec:
        return []
    published = read(spec)
    settings = published.settings()
    if target_config and Path(target_config).is_file() and "extract.aux_layer_ids" in settings:
        text = read_json(target_config)
        layers = text.get("text_config", text)["num_hidden_layers"]
        if cfg["extract"]["aux_layer_ids"] is None and settings[
            "extract.aux_layer_ids"
        ] == methods.default_aux_layer_ids(layers):
            del settings["extract.aux_layer_ids"]
    notes = []
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        if cfg[section].get(key) != value:
            notes.append(
                f"{dotted}: {cfg[section].get(key)!r} -> {value!r} (the starting "
                f"drafter's, train.init_from {spec}: {published.format})"
            )
            cfg[section][key] = value
    compared = [str(d) for d in cfg["evaluate"].get("compare_drafters") or []]
    if start_dir not in compared:
        cfg["evaluate"]["compare_drafters"] = [start_dir, *compared]
    return notes
