"""The drafter's model card (``eaglet.tools.model_card``) and ``eaglet publish``.

The results dir is the report page's (tests/test_report_page.py writes it as the stages do,
the evaluation's files from its own verdict and serve-config functions) plus an exported
drafter: config.json as vLLM loads it and a model.safetensors header of its tensors' shapes.
Publishing is tested without network: the Hub client is replaced by a fake or by one that
raises what huggingface_hub raises offline."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from eaglet.core import methods
from eaglet.core.io import read_json, write_json
from eaglet.tools import model_card as mc
from eaglet.tools.cli import main
from eaglet.tools.report_page import first_page, report_texts
from tests.test_report_page import plain, rendered, write_evaluation, write_run

H, V, VD = 16, 64, 32
CFG = {
    "target": {"model": "embedded:smollm2-135m-instruct"},
    "train": {"method": "eagle3"},
    "data": {
        "sources": [
            {"type": "sharegpt", "limit": 330, "answers": "dataset"},
            {"type": "humaneval", "limit": 40},
            {"type": "file", "path": "data/mine.jsonl", "text_field": "q"},
            {"type": "hf", "name": "org/chats", "split": "train"},
        ]
    },
    "evaluate": {"num_speculative_tokens": [2, 3]},
}
# the tensors the drafter exports (eaglet.model.export.vllm_tensors), at toy widths
SHAPES = {
    "fc.weight": (H, 3 * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (H, 2 * H),
    "midlayer.self_attn.k_proj.weight": (H, 2 * H),
    "midlayer.self_attn.v_proj.weight": (H, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, H),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.mlp.gate_proj.weight": (2 * H, H),
    "midlayer.mlp.up_proj.weight": (2 * H, H),
    "midlayer.mlp.down_proj.weight": (H, 2 * H),
    "norm.weight": (H,),
    "lm_head.weight": (VD, H),
    "d2t": (VD,),
    "t2d": (V,),
}


def write_drafter(results: Path) -> None:
    """drafter/config.json and drafter/model.safetensors as training exports them."""
    drafter = results / "drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    write_json(
        drafter / "config.json",
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_hidden_layers": 1,
            "hidden_size": H,
            "intermediate_size": 2 * H,
            "num_attention_heads": 2,
            "vocab_size": V,
            "draft_vocab_size": VD,
            "target_hidden_size": H,
            "torch_dtype": "float32",
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                "use_aux_hidden_state": True,
            },
        },
    )
    save_file(
        {
            name: np.zeros(shape, dtype=np.int64 if name in ("d2t", "t2d") else np.float32)
            for name, shape in SHAPES.items()
        },
        str(drafter / "model.safetensors"),
    )


@pytest.fixture
def trained(tmp_path) -> Path:
    """A run trained, not evaluated yet."""
    write_run(tmp_path)
    write_drafter(tmp_path)
    return tmp_path


@pytest.fixture
def evaluated(trained) -> Path:
    time.sleep(0.01)  # the evaluation comes after the export
    write_evaluation(trained, spread=True)
    return trained


def metadata(card: str) -> dict:
    """The card's metadata block, read as the Hub reads it: YAML between the first two
    ``---`` lines."""
    assert card.startswith("---\n")
    block = card.split("\n---\n", 1)[0].removeprefix("---\n")
    return yaml.safe_load(block)


def serve_line(card: str) -> list[str]:
    lines = [line for line in card.splitlines() if line.startswith("vllm serve ")]
    assert len(lines) == 1, card
    return shlex.split(lines[0])


def test_the_metadata_block_names_the_target_method_and_datasets(evaluated):
    meta = metadata(mc.model_card(evaluated, CFG))
    # the embedded target is the Hub model it was made from
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "vllm"
    assert meta["tags"] == ["speculative-decoding", methods.EAGLE3.name, "eaglet"]
    # Hub datasets only: the packaged sources' origins and the hf source, not a local file
    assert meta["datasets"] == [
        "anon8231489123/ShareGPT_Vicuna_unfiltered",
        "openai/openai_humaneval",
        "org/chats",
    ]
    assert "license" not in meta  # the run does not know one
    assert mc.front_matter(mc.model_card(evaluated, CFG)) == meta


def test_a_hub_target_is_the_base_model_and_what_vllm_serves(evaluated):
    target = read_json(evaluated / "target" / "target.json")
    write_json(
        evaluated / "target" / "target.json",
        {
            **target,
            "spec": "meta-llama/Llama-3.1-8B-Instruct",
            "hub_id": "meta-llama/Llama-3.1-8B-Instruct",
        },
    )
    cfg = {**CFG, "target": {"model": "meta-llama/Llama-3.1-8B-Instruct"}}
    card = mc.model_card(evaluated, cfg)
    assert metadata(card)["base_model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert serve_line(card)[2] == "meta-llama/Llama-3.1-8B-Instruct"
    # a local target is named as the config names it
    local = {**CFG, "target": {"model": "/models/my-llama"}}
    write_json(evaluated / "target" / "target.json", {**target, "spec": "/models/my-llama"})
    assert metadata(mc.model_card(evaluated, local))["base_model"] == "/models/my-llama"


def test_the_serve_command_serves_the_target_with_serve_json(evaluated):
    card = mc.model_card(evaluated, CFG)
    serve = read_json(evaluated / "eval" / "serve.json")
    argv = serve_line(card)
    assert argv[:3] == ["vllm", "serve", str(evaluated / "target")]
    assert argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == serve["speculative_config"]
    assert mc.card_spec(card) == serve["speculative_config"]
    assert serve["speculative_config"]["method"] == methods.EAGLE3.served_as
    # published: the same config, the drafter named by its repo id, the (local) target by
    # the Hub model it is
    named = serve_line(mc.name_drafter(card, "me/drafter"))
    assert named[2] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert json.loads(named[4]) == {**serve["speculative_config"], "model": "me/drafter"}


def test_the_card_holds_the_verdict_the_drafter_and_the_data(evaluated):
    card = mc.model_card(evaluated, CFG)
    acceptance = read_json(evaluated / "eval" / "acceptance.json")
    assert acceptance["verdict"]["summary"] in card
    assert all(w in card for w in acceptance["verdict"]["warnings"])
    run = next(r for r in acceptance["runs"] if r["name"] == "eagle3_k3")
    assert "| eagle3_schedule (serve.json) |" in card  # the run that checked serve.json
    row = next(line for line in card.splitlines() if line.startswith("| eagle3_k3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    low = run["by_concurrency"][0]
    assert cells[1] == f"{run['acceptance_length']:.2f}"
    assert cells[2:4] == [
        f"{run['sets'][s]['acceptance_length']:.2f}" for s in ("heldout", "everyday")
    ]
    assert cells[4] == (
        f"{low['speedup']:.2f}x [{low['speedup_low']:.2f}, {low['speedup_high']:.2f}]"
    )
    params = sum(int(np.prod(s)) for n, s in SHAPES.items() if n not in ("d2t", "t2d"))
    assert f"Parameters: {params:,}" in card
    assert f"Draft vocabulary: {VD:,} of the target's {V:,} tokens" in card
    assert "[2, 15, 27]" in card and "EAGLE-3" in card
    assert "284 training samples, 36,512 tokens" in card
    assert "sharegpt (anon8231489123/ShareGPT_Vicuna_unfiltered): at most 330 rows" in card
    assert "Training: 8 steps; the last weights ship (step 8, epoch 2.0)" in card


def test_a_fine_tuned_drafters_card_names_the_drafter_it_started_from(trained):
    """train.init_from: the card named the method and the training, never the published
    drafter the weights began as."""
    assert "Fine-tuned from" not in mc.model_card(trained, CFG)
    start = trained / "start_drafter" / "start.json"
    start.parent.mkdir(parents=True, exist_ok=True)
    record = {"source": "org/published-eagle3", "format": "speculators"}
    start.write_text(json.dumps({**record, "from_drafter": ["fc.weight"] * 7, "new": []}))
    card = mc.model_card(trained, CFG)
    assert "Fine-tuned from: `org/published-eagle3` (speculators format; 7 tensors" in card


def test_a_card_before_evaluation_says_not_evaluated_yet(trained):
    card = mc.model_card(trained, CFG)
    assert "Not evaluated yet" in card
    assert "| eagle3_k3 |" not in card and "| eagle3_schedule (serve.json) |" not in card
    # served as the method's record serves it, at the first k of the sweep
    spec = methods.EAGLE3.speculative_config((trained / "drafter").resolve(), 2)
    assert json.loads(serve_line(card)[4]) == spec
    assert metadata(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_an_evaluation_older_than_the_weights_is_not_this_drafters(evaluated):
    weights = evaluated / "drafter" / "model.safetensors"
    later = time.time() + 60
    os.utime(weights, (later, later))  # trained again after the evaluation
    card = mc.model_card(evaluated, CFG)
    assert "Not evaluated yet" in card
    assert read_json(evaluated / "eval" / "acceptance.json")["verdict"]["summary"] not in card


def test_a_card_of_a_run_with_nothing_yet_degrades_to_what_exists(tmp_path):
    card = mc.model_card(tmp_path, CFG)
    assert metadata(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "Not evaluated yet" in card and "Not exported yet" in card
    assert mc.write_card(tmp_path, CFG) is None  # no drafter to write it into


def test_the_card_is_written_into_the_drafter_and_the_speculators_copy(evaluated):
    from eaglet.model.export import export_speculators

    path = mc.write_card(evaluated, CFG)
    assert path == evaluated / "drafter" / "README.md"
    assert path.read_text() == mc.model_card(evaluated, CFG)
    # the recorded config stands in for none given
    write_json(evaluated / "run" / "config.json", CFG)
    assert mc.model_card(evaluated) == path.read_text()
    export_speculators(evaluated / "drafter", evaluated / "spec", str(evaluated / "target"), 3)
    assert (evaluated / "spec" / "README.md").read_text() == path.read_text()


def test_the_report_page_shows_the_card(evaluated):
    write_json(evaluated / "run" / "config.json", CFG)
    for page in (first_page(evaluated, CFG), report_texts(evaluated)["first_page"]):
        text = plain(rendered(page))
        assert "Model card" in text
        assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in text
        card = mc.model_card(evaluated, CFG)
        assert " ".join(" ".join(serve_line(card)[:4]).split()) in text
        assert json.dumps(mc.card_spec(card)) in text


def test_the_report_page_shows_the_card_once_evaluated(trained):
    # before evaluation the page says what the run has done; the card waits for the verdict
    assert "Model card" not in plain(rendered(first_page(trained, CFG)))
    time.sleep(0.01)
    write_evaluation(trained)
    assert "Model card" in plain(rendered(first_page(trained, CFG)))


# -- eaglet publish ---------------------------------------------------------------------------


@pytest.fixture
def card_dir(evaluated) -> Path:
    mc.write_card(evaluated, CFG)
    return evaluated / "drafter"


def test_publish_refuses_a_directory_without_card_config_or_weights(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["publish", str(tmp_path), "me/drafter"]) == 1
    err = capsys.readouterr().err
    assert "has no README.md, model.safetensors" in err and "Traceback" not in err
    assert main(["publish", str(tmp_path / "absent"), "me/drafter"]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_publish_refuses_a_bad_repo_id_and_a_local_base_model(card_dir, capsys):
    assert main(["publish", str(card_dir), "drafter"]) == 1
    assert "'drafter' is not a Hugging Face repo id: give OWNER/NAME" in capsys.readouterr().err
    card = (card_dir / "README.md").read_text()
    (card_dir / "README.md").write_text(
        card.replace("base_model: HuggingFaceTB/SmolLM2-135M-Instruct", "base_model: /models/mine")
    )
    assert main(["publish", str(card_dir), "me/drafter"]) == 1
    assert (
        "base_model '/models/mine', which is not a Hugging Face model id" in capsys.readouterr().err
    )


def test_publish_uploads_the_folder_as_the_repo_with_the_card_naming_it(
    card_dir, monkeypatch, capsys
):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_repo",
        lambda self, repo_id, **kw: (
            calls.append(("create", repo_id, kw)) or f"https://huggingface.co/{repo_id}"
        ),
    )
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "upload_folder",
        lambda self, **kw: calls.append(("upload", kw["repo_id"], kw)),
    )
    assert main(["publish", str(card_dir), "me/drafter", "--private"]) == 0
    assert "published" in capsys.readouterr().out
    assert [c[:2] for c in calls] == [("create", "me/drafter"), ("upload", "me/drafter")]
    assert calls[0][2]["private"] is True and calls[0][2]["exist_ok"] is True
    assert Path(calls[1][2]["folder_path"]) == card_dir
    # the uploaded card serves the uploaded drafter
    assert mc.card_spec((card_dir / "README.md").read_text())["model"] == "me/drafter"


def test_publish_says_where_the_token_is_missing(card_dir, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_repo",
        lambda *a, **kw: pytest.fail("no upload without a token"),
    )
    assert main(["publish", str(card_dir), "me/drafter"]) == 1
    err = capsys.readouterr().err
    assert "no Hugging Face token" in err and "hf auth login" in err and "HF_TOKEN" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("offline", [True, False])
def test_publish_says_where_the_network_is_missing(card_dir, monkeypatch, capsys, offline):
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import _http

    httpx = getattr(_http, "httpx2", None) or _http.httpx  # the client huggingface_hub uses

    def unreachable(*args, **kwargs):
        if offline:  # what huggingface_hub raises with HF_HUB_OFFLINE=1
            raise OfflineModeIsEnabled(
                "Cannot reach https://huggingface.co/api/repos/create: offline mode is enabled."
            )
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = (card_dir / "README.md").read_text()
    assert main(["publish", str(card_dir), "me/drafter"]) == 1
    err = capsys.readouterr().err
    assert "could not reach the Hugging Face Hub" in err and "Traceback" not in err
    assert ("unset it" in err) if offline else ("no network to huggingface.co" in err)
    # not published: the local card still serves the local drafter, not the repo it failed
    # to create
    assert (card_dir / "README.md").read_text() == before


@pytest.mark.subprocess  # git says what the commit is
def test_the_card_names_the_checkouts_commit_as_git_does():
    import subprocess

    from eaglet.tools.model_card import checkout_commit
    from tests.helpers.paths import REPO

    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    )
    if git.returncode:
        pytest.skip("not a git checkout")
    assert checkout_commit(REPO) == git.stdout.strip()
