"""The README's Usage section runs as written and learns: growing, evaluation, saving and
resuming, the hybrid with its default gate and a scheduler."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def usage_code() -> str:
    text = README.read_text()
    usage = text[text.index("## Usage"):text.index("## Layout")]
    return "\n".join(re.findall(r"```python\n(.*?)```", usage, re.S))


def printed_number(printed: str, label: str) -> float:
    found = re.findall(rf"^{re.escape(label)} ([-+0-9.e]+)", printed, re.M)
    assert len(found) == 1, f"the README's code should print {label!r} once:\n{printed}"
    return float(found[0])


def test_usage_blocks_run_and_learn(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the blocks save checkpoints in the working folder
    code = usage_code()
    assert "HybridGrower" in code and "load_state_dict" in code
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    baseline = printed_number(printed, "predicting 0:")
    # each model beats always predicting zero by a wide margin (measured: 0.11, 0.25 vs 0.93)
    assert printed_number(printed, "RBF test MSE") < 0.3 * baseline
    assert printed_number(printed, "hybrid test MSE") < 0.5 * baseline
    # the hybrid's gate writes, and refuses: every layer grew past its 16 initial entries,
    # and the readout kept fewer than all 2 000 samples
    from rcdl import growing_layers
    sizes = {name: len(layer.store) for name, layer in growing_layers(namespace["model"])}
    assert all(n > 16 + 100 for n in sizes.values()), sizes
    assert sizes["readout"] < 16 + 2000, sizes
    assert (tmp_path / "run.pt").exists() and (tmp_path / "hybrid.pt").exists()
