"""Shared test setup, and the classes of tests by what they start."""

import contextlib
import multiprocessing.util
import os
import platform
import subprocess

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


# -- what a test starts: unit, subprocess, e2e, slurm (pyproject.toml registers them) ---------

CLASSES = ("unit", "subprocess", "e2e", "slurm")

# The standard library answers this once per process by running `uname -p`, py-cpuinfo
# (which vLLM's reasoning parsers import) runs `file -b` on the interpreter when imported, and
# matplotlib's font manager runs `fc-list` on a machine without its font cache yet (a fresh
# one): all done here, before any test, so that whichever test comes first is not counted as
# starting a process (run alone, the template-check tests were; on a fresh machine, the
# first test to draw a figure)
platform.processor()
with contextlib.suppress(ImportError):
    import cpuinfo  # noqa: F401
with contextlib.suppress(ImportError):
    import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config, items):
    """A test marked with none of the classes is a unit test; unit and another is a mistake."""
    for item in items:
        marked = [name for name in CLASSES if item.get_closest_marker(name)]
        if not marked:
            item.add_marker(pytest.mark.unit)
        elif "unit" in marked and len(marked) > 1:
            raise pytest.UsageError(
                f"{item.nodeid} is marked {' and '.join(marked)}: a unit test starts no process"
            )


class ProcessInUnitTest(RuntimeError):
    pass


@contextlib.contextmanager
def refusing_processes(started: list[str]):
    """Every way a test starts a process (subprocess, multiprocessing, a fork) refused and
    noted in ``started``."""

    def refuse(what: str):
        started.append(what)
        raise ProcessInUnitTest(f"a unit test started {what}")

    def command(args) -> str:
        words = [args] if isinstance(args, (str, bytes, os.PathLike)) else args
        return " ".join(
            os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in words
        )[:300]

    def execute_child(self, args, *rest, **kwargs):
        refuse(command(args))

    def spawnv_passfds(path, args, passfds):
        refuse(command(args))

    def fork():
        refuse("os.fork()")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", execute_child)
        patch.setattr(multiprocessing.util, "spawnv_passfds", spawnv_passfds)
        patch.setattr(os, "fork", fork)
        yield


def _in_process_only(item):
    """A unit test whose fixtures or body start a process fails and says to mark it
    ``subprocess``: `make test-fast` (-m unit) stays in-process and fast."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    started: list[str] = []
    with refusing_processes(started):
        try:
            return (yield)
        finally:
            if started:
                pytest.fail(
                    f"{item.nodeid} is a unit test but starts a process "
                    f"({started[0]}): mark it @pytest.mark.subprocess (or its module "
                    "with pytestmark)",
                    pytrace=False,
                )


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_in_process_only)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_in_process_only)
