"""P-EAGLE: an EAGLE-3 drafter that proposes all ``k`` tokens in one forward (parallel drafting).

vLLM 0.32 serves it as ``"method": "eagle3"`` with ``"parallel_drafting": true``
(``v1/spec_decode/llm_base_proposer.py``). After the target verifies a round whose last
verified position is ``p`` and samples token ``p+1``, the proposer builds one query per
request (``copy_and_expand_eagle_inputs``): the verified rows as EAGLE-3 reads them (row ``t``
embeds token ``t+1`` over the target's features of ``t``), the bonus row ``p`` (token ``p+1``,
features of ``p``), then ``k-1`` masked slots at positions ``p+1 .. p+k-1``, each embedding
``mask_token_id`` over the hidden state ``combine_hidden_states(mask_hidden)`` (fc, after
any EAGLE-3.1 norm; ``mask_hidden``: one learned vector of the aux features' width,
``Eagle3LlamaForCausalLM.mask_hidden``). One causal forward of the drafter's layer over that
query; the logits of rows ``p, p+1, .., p+k-1`` are the ``k`` drafts. Nothing is fed back, so
the draft costs one forward instead of ``k``.

Training (``train.method: peagle``) computes exactly that forward for every row of a packed
batch at once, with the drafter's own layer and TTT attention (``eaglet.model.drafter``): step 0 is
EAGLE-3's (token ``t+1`` over ``combine(aux[t])`` at position ``t``), step ``j >= 1`` embeds
the mask token over ``combine(mask_hidden)`` at position ``t+j``, its query seeing the step-0
keys of rows ``<= t`` and its own keys of steps ``1..j``: the masked slots of anchor ``t``
seeing the context and the earlier masked slots, which is what vLLM's causal forward over the
query gives them. Step ``j`` of row ``t`` predicts token ``t+2+j`` against the same teacher and with the
same weights ``ttt_decay**j`` as training-time test (``eaglet.stages.train.step.batch_sums``), so the loss,
the held-out metrics, checkpoints and the choice of the best held-out weights are EAGLE-3's.
speculators trains the same objective on a subsample of the anchors at deeper steps (COD
sampling, to save GPU memory); here every anchor is trained at every step.

The mask token's embedding is the target's (vLLM shares the target's embedding with a drafter
that has none, and the drafter does not train it): :func:`mask_token_id` takes the target's
``bos_token_id``, a token that otherwise only opens a sequence. ``mask_hidden`` carries what
the masked slots need.

The checkpoint is the EAGLE-3 one (``eaglet.model.export``) plus the tensor ``mask_hidden``
[A * target_hidden_size] (vLLM refuses to start a parallel-drafting drafter without it) and
the config keys ``mask_token_id`` (read by vLLM's proposer) and ``parallel_drafting: true``
(read by nothing in vLLM: the speculative config must say it, :func:`speculative_config`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from eaglet.core.io import atomic_open, read_json, write_json
from eaglet.data.shards import STORAGE_DTYPES
from eaglet.model.attention import BLOCK_ROWS, attention_blocks
from eaglet.model.config import DrafterConfig, config_from_vllm
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.export import export_drafter
from eaglet.target.checkpoint import load_target_embedding


def mask_token_id(target_config: dict) -> int:
    """The token id of the masked slots: the target's ``bos_token_id`` (else its pad, else
    its first eos, else 0). Its embedding is the target's and stays frozen; any id serves,
    one that seldom appears as a real input keeps the two apart for the layer."""
    text = target_config.get("text_config", target_config)
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        value = text.get(key, target_config.get(key))
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and 0 <= value < text["vocab_size"]:
            return value
    return 0


class PEagleDrafter(Eagle3Drafter):
    """The EAGLE-3 drafter plus ``mask_hidden``; its forward drafts in parallel (module doc)."""

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        mask_token_id: int,
        attention: str = "sdpa",
    ):
        super().__init__(config, embed_tokens, d2t, t2d, attention)
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(
                f"mask_token_id {mask_token_id} is outside the target's vocabulary "
                f"(0..{config.vocab_size - 1})"
            )
        self.mask_token_id = int(mask_token_id)
        # [A * target_hidden], as vLLM's buffer (it reads any shape of that many elements);
        # a random start like speculators', put through fc (and its norms) as aux features are
        self.mask_hidden = nn.Parameter(torch.randn(config.fc_input_size))

    def mask_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked slots' embedding and hidden state [H] each, as vLLM feeds them: the
        target's embedding of ``mask_token_id`` and ``mask_hidden`` through what the aux
        features go through (``combine``: fc and any EAGLE-3.1 norm before it; vLLM's
        ``parallel_drafting_hidden_state_tensor = combine_hidden_states(mask_hidden)``)."""
        hidden = self.combine(self.mask_hidden.to(self.fc.weight.dtype)[None])[0]
        return self.embed_tokens[self.mask_token_id].to(dtype), hidden.to(dtype)

    def forward(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        segments: torch.Tensor,
        logit_rows: list[torch.Tensor] | None = None,
        heads: bool = True,
    ) -> list[torch.Tensor]:
        """``K = len(input_ids)`` parallel drafting steps over a packed batch of T rows, with
        ``Eagle3Drafter.forward``'s arguments and result; only ``input_ids[0]`` is read (the
        later steps embed the mask token)."""
        blocks = attention_blocks(
            segments, len(segments) if self.attention == "flex" else BLOCK_ROWS
        )
        hidden = self.combine(aux_hidden)  # [T, H]
        rows = hidden.shape[0]
        mask_embed, mask_hidden = self.mask_inputs(hidden.dtype)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for step in range(len(input_ids)):
            cos, sin = self.rope(positions + step)
            if step == 0:
                embeds, state = self.embed_tokens[input_ids[0]].to(hidden.dtype), hidden
            else:  # the masked slot at position t + step; nothing fed back from step - 1
                embeds, state = mask_embed.expand(rows, -1), mask_hidden.expand(rows, -1)
            normed, _ = self.draft_step(
                embeds,
                state,
                cos,
                sin,
                blocks,
                cache,
                None if logit_rows is None else logit_rows[step],
            )
            logits.append(self.lm_head(normed) if heads else normed)
        return logits


