"""Shared test setup."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def private_rate_history(tmp_path_factory):
    """Rates measured by test runs must not feed a user's `eaglet status` estimates."""
    path = tmp_path_factory.mktemp("rates") / "rates.jsonl"
    previous = os.environ.get("EAGLET_RATES")
    os.environ["EAGLET_RATES"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("EAGLET_RATES", None)
    else:
        os.environ["EAGLET_RATES"] = previous
