"""The `eaglet` command: its usage lists every subcommand's options, read from the parsers."""

from __future__ import annotations

import re

import pytest

from eaglet import plan
from eaglet.cli import COMMANDS, main


def options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", text))


def test_the_usage_lists_every_option_of_eaglet_plan(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    flags = {flag for action in plan.build_parser()._actions for flag in action.option_strings}
    assert {"--tokens", "--drafter-attention", "--drafter-variant", "--method",
            "--stream-window"} <= flags
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
