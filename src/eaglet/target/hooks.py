"""The aux capture of a transformers forward: pre-hooks that keep the input hidden states of
the target's chosen decoder layers (extraction and the offline replay both run it)."""

from __future__ import annotations

import torch

from eaglet.target.states import ExtractionError


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a causal LM (``model.model.layers`` for Llama-like models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ExtractionError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


class AuxCapture:
    """Forward pre-hooks that keep the input hidden states of a few decoder layers."""

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: list[int]):
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = [
            layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i in dict.fromkeys(layer_ids)
        ]
        self.layer_ids = layer_ids

    def _hook(self, layer_id: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.captured[layer_id] = hidden.detach()

        return hook

    def take(self) -> list[torch.Tensor]:
        out = [self.captured[i] for i in self.layer_ids]  # an id may repeat on small models
        self.captured.clear()
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
