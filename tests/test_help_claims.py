"""The command line's help states no figure a reader cannot check: no run times, no speed
ratios. Where a help text speaks of speed it points at the page that gives the measurements
with their machine."""

import re

import pytest

from rcdl.app.cli import main
from rcdl.app.experiments import COMMANDS as EXPERIMENTS

COMMANDS = (["--help"], ["demo", "--help"], ["reproduce", "--help"], ["info", "--help"],
            *(["reproduce", name, "--help"] for name in sorted(EXPERIMENTS)))
FIGURE = re.compile(r"\d+(\.\d+)?\s*(s|sec|seconds|min|minutes|h|hours|x|×|times)\b"
                    r"|\btwice\b|several times", re.I)


def help_text(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:-1]) or "rcdl")
def test_help_gives_no_time_or_speed_figure(argv, capsys):
    text = help_text(argv, capsys)
    assert not FIGURE.search(text), FIGURE.search(text)
    for sentence in re.split(r"(?<=[.;)])\s", text):
        if re.search(r"\b(faster|slower|speed)\b", sentence):
            assert "docs/" in sentence or "results/" in sentence, sentence
