"""How the drafter starts from the target: its lm_head from the target's rows of the draft
vocabulary, and its layer from a target layer (``train.layer_init: target``) where that
layer's tensors fit, judged from their names, shapes and dtypes."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from eaglet.model.drafter import Eagle3Drafter
from eaglet.target.checkpoint import load_target_layer, target_layer_meta


def init_lm_head(model: Eagle3Drafter, target_lm_head: torch.Tensor) -> None:
    """Start lm_head from the target's lm_head rows of the draft vocabulary [Vd, H]."""
    with torch.no_grad():
        model.lm_head.weight.copy_(target_lm_head.to(model.lm_head.weight.dtype))


# -- starting from the target's layer (train.layer_init: target) ----------------------------

# the drafter's layer in two parts, each with the tensors of a target layer it starts from:
# a part is taken only when the target's module holds exactly these (a Llama-style layer)
LAYER_PARTS = {
    "attention": ("input_layernorm.", "self_attn."),
    "mlp": ("post_attention_layernorm.", "mlp."),
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
IGNORED = ("rotary_emb.inv_freq",)  # a buffer old Llama checkpoints store, not a weight


def _is_input_projection(attn: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of the attention reads the [embedding, hidden] input."""
    return name.removesuffix(".weight") in attn.input_projections


def target_layer_shapes(model: Eagle3Drafter) -> dict[str, dict[str, tuple[int, ...]]]:
    """By part, the shape each target tensor must have to start the drafter's layer: the
    drafter's own shapes, the hidden half [.., H] of the projections that read [embedding,
    hidden] (q/k/v; MLA's q_a_proj and kv_a_proj_with_mqa)."""
    h = model.config.hidden_size
    attn, mlp = model.midlayer.self_attn, model.midlayer.mlp
    return {
        "attention": {
            "input_layernorm.weight": (h,),
            **{
                f"self_attn.{n}": (
                    (p.shape[0], h) if _is_input_projection(attn, n) else tuple(p.shape)
                )
                for n, p in attn.named_parameters()
            },
        },
        "mlp": {
            "post_attention_layernorm.weight": (h,),
            **{
                f"mlp.{n}.weight": tuple(getattr(mlp, n).weight.shape)
                for n in ("gate_proj", "up_proj", "down_proj")
            },
        },
    }


def _patterns(names: list[str], limit: int = 4) -> str:
    """Tensor names with their indices folded (``mlp.experts.N.up_proj.weight x384``), the
    first ``limit`` of them: an MoE layer's thousands of names in one readable line."""
    counts: dict[str, int] = {}
    for name in names:
        folded = re.sub(r"\.\d+\.", ".N.", name)
        counts[folded] = counts.get(folded, 0) + 1
    shown = [f"{n} x{c}" if c > 1 else n for n, c in list(counts.items())[:limit]]
    more = len(counts) - limit
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _misfit(
    expected: dict[str, tuple[int, ...]],
    meta: dict[str, tuple[tuple[int, ...], str]],
    own: list[str],
) -> str:
    """Why a target module (its tensors ``own``) does not fit the drafter's ``expected``
    tensors ('' when it does): what is missing, stored quantized, shaped otherwise, or extra."""
    problems = []
    missing = [name for name in expected if name not in meta]
    for name in missing:  # a quantized layout stores other tensors in the weight's place
        module = name.removesuffix("weight")
        stored = [n.removeprefix(module) for n in own if n.startswith(module)]
        if stored:
            problems.append(f"{module}weight is stored as {', '.join(stored)} (quantized)")
    if missing:
        problems.append(f"no {_patterns(missing)}")
    for name, shape in expected.items():
        if name not in meta:
            continue
        stored, dtype = meta[name]
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{name} is stored as {dtype} (quantized)")
        elif tuple(stored) != shape:
            problems.append(f"{name} is {list(stored)} where the drafter needs {list(shape)}")
    extra = sorted(name for name in own if name not in expected)
    if extra:
        problems.append(f"also {_patterns(extra)}, which the drafter's layer lacks")
    return "; ".join(problems)


@dataclass
class LayerFit:
    """Which parts of the drafter's layer a target layer can start (``parts``, with the
    target tensors they read) and why the others cannot (``reasons``: part -> why)."""

    layer: int | None
    parts: dict[str, list[str]]
    reasons: dict[str, str]
    style: str = "Llama-style"  # the drafter's layer, as the log names it

    @property
    def names(self) -> list[str]:
        """The target tensors to read: the fitting parts' and the final norm (when any fits)."""
        return [n for names in self.parts.values() for n in names] + (
            ["norm"] if self.parts else []
        )

    def record(self) -> dict:
        """What the run reports (``train``'s summary): the parts taken and why others were not."""
        return {
            "setting": "target",
            "layer": self.layer,
            "from_target": list(self.parts),
            "random": dict(self.reasons),
        }

    def message(self) -> str:
        """One log line: what the drafter's layer starts from and, where not all of it is the
        target's, why and how to silence it."""
        layer = (
            "the target's last layer" if self.layer is None else f"the target's layer {self.layer}"
        )
        reasons = set(self.reasons.values())
        why = (
            next(iter(reasons))
            if len(reasons) == 1 and len(self.reasons) > 1
            else "; ".join(f"{part}: {reason}" for part, reason in self.reasons.items())
        )
        if not self.reasons:
            return (
                f"layer_init target: the drafter's layer starts as {layer} (attention, mlp "
                f"and final norm) applied to the deepest aux feature"
            )
        silence = "train.layer_init: random silences this"
        if not self.parts:
            return (
                f"layer_init target: {layer} does not fit the drafter's {self.style} layer, "
                f"which starts random ({why}); {silence}"
            )
        taken, left = " and ".join(self.parts), " and ".join(self.reasons)
        return (
            f"layer_init target: the drafter's {taken} and final norm start from {layer} "
            f"(fc passes the deepest aux feature through); its {left} starts random "
            f"({why}); {silence}"
        )


def fit_target_layer(
    model: Eagle3Drafter,
    meta: dict[str, tuple[tuple[int, ...], str]],
    layer: int | None = None,
    shapes: dict[str, dict[str, tuple[int, ...]]] | None = None,
    style: str | None = None,
) -> LayerFit:
    """Which parts of the drafter's layer a target layer fits, from its tensors' names,
    shapes and dtypes (``target_layer_meta``, or ``tensor_meta`` of loaded weights): MLA
    attention, MoE experts, other shapes and quantized weights do not. ``shapes``: by part
    (LAYER_PARTS), the target tensors the layer takes (default: the EAGLE-3 layer's,
    :func:`target_layer_shapes`); ``style``: the layer as the log names it."""
    h = model.config.hidden_size
    style = style or ("MLA" if model.config.attention_kind == "mla" else "Llama-style")
    names = [n for n in meta if n != "norm" and not n.endswith(IGNORED)]
    if not names:
        reason = "the checkpoint holds no tensor of that layer"
        return LayerFit(layer, {}, {part: reason for part in LAYER_PARTS}, style)
    norm = (
        "the checkpoint holds no final norm"
        if "norm" not in meta
        else _misfit({"norm": (h,)}, meta, [])
    )
    if norm:
        return LayerFit(layer, {}, {part: norm for part in LAYER_PARTS}, style)
    unclaimed = [
        n
        for n in names
        if not any(n.startswith(p) for prefixes in LAYER_PARTS.values() for p in prefixes)
    ]
    parts, reasons = {}, {}
    for part, expected in (shapes or target_layer_shapes(model)).items():
        own = [n for n in names if n.startswith(LAYER_PARTS[part])]
        if part == "mlp":  # what follows attention: an MoE block by another name (Mixtral's
            own += unclaimed  # block_sparse_moe), extra norms
        reason = _misfit(expected, meta, own)
        if reason:
            reasons[part] = reason
        else:
            parts[part] = list(expected)
    return LayerFit(layer, parts, reasons, style)


def tensor_meta(weights: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and dtype (without ``torch.``) of loaded weights, as ``target_layer_meta`` gives
    them."""
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()}


def init_from_target_layer(
    model: Eagle3Drafter, weights: dict[str, torch.Tensor], fit: LayerFit | None = None
) -> LayerFit:
    """Start the drafter as the target's layer ``weights`` (``load_target_layer``) applied to
    the deepest aux feature: ``fc`` passes that feature through, the hidden half of the input
    projections (q/k/v, or MLA's), the rest of the attention, the MLP and the norms are the
    layer's, and the final norm is the target's. The embedding half of the input projections
    keeps its random init: the target layer has no such input.
    Only the parts that fit (``fit``, judged from ``weights`` when not given) are copied; a
    layer of which none fits leaves the drafter as it was (random). With the EAGLE-3.1 norms
    (fc_norm, norm_before_fc) fc passes the normed feature through: a start, not the layer."""
    fit = fit or fit_target_layer(model, tensor_meta(weights))
    h = model.config.hidden_size
    layer = model.midlayer
    with torch.no_grad():
        if "attention" in fit.parts:
            for name, param in layer.self_attn.named_parameters():
                own = param[:, h:] if _is_input_projection(layer.self_attn, name) else param
                own.copy_(weights[f"self_attn.{name}"])
            layer.hidden_norm.weight.copy_(weights["input_layernorm.weight"])
        if "mlp" in fit.parts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(weights[f"mlp.{name}.weight"])
            layer.post_attention_layernorm.weight.copy_(weights["post_attention_layernorm.weight"])
        if fit.parts:
            model.norm.weight.copy_(weights["norm"])
            model.fc.weight.zero_()
            model.fc.weight[:, -h:].copy_(torch.eye(h))
    return fit


def init_from_target(model: Eagle3Drafter, target_dir, layer: int) -> LayerFit:
    """``train.layer_init: target``: judge the target's layer ``layer`` from its checkpoint's
    headers, then read only the tensors of the parts that fit (an MoE layer's experts are
    never read) and start the drafter from them (``init_from_target_layer``)."""

    fit = fit_target_layer(model, target_layer_meta(target_dir, layer), layer)
    if fit.parts:
        init_from_target_layer(model, load_target_layer(target_dir, layer, fit.names), fit)
    return fit