# -- the checkpoint ---------------------------------------------------------------------------


class _Eagle3View:
    """``model`` as ``export_drafter`` sees an EAGLE-3 drafter: its state without mask_hidden."""

    def __init__(self, model: PEagleDrafter):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = self._model.state_dict()
        state.pop("mask_hidden")
        return state


def export_peagle(model: PEagleDrafter, out_dir: str | Path, dtype: str = "float32") -> dict:
    """Write the EAGLE-3 checkpoint (``export_drafter``) plus ``mask_hidden`` and the parallel
    drafting keys, each file atomically; returns the config."""
    out_dir = Path(out_dir)
    config = export_drafter(_Eagle3View(model), out_dir, dtype)
    weights = load_file(str(out_dir / "model.safetensors"))
    weights["mask_hidden"] = model.mask_hidden.detach().cpu().to(STORAGE_DTYPES[dtype]).contiguous()
    data = save(weights, metadata={"format": "pt"})
    with atomic_open(out_dir / "model.safetensors", "wb") as handle:
        handle.write(data)
    config = {**config, "mask_token_id": model.mask_token_id, "parallel_drafting": True}
    write_json(out_dir / "config.json", config)
    return config


def load_peagle(
    drafter_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32
) -> PEagleDrafter:
    """An exported P-EAGLE drafter with the target's embedding, ready to run (eval mode)."""
    drafter_dir = Path(drafter_dir)
    raw = read_json(drafter_dir / "config.json")
    if "mask_token_id" not in raw:
        raise ValueError(
            f"{drafter_dir}/config.json has no mask_token_id: not a P-EAGLE drafter "
            f"(load it with eaglet.model.export.load_drafter)"
        )
    config = config_from_vllm(raw)
    weights = load_file(str(drafter_dir / "model.safetensors"))
    weights.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
    weights["mask_hidden"] = weights["mask_hidden"].reshape(-1)
    model = PEagleDrafter(
        config,
        load_target_embedding(target_dir),
        weights["d2t"],
        weights["t2d"],
        raw["mask_token_id"],
    )
    model.load_state_dict(weights, strict=True)
    return model.to(dtype).eval()
