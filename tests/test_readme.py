"""The README's Python runs as the README says and learns: the first block alone (growing,
evaluation), then the later blocks after it (saving and resuming, the hybrid with its default
gate and a scheduler); the gate's shares and the half-precision figures it quotes are the
ones measured."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def printed_number(printed: str, label: str) -> float:
    found = re.findall(rf"^{re.escape(label)} ([-+0-9.e]+)", printed, re.M)
    assert len(found) == 1, f"the README's code should print {label!r} once:\n{printed}"
    return float(found[0])


def test_the_first_block_runs_alone_and_the_rest_continue_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the blocks save checkpoints in the working folder
    first, *rest = python_blocks()
    assert rest and "HybridGrower" in "".join(rest) and "load_state_dict" in "".join(rest)
    namespace: dict = {}
    exec(compile(first, f"{README} (first block)", "exec"), namespace)  # complete on its own
    alone = capsys.readouterr().out
    baseline = printed_number(alone, "predicting 0:")
    # the README's comments: about 0.11 against 0.93 for predicting zero
    assert printed_number(alone, "RBF test MSE") < 0.3 * baseline
    exec(compile("\n".join(rest), f"{README} (later blocks)", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed_number(printed, "hybrid test MSE") < 0.5 * baseline  # about 0.25
    assert (tmp_path / "run.pt").exists() and (tmp_path / "hybrid.pt").exists()

    # the gate's shares as the README quotes them: "89 % of the first block's samples, 51 %
    # of the second's and 18 % of the readout's" (sizes include 16 initial entries each)
    from rcdl import growing_layers

    text = README.read_text(encoding="utf-8")
    quoted = re.search(r"the gate keeps (\d+) % of the first block's samples, (\d+) % of the"
                       r"\s+second's and (\d+) %\s+of the readout's", text)
    assert quoted, "the README no longer quotes the gate's shares"
    sizes = {name: len(layer.store) for name, layer in growing_layers(namespace["model"])}
    shares = [100 * (sizes[n] - 16) / 2000 for n in ("blocks.0", "blocks.1", "readout")]
    for said, measured in zip(map(int, quoted.groups()), shares, strict=True):
        assert abs(said - measured) <= 3, (quoted.group(0), sizes)


def test_the_half_precision_figures_are_the_committed_ones():
    """The README's bfloat16 speed and accuracy figures appear in results/speed/precision/,
    which names their machine."""
    text = README.read_text(encoding="utf-8")
    claim = re.search(r"a full gws epoch took ([\d.]+) minutes instead of\s+([\d.]+) on a "
                      r"2-core Intel Xeon, at ([\d.]+) % against ([\d.]+) %", text)
    assert claim, "the README no longer gives the bfloat16 figures this test checks"
    committed = (ROOT / "results" / "speed" / "precision" / "README.md").read_text(encoding="utf-8")
    half, full, half_acc, full_acc = claim.groups()
    assert re.search(rf"\| gws, float32 \| {full_acc} \|.*\| {full} min \|", committed)
    assert re.search(rf"\| gws, bfloat16 \| {half_acc} \|.*\| {half} min \|", committed)


def test_the_install_page_first_model_runs_and_learns(capsys):
    page = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python\n(.*?)```", page, re.S)
    exec(compile(block, "docs/install.md", "exec"), {})
    assert printed_number(capsys.readouterr().out, "test MSE") < 0.3 * 0.93
