"""How eaglet asks vLLM for hidden states: the server arguments that load
:mod:`eaglet.engine.connector` with the ``extract_hidden_states`` method, and the layers the
server saves.

Both servers that capture take their arguments from here: generation's with
``generate.capture_hidden_states`` (the states of every answer) and the vllm extraction
backend's (one prefill request per sequence). The connector runs inside the server; this
module runs in eaglet's process and imports no vLLM.
"""

from __future__ import annotations

import json
import os

CONNECTOR = "EagletHiddenStatesConnector"
CONNECTOR_MODULE = "eaglet.engine.connector"


def capture_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """Layers the server saves: the distinct aux ids, then ``num_layers`` (layer L's output
    before the final norm, which gives the teacher's final state)."""
    return [*dict.fromkeys(aux_layer_ids), num_layers]


def capture_args(layer_ids: list[int], storage_dir: str | os.PathLike) -> list[str]:
    """vLLM arguments that make every request save its hidden states under ``storage_dir``."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {
                       "eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage_dir),
                                              "allow_custom_save_path": True}}
    return ["--speculative-config", json.dumps(speculative),
            "--kv-transfer-config", json.dumps(transfer), "--no-enable-prefix-caching"]

