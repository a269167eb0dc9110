"""A miniature in Mistral's own format, for a target published in it.

vLLM serves a repository that holds ``consolidated*.safetensors`` beside a Mistral tokenizer
file in its Mistral mode: config from ``params.json``, weights under Mistral's names, prompts
rendered by mistral_common (:func:`eaglet.engine.support.mistral_mode`). A miniature of such a
target is served the same way, or the rehearsal would rehearse vLLM's other path: beside the
miniature's transformers weights (which eaglet's own stages read) it gets
``consolidated.safetensors`` and a ``params.json`` at the miniature's widths.

The names are those vLLM's Mistral loader maps to its own (``MistralForCausalLM``'s
``maybe_remap_mistral``), and its query and key projections are stored as Mistral stores
them: each head's rotary halves interleaved, which the loader permutes back. A tensor outside
that table (experts, a vision tower) is refused by name: the rehearsal would otherwise serve a
model vLLM's loader does not read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MISTRAL_WEIGHTS_FILE = "consolidated.safetensors"

# transformers' names -> Mistral's, as vLLM's Mistral loader maps them back
NAMES = {
    r"model\.embed_tokens\.weight": "tok_embeddings.weight",
    r"model\.norm\.weight": "norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"layers.\1.attention.wq.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"layers.\1.attention.wk.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"layers.\1.attention.wv.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"layers.\1.attention.wo.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"layers.\1.attention_norm.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"layers.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"layers.\1.feed_forward.w1.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"layers.\1.feed_forward.w2.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"layers.\1.feed_forward.w3.weight",
}

# params.json's names for the config values the miniature shrinks (vLLM's
# _remap_general_mistral_args reads them back under transformers' names)
PARAMS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tied_embeddings": "tie_word_embeddings",
}
# blocks of params.json the miniature does not carry: it is float32 and unquantized, and
# built as its language model (tools.miniature)
DROPPED = ("quantization", "vision_encoder", "multimodal")


class MistralFormatError(RuntimeError):
    pass


def mistral_name(name: str) -> tuple[str, str | None]:
    """Mistral's name of a transformers tensor name, and which rotary projection it is
    (``"q"``, ``"k"``, or None). Raises :class:`MistralFormatError` for a name vLLM's Mistral
    loader would not map."""
    for pattern, replacement in NAMES.items():
        if re.fullmatch(pattern, name):
            kind = re.search(r"\.(q|k)_proj\.", name)
            return re.sub(pattern, replacement, name), kind.group(1) if kind else None
    raise MistralFormatError(
        f"the miniature's tensor {name} has no name in Mistral's format that vLLM's Mistral "
        f"loader maps (a dense decoder's attention, MLP, norms, embedding and head): this "
        f"target's architecture cannot be rehearsed in its Mistral mode"
    )


def interleave_rotary(weight, heads: int):
    """A query or key projection as Mistral stores it: each head's two rotary halves
    interleaved (the inverse of the permutation vLLM's Mistral loader applies)."""
    rows, hidden = weight.shape
    head_dim = rows // heads
    return weight.view(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(rows, hidden)


def params(source: dict, small: dict) -> dict:
    """The target's ``params.json`` at the miniature's widths: each value it shares with the
    config (:data:`PARAMS`) taken from the miniature's, the blocks the miniature lacks
    dropped, the weights' dtype named (vLLM would otherwise infer it from every
    safetensors file beside it, the transformers weights among them)."""
    out = {k: v for k, v in source.items() if k not in DROPPED}
    for key, name in PARAMS.items():
        if small.get(name) is not None:
            out[key] = small[name]
    if "max_position_embeddings" in small and "max_seq_len" not in source:
        out["max_position_embeddings"] = small["max_position_embeddings"]
    if "moe" in out:
        raise MistralFormatError(
            "the target's params.json declares a mixture of experts (moe), whose weights the "
            "miniature does not write in Mistral's format"
        )
    out["dtype"] = "float32"
    return out


def write(model, small: dict, source: Path, out: Path) -> dict:
    """Write ``model`` (the taught miniature) in Mistral's format beside its transformers
    weights in ``out``: :data:`MISTRAL_WEIGHTS_FILE` and ``params.json`` (from ``source``'s).
    Returns what was written."""
    import torch
    from safetensors.torch import save_file

    heads = {"q": small["num_attention_heads"], "k": small["num_key_value_heads"]}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        target, rotary = mistral_name(name)
        tensor = tensor.detach().to(torch.float32)
        if rotary:
            tensor = interleave_rotary(tensor, heads[rotary])
        tensors[target] = tensor.contiguous().clone()
    save_file(tensors, str(out / MISTRAL_WEIGHTS_FILE), metadata={"format": "pt"})
    written = params(json.loads((source / "params.json").read_text()), small)
    (out / "params.json").write_text(json.dumps(written, indent=1))
    return {"file": MISTRAL_WEIGHTS_FILE, "tensors": len(tensors), "params": written}
