"""Where the tests find the repository and the commands they run, in one place.

The commands are the ones installed beside the Python that runs the tests (the virtualenv's
``bin/``), so a test runs the Snakemake and ``eaglet`` of the environment under test, never
one found on PATH.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
TESTS = REPO / "tests"
STANDINS = TESTS / "standins"
TEST_CONFIGS = TESTS / "configs"
TINY = TEST_CONFIGS / "tiny.yaml"
HELPERS = TESTS / "helpers"

BIN = Path(sys.executable).parent
SNAKEMAKE = BIN / "snakemake"
EAGLET = BIN / "eaglet"


def pythonpath_env(*paths: Path | str, **extra: str) -> dict[str, str]:
    """This process's environment with ``paths`` put before its PYTHONPATH (which is kept, so
    a child imports the same eaglet as the tests), and ``extra`` set."""
    entries = [*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(entries), **extra}
