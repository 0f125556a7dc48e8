"""The README's Usage section runs as written (growing, evaluation, saving and resuming,
the hybrid with a scheduler)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def usage_code() -> str:
    text = README.read_text()
    usage = text[text.index("## Usage"):text.index("## Layout")]
    return "\n".join(re.findall(r"```python\n(.*?)```", usage, re.S))


def test_usage_blocks_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the blocks save checkpoints in the working folder
    code = usage_code()
    assert "HybridGrower" in code and "load_state_dict" in code
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "test MSE" in printed
    assert (tmp_path / "run.pt").exists() and (tmp_path / "hybrid.pt").exists()
