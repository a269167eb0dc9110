"""What `target.snapshot` asks the Hugging Face hub for: the files a target's tokenizer and
config need to load (its own code included), not everything in the repository."""

from __future__ import annotations

import pytest
from huggingface_hub.utils import filter_repo_objects

from eaglet.target.checkpoint import TargetError, snapshot

# A repository laid out like Kimi-K2.5's: a tokenizer that is code (tiktoken), a config that
# is code, a chat template file, sharded weights; and files no stage reads.
REPOSITORY = [
    "config.json",
    "configuration_kimi_k25.py",
    "configuration_deepseek.py",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer_config.json",
    "tokenization_kimi.py",
    "tiktoken.model",
    "special_tokens_map.json",
    "model.safetensors.index.json",
    "model-00001-of-000064.safetensors",
    "model-00064-of-000064.safetensors",
    "modeling_kimi_k25.py",
    "preprocessor_config.json",
    # a sentencepiece model, a tiktoken vocabulary, a merges file (other targets)
    "tokenizer.model",
    "cl100k_base.tiktoken",
    "merges.txt",
    "README.md",
    "LICENSE",
    "docs/deploy_guidance.md",
    "figures/logo.png",
    "original/consolidated.00.pth",
]
NOT_NEEDED = {
    "README.md",
    "LICENSE",
    "docs/deploy_guidance.md",
    "figures/logo.png",
    "original/consolidated.00.pth",
}


@pytest.fixture
def asked(monkeypatch, tmp_path) -> dict:
    """Stand in for huggingface_hub.snapshot_download: record what it is asked for."""
    import huggingface_hub

    calls: dict = {}

    def fake(repo_id, **kwargs):
        calls.update(repo_id=repo_id, **kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return calls


def test_snapshot_fetches_what_the_tokenizer_and_config_need_and_no_more(asked, tmp_path):
    assert snapshot("moonshotai/Kimi-K2.5") == str(tmp_path)
    assert asked["repo_id"] == "moonshotai/Kimi-K2.5"
    fetched = set(
        filter_repo_objects(
            REPOSITORY,
            allow_patterns=asked["allow_patterns"],
            ignore_patterns=asked.get("ignore_patterns"),
        )
    )
    assert fetched == set(REPOSITORY) - NOT_NEEDED
    # the pieces a trust_remote_code tokenizer cannot load without
    assert {
        "tokenization_kimi.py",
        "tiktoken.model",
        "tokenizer_config.json",
        "chat_template.jinja",
        "configuration_kimi_k25.py",
    } <= fetched


def test_the_rehearsal_snapshot_fetches_no_weights(asked, tmp_path):
    """`eaglet rehearse` builds a miniature from the config and tokenizer files alone:
    kilobytes, where the weights are 554 GB."""
    snapshot("moonshotai/Kimi-K2.5", weights=False)
    fetched = set(filter_repo_objects(REPOSITORY, allow_patterns=asked["allow_patterns"]))
    assert not any(name.endswith(".safetensors") for name in fetched)
    assert {
        "config.json",
        "tokenization_kimi.py",
        "tiktoken.model",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= fetched


def test_a_hub_failure_names_the_id_and_what_to_do(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(TargetError, match=r"'org/model'.*no network.*target\.model"):
        snapshot("org/model")
