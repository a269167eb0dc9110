"""The `eaglet` command: its usage lists every subcommand's options, read from the parsers."""

from __future__ import annotations

import re

import pytest

from eaglet.tools import plan
from eaglet.tools.cli import COMMANDS, main
from tests.helpers.paths import STANDINS


def options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", text))


def test_the_usage_lists_every_option_of_eaglet_plan(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    flags = {flag for action in plan.build_parser()._actions for flag in action.option_strings}
    assert {
        "--tokens",
        "--drafter-attention",
        "--drafter-variant",
        "--method",
        "--stream-window",
    } <= flags
    missing = flags - options(text)
    assert not missing, f"`eaglet --help` leaves out eaglet plan's {sorted(missing)}"


@pytest.mark.parametrize("command", COMMANDS)
def test_the_usage_lists_what_each_command_accepts(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    own = capsys.readouterr().out
    assert own.startswith(f"usage: eaglet {command} ")
    assert main([]) == 0
    top = capsys.readouterr().out
    assert f"eaglet {command} " in top
    assert options(own.split("\n\n", 1)[0]) <= options(top)


def test_an_unknown_command_is_refused(capsys):
    assert main(["plna"]) == 2
    assert "unknown command 'plna'" in capsys.readouterr().err


BAD_CONFIGS = {
    "a missing file": (None, "config file {path} does not exist"),
    "broken YAML": ("target: [1\n", "config file {path} is not valid YAML at line 2"),
    "an invalid setting": (
        "target:\n  dtype: float64\n",
        "invalid configuration:\n  target.dtype: 'float64' is not one of",
    ),
    "not a mapping": ("- a\n- b\n", "config file {path} holds a list, not a mapping"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
@pytest.mark.parametrize("command", ["plan", "status", "rehearse"])
def test_a_bad_config_is_said_in_one_message_never_a_traceback(command, case, tmp_path, capsys):
    """`eaglet plan --config BAD`, `eaglet status --config BAD` and a ConfigError in `eaglet
    rehearse` printed Python tracebacks. One name, --configfile, for all three (and
    Snakemake); --config stays an alias."""
    text, said = BAD_CONFIGS[case]
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    extra = ["--out", str(tmp_path / "rehearsal")] if command == "rehearse" else []
    assert main([command, "--configfile", str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert said.format(path=path) in captured.err
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.subprocess  # plan asks vLLM in a subprocess
def test_plan_reads_an_unprepared_targets_own_files_and_names_a_missing_directory(tmp_path, capsys):
    """eaglet plan refused a run whose target was not prepared yet (for a hub model that
    means its weights), with a hint lacking --configfile: it plans from the target's config
    files, as rehearse does; a local target.model that is no directory is said so."""
    standin = STANDINS / "qwen3-8b"
    config = tmp_path / "run.yaml"
    config.write_text(f"results_dir: {tmp_path / 'results'}\ntarget: {{model: {standin}}}\n")
    assert main(["plan", "--configfile", str(config)]) == 0
    assert "hidden 4096, 36 layers, vocab 151936" in capsys.readouterr().out
    config.write_text(
        f"results_dir: {tmp_path / 'results'}\ntarget: {{model: {tmp_path / 'no' / 'such'}}}\n"
    )
    assert main(["plan", "--configfile", str(config)]) == 2
    err = capsys.readouterr().err
    assert "is a local path, and there is no directory there" in err and "hub" not in err
