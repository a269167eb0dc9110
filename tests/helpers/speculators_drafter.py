"""An EAGLE-3 drafter made and saved by vLLM's ``speculators`` itself (its
``Eagle3DraftModel.from_training_args``, the builder its trainer calls, and its
``save_pretrained``), for a target on disk: what a user downloads from a hub repository that
speculators wrote. Run with speculators on the path (``make peer-bench-install``)::

    python speculators_drafter.py TARGET_DIR OUT_DIR DRAFT_VOCAB LAYER_IDS

``LAYER_IDS``: the target layers it reads, comma-separated. The draft vocabulary is every
second token of the target's first ``2 * DRAFT_VOCAB``. One decoder layer, as its trainer
builds by default; weights as its initialization leaves them.
"""

import sys

import torch
from speculators.models.eagle3.core import Eagle3DraftModel
from transformers import AutoConfig


def main(target: str, out: str, draft: int, layer_ids: list[int]) -> None:
    verifier = AutoConfig.from_pretrained(target)
    ids = torch.arange(0, 2 * draft, 2)
    t2d = torch.zeros(verifier.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    layer = AutoConfig.from_pretrained(target)
    layer.num_hidden_layers = 1
    torch.manual_seed(3)
    model = Eagle3DraftModel.from_training_args(
        layer,
        t2d=t2d,
        d2t=ids - torch.arange(draft),
        draft_vocab_size=draft,
        norm_before_residual=True,
        ttt_steps=3,
        verifier_name_or_path=target,
        draft_attn_impl="sdpa",
        target_layer_ids=layer_ids,
    )
    model.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(i) for i in sys.argv[4].split(",")])
