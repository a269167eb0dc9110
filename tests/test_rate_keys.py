"""The rates file's kinds of work and their fields are declared once (eaglet.core.rates.FIELDS):
the stages record and status reads them by those names, and an undeclared one is refused."""

from __future__ import annotations

import ast

import pytest

from eaglet.core import rates
from tests.helpers.paths import SRC

CALLS = ("record", "lookup", "lookup_entry", "reference_entry", "_rate", "_server_start")


def test_every_rate_is_recorded_and_read_by_its_declared_name():
    literal = []
    for path in sorted((SRC / "eaglet").rglob("*.py")):
        if path.name == "rates.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            first = node.args[0]
            if name in CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                literal.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.args[0].value!r}")
    assert not literal, "a rate's kind of work named by a literal:\n" + "\n".join(literal)


def test_an_undeclared_rate_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_RATES", str(tmp_path / "rates.jsonl"))
    with pytest.raises(ValueError, match="not declared"):
        rates.record("extract_vlm", "t", tokens_per_s=1.0)
    with pytest.raises(ValueError, match="not declared"):
        rates.record(rates.PREFILL, "t", token_per_s=1.0)
    rates.record(rates.PREFILL, "t", tokens_per_s=2.0)
    assert rates.lookup(rates.PREFILL, rates.TOKENS_PER_S, "t") == 2.0
    with pytest.raises(ValueError, match="not declared"):
        rates.lookup(rates.PACK, "server_start_s", "t")
