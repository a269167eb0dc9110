"""vLLM's own code on an exported Llama drafter, outside the engine (run as a script in a
subprocess: it sets up vLLM's process-wide state).

    python tests/helpers/vllm_llama_drafter.py TARGET_DIR DRAFTER_DIR INPUTS OUT

Builds ``Eagle3LlamaForCausalLM`` (llama_eagle3.py) from the engine config vLLM makes for
``--speculative-config '{"method": "eagle3", "model": DRAFTER_DIR, ...}'``, streams the
exported ``model.safetensors`` through its ``load_weights``, and writes to OUT (safetensors):

- ``loaded.NAME``: each vLLM parameter after ``load_weights`` (the embedding is the target's,
  shared as the engine shares it);
- ``flags.NAME``: the EAGLE-3.1 flags as vLLM's model applies them (norm_before_fc,
  fc_norm: whether the norms exist; norm_output; norm_before_residual: whether the layer
  norms the hidden state before it becomes the residual);
- ``logits.J``: the draft logits (target vocabulary) of chain step J from row ``p`` of the
  sequence in INPUTS (``aux`` [T, 3H], ``ids`` [T + 1], ``p``, ``k``), computed by vLLM's
  forward: ``combine_hidden_states`` (input_norm, fc_norm, fc), the decoder layer with its
  norms, q/k/v, RoPE (vLLM's CPU kernel) and MLP, the final norm, lm_head and the d2t
  scatter. Only the attention kernel, which needs the engine's KV cache and metadata, is
  replaced by the plain causal GQA softmax over the keys and values vLLM hands it
  (``ReferenceKernel``). Step 0 runs rows 0..p; step J >= 1 runs one token (the previous
  step's argmax) at position p + J on the hidden state vLLM's forward returned for the next
  step (pre-norm, or post-norm with norm_output), as vLLM's EAGLE proposer drafts.
"""

from __future__ import annotations

import socket
import sys

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class ReferenceKernel(nn.Module):
    """Stands in for vLLM's Attention: the new rows attend causally over every row seen so
    far; query head h reads KV head h // (heads / kv_heads)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.keys, self.values = [], []

    def forward(self, q, k, v, **_):
        rows, d = q.shape[0], self.head_dim
        self.keys.append(k.view(rows, self.kv_heads, d))
        self.values.append(v.view(rows, self.kv_heads, d))
        group = self.heads // self.kv_heads
        keys = torch.cat(self.keys).repeat_interleave(group, dim=1)  # [seen, heads, D]
        values = torch.cat(self.values).repeat_interleave(group, dim=1)
        scores = (
            torch.einsum("qhd,khd->hqk", q.view(rows, self.heads, d).float(), keys.float())
            * self.scale
        )
        seen = keys.shape[0]
        causal = torch.arange(seen)[None, :] <= (seen - rows + torch.arange(rows))[:, None]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", weights, values.float())
        return out.reshape(rows, self.heads * d).to(q.dtype)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(target: str, drafter: str, inputs: str, out: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    args = EngineArgs(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3},
    )
    config = args.create_engine_config()
    data = load_file(inputs)
    p, k = int(data["p"]), int(data["k"])
    result = {}
    with set_current_vllm_config(config), torch.no_grad():
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1, 1)
        model = Eagle3LlamaForCausalLM(vllm_config=config)
        model.load_weights(iter(load_file(f"{drafter}/model.safetensors").items()))
        for name, param in model.named_parameters():
            result[f"loaded.{name}"] = param.detach().clone()
        embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
        model.model.embed_tokens.weight[: embed.shape[0]].copy_(embed)
        process_weights_after_loading(
            model, config.speculative_config.draft_model_config, torch.device("cpu")
        )
        layer = model.model.layers[0]
        attention = layer.self_attn  # LlamaAttention
        attention.attn = ReferenceKernel(
            attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scaling
        )
        flags = {
            "norm_before_fc": model.model.input_norm is not None,
            "fc_norm": model.model.fc_norm is not None,
            "norm_output": bool(model.model.norm_output),
            "norm_before_residual": layer._residual_norm == layer._norm_before_residual,
        }
        for name, value in flags.items():
            result[f"flags.{name}"] = torch.tensor(value)

        aux, ids = data["aux"].float(), data["ids"]
        hidden = model.combine_hidden_states(aux[: p + 1])
        tokens, positions = ids[1 : p + 2], torch.arange(p + 1)
        for step in range(k):
            normed, next_hidden = model(tokens, positions, hidden)
            logits = model.compute_logits(normed[-1:])[0]
            result[f"logits.{step}"] = logits
            tokens = logits.argmax()[None]
            positions = positions[-1:] + 1
            hidden = next_hidden[-1:]
    save_file({n: t.contiguous() for n, t in result.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
