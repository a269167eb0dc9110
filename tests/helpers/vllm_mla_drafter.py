"""vLLM's own code on an exported MLA drafter, outside the engine (run as a script in a
subprocess: it sets up vLLM's process-wide state).

    python tests/helpers/vllm_mla_drafter.py TARGET_DIR DRAFTER_DIR INPUTS OUT

Builds ``Eagle3DeepseekV2ForCausalLM`` from the engine config vLLM makes for
``--speculative-config '{"method": "eagle3", "model": DRAFTER_DIR, ...}'``, streams the
exported ``model.safetensors`` through its ``load_weights``, and writes to OUT (safetensors):

- ``loaded.NAME``: each vLLM parameter after ``load_weights`` (the embedding is the target's,
  shared as the engine shares it), and ``config.scale``, its MLA softmax scale;
- ``logits.J``: the draft logits (target vocabulary) of chain step J from row ``p`` of the
  sequence in INPUTS (``aux`` [T, 3H], ``ids`` [T + 1], ``p``, ``k``), computed by vLLM's
  forward: ``combine_hidden_states`` (fc), the decoder layer with its MLA projections, norms,
  RoPE (vLLM's CPU kernel) and MLP, the final norm, lm_head and the d2t scatter. Only the
  attention kernel, which needs the engine's KV cache and metadata, is replaced by the plain
  MLA softmax over the keys and values vLLM hands it (``ReferenceKernel``), with vLLM's scale.
  Step 0 runs rows 0..p causally; step J >= 1 runs one token (the previous step's argmax) at
  position p + J on the previous step's pre-norm output, seeing rows 0..p and its own chain,
  as vLLM's EAGLE proposer drafts.
"""

from __future__ import annotations

import socket
import sys

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class ReferenceKernel(nn.Module):
    """Stands in for vLLM's MLAAttention: attention of the new rows over every row seen so
    far (causal), keys [k_nope, k_pe] and values from kv_b_proj of the normed latent."""

    def __init__(self, wrapper, scale: float):
        super().__init__()
        self.kv_b_proj = wrapper.kv_b_proj
        self.heads, self.nope, self.v_dim = (
            wrapper.num_heads,
            wrapper.qk_nope_head_dim,
            wrapper.v_head_dim,
        )
        self.scale = scale
        self.keys, self.values = [], []

    def forward(self, q, kv_c_normed, k_pe, output_shape, **_):
        rows = q.shape[0]
        kv = self.kv_b_proj(kv_c_normed)[0].view(rows, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(rows, self.heads, k_pe.shape[-1])], dim=-1)
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys), torch.cat(self.values)  # [seen, heads, D]
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * self.scale
        seen = keys.shape[0]
        causal = torch.arange(seen)[None, :] <= (seen - rows + torch.arange(rows))[:, None]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", weights, values.float())
        return out.reshape(output_shape).to(q.dtype)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(target: str, drafter: str, inputs: str, out: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

    from eaglet.engine.support import cpu_attention_backend

    # the backend eaglet's CPU servers ask for (a CPU with AMX would pick AMX MLA, which
    # takes no float32 weights), for the target's layers and the drafter's alike
    backend = cpu_attention_backend(mla=True, dtype="float32")
    args = EngineArgs(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        attention_backend=backend,
        speculative_config={
            "method": "eagle3",
            "model": drafter,
            "num_speculative_tokens": 3,
            "attention_backend": backend,
        },
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
        model = Eagle3DeepseekV2ForCausalLM(vllm_config=config)
        model.load_weights(iter(load_file(f"{drafter}/model.safetensors").items()))
        for name, param in model.named_parameters():
            result[f"loaded.{name}"] = param.detach().clone()
        # the engine shares the target's embedding with a drafter that has none
        embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
        model.model.embed_tokens.weight[: embed.shape[0]].copy_(embed)
        process_weights_after_loading(
            model, config.speculative_config.draft_model_config, torch.device("cpu")
        )
        attention = model.model.layers[0].self_attn  # DeepseekV2MLAAttention
        attention.mla_attn.mla_attn = ReferenceKernel(attention.mla_attn, attention.scaling)
        result["config.scale"] = torch.tensor(attention.scaling, dtype=torch.float64)

        aux, ids = data["aux"].float(), data["ids"]
        hidden = model.combine_hidden_states(aux[: p + 1])
        tokens, positions = ids[1 : p + 2], torch.arange(p + 1)
        for step in range(k):
            normed, prenorm = model(tokens, positions, hidden)
            logits = model.compute_logits(normed[-1:])[0]
            result[f"logits.{step}"] = logits
            tokens = logits.argmax()[None]
            positions = positions[-1:] + 1
            hidden = prenorm[-1:]
    save_file({n: t.contiguous() for n, t in result.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
