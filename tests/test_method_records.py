"""One record per method: every literal name of a method lives in ``eaglet.core.methods``, and
what planning, checking and serving read of a method comes from its record."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eaglet.core import methods
from eaglet.core.config import schema
from tests.helpers.paths import REPO

ROOT = REPO
RECORDS = ROOT / "src" / "eaglet" / "core" / "methods.py"
NAMES = (
    {m.name for m in methods.METHODS.values()}
    | set(methods.VARIANTS)
    | {v.label for v in methods.VARIANTS.values()}
    | {m.served_as for m in methods.METHODS.values()}
    | set(methods.SPECULATIONS)
)


def _keys(tree: ast.AST) -> set[int]:
    """The string constants that name a setting or a field, not a method: docstrings, dict
    keys, subscripts and the first argument of ``.get`` / ``.pop`` / ``.setdefault``."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            out.add(id(body[0].value))
        elif isinstance(node, ast.Dict):
            out.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            out.add(id(node.slice))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
        ):
            out.add(id(node.args[0]))
    return out


def method_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    keys = _keys(tree)
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in NAMES
        and id(node) not in keys
    ]


def test_no_method_name_outside_the_records():
    files = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))
    found = [hit for path in files if path != RECORDS for hit in method_literals(path)]
    assert not found, (
        "method names compared or built outside eaglet.core.methods (read the "
        "method's record instead):\n" + "\n".join(found)
    )
    # the search finds what it looks for: the records module itself names every method
    assert {hit.rpartition(": ")[2].strip("'") for hit in method_literals(RECORDS)} == NAMES


def test_the_schema_offers_the_records():
    train = schema()["properties"]["train"]["properties"]
    assert train["method"]["enum"] == list(methods.METHODS)
    assert train["method"]["default"] == methods.DEFAULT.name
    assert train["drafter_variant"]["enum"] == list(methods.VARIANTS)
    assert train["drafter_attention"]["enum"] == list(methods.ATTENTION_KINDS)


@pytest.mark.parametrize("name", list(methods.METHODS))
def test_each_record_refuses_what_vllm_cannot_build(name):
    m = methods.method(name)
    for attention in methods.ATTENTION_KINDS:
        for variant in methods.VARIANTS:
            refused = m.refusal(attention, variant)
            fits = attention in m.attentions and variant in m.variants
            assert (refused is None) == fits, (name, attention, variant, refused)
            if refused:  # the reason names the method, what it takes and why
                assert name in refused and m.requirement in refused
    assert "none of" in m.refusal("sparse", methods.EAGLE3_LAYER.name)
    with pytest.raises(ValueError, match="none of"):
        methods.method(name + "x")


def test_an_exported_config_names_its_method():
    assert methods.from_config({}) is methods.EAGLE3
    assert methods.from_config({"parallel_drafting": True}) is methods.PEAGLE
    assert methods.from_config({"architectures": [methods.DFLASH.architecture]}) is methods.DFLASH
    # every method is told apart from every other by what its export writes
    for m in methods.METHODS.values():
        config = {
            "architectures": [m.architecture] if m.architecture else [],
            **({m.config_flag: True} if m.config_flag else {}),
        }
        assert methods.from_config(config) is m


def test_served_config_and_cost():
    spec = methods.PEAGLE.speculative_config("d", 3)
    assert spec == {
        "method": methods.EAGLE3.served_as,
        "num_speculative_tokens": 3,
        "model": "d",
        "parallel_drafting": True,
    }
    assert methods.EAGLE3.layer_passes(5) == 5 and methods.PEAGLE.layer_passes(5) == 5
    assert methods.DFLASH.layer_passes(5, layers=2) == 12
    assert methods.variant_of({"fc_norm": True, "norm_output": True}) is methods.EAGLE31
    assert methods.variant_of({"fc_norm": True}) is methods.EAGLE3_LAYER
