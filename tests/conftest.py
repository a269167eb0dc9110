"""Shared test setup."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def private_rate_history(tmp_path_factory):
    """Rates measured by test runs must not feed a user's `eaglet status` estimates."""
    path = tmp_path_factory.mktemp("rates") / "rates.jsonl"
    # nor does the shipped reference run's measurement feed the tests' (a test that reads
    # reference rates writes its own)
    previous = {key: os.environ.get(key) for key in ("EAGLET_RATES", "EAGLET_REFERENCE_RATES")}
    os.environ["EAGLET_RATES"] = str(path)
    os.environ["EAGLET_REFERENCE_RATES"] = ""
    yield path
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
