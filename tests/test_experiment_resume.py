"""Resume-after-interrupt of the experiments made of independent sub-runs (generalisation,
memory-budget, optimizers, deltanet-decay, teacher-student, vit): a run interrupted after its
first sub-run, then resumed, skips that sub-run and ends with the same results as an
uninterrupted run; the CLI's ``--resume`` refuses flags that would change the run."""

import json
from dataclasses import dataclass
from typing import Any

import pytest

from rcdl.app.cli import main
from rcdl.app.experiments import (
    deltanet_decay,
    generalisation,
    memory_budget,
    optimizers,
    teacher_student,
    vit,
)
from rcdl.app.rundir import RunDir, open_run, read_config


@pytest.fixture(scope="module")
def data_dir(data_dir):
    """The shared random CIFAR-10 (tests/conftest.py), as a string path."""
    return str(data_dir)


# --------------------------------------------------------------------------- the experiments


@dataclass(frozen=True)
class Case:
    """One experiment at a tiny size: its module, the function that trains one sub-run (the
    one to interrupt), its ``run_*`` function, config and extra arguments, and the names of
    its sub-runs in training order."""

    module: Any
    sub_run: str
    run: str
    config: Any  # data_dir -> config
    names: tuple[str, ...]
    kwargs: tuple = (("download", False),)

    def start(self, data_dir: str, **kw: Any) -> dict[str, Any]:
        run = getattr(self.module, self.run)
        _, summary = run(self.config(data_dir), progress=False, **dict(self.kwargs), **kw)
        return summary


CASES = {
    "generalisation": Case(
        generalisation, "_train", "run_generalisation",
        lambda d: generalisation.GeneralisationConfig(
            train_size=32, test_size=16, epochs=2, train_eval_size=16, data_dir=d,
            device="cpu"),
        ("gws-seed0", "parametric-seed0"),
    ),
    "memory-budget": Case(
        memory_budget, "_train", "run_memory_budget",
        lambda d: memory_budget.MemoryBudgetConfig(
            train_size=48, test_size=24, capacities=(20,), policies=("oldest", "random"),
            eval_every=2, slack=0.0, data_dir=d, device="cpu"),
        ("unbounded", "oldest-20", "random-20"),
    ),
    "optimizers": Case(
        optimizers, "train_method", "run_optimizer_comparison",
        lambda d: optimizers.OptimizerComparisonConfig.quick(
            datasets=("cifar10",), methods=("mlp-sgd", "gws", "rbf"), train_size=48,
            test_size=24, epochs=2, width=16, data_dir=d, device="cpu"),
        ("cifar10-mlp-sgd-seed0", "cifar10-gws-seed0", "cifar10-rbf-seed0"),
    ),
    "deltanet-decay": Case(
        deltanet_decay, "train_method", "run_deltanet_decay",
        lambda d: deltanet_decay.DeltaNetDecayConfig.quick(
            train_size=48, test_size=24, epochs=2, width=16, depth=2, batch_size=16,
            data_dir=d, device="cpu"),
        ("none-seed0", "weight-decay-seed0", "deltanet-seed0"),
    ),
    "teacher-student": Case(
        teacher_student, "_train", "run_teacher_student",
        lambda d: teacher_student.TeacherStudentConfig(
            n_train=48, n_test=24, d_in=8, teacher_width=16, mlp_width=16, seeds=(0, 1),
            eval_every=4, device="cpu"),
        ("gws-seed0", "parametric-seed0", "mlp-seed0", "gws-seed1", "parametric-seed1",
         "mlp-seed1"),
        kwargs=(),
    ),
    "vit": Case(
        vit, "_train", "run_vit",
        lambda d: vit.ViTConfig.quick(train_size=48, test_size=24, eval_every=2,
                                      patch_size=8, data_dir=d, device="cpu"),
        ("mlp-seed0", "rcdl-seed0"),
    ),
}  # fmt: skip


def _outcome(obj: Any) -> Any:
    """``obj`` without its timings (any key naming seconds): what must not change."""
    if isinstance(obj, dict):
        return {k: _outcome(v) for k, v in obj.items() if "seconds" not in k}
    if isinstance(obj, list):
        return [_outcome(v) for v in obj]
    return obj


def _counting(real, interrupt_at: int | None = None):  # noqa: ANN001, ANN202
    """``real`` wrapped to count its calls and raise KeyboardInterrupt at call
    ``interrupt_at``."""

    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        if wrapper.calls == interrupt_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_interrupted_run_resumes_to_the_same_result(case, data_dir, tmp_path, monkeypatch,
                                                    capsys):  # fmt: skip
    reference = case.start(data_dir, out=tmp_path / "reference")
    capsys.readouterr()
    real = getattr(case.module, case.sub_run)
    folder = tmp_path / "run"

    monkeypatch.setattr(case.module, case.sub_run, _counting(real, interrupt_at=2))
    with pytest.raises(KeyboardInterrupt):
        case.start(data_dir, out=folder)
    err = capsys.readouterr().err
    assert f"Continue with: rcdl reproduce {case.module.EXPERIMENT} --resume {folder}" in err
    assert list(RunDir(folder).finished()) == [case.names[0]]

    spy = _counting(real)
    monkeypatch.setattr(case.module, case.sub_run, spy)
    summary = case.start(data_dir, resume=folder)
    assert spy.calls == len(case.names) - 1  # the first sub-run was not trained again
    assert f"{case.names[0]}: finished in an earlier session, skipped" in capsys.readouterr().out
    assert list(RunDir(folder).finished()) == list(case.names)
    assert summary["complete"]
    assert _outcome(summary) == _outcome(reference)
    assert json.loads((folder / "summary.json").read_text()) == summary
    for name in ("results.md", "results.csv"):
        assert (folder / name).is_file(), name
    assert {p.name for p in folder.glob("*.png")} == {
        p.name for p in (tmp_path / "reference").glob("*.png")
    }

    again = case.start(data_dir, resume=folder)  # a finished run: nothing left to train
    assert spy.calls == len(case.names) - 1 and _outcome(again) == _outcome(reference)


# --------------------------------------------------------------------------- the API's errors


def test_out_and_resume_together_is_an_error(data_dir, tmp_path):
    with pytest.raises(ValueError, match="give either out .* or resume .*, not both"):
        CASES["vit"].start(data_dir, out=tmp_path / "a", resume=tmp_path / "b")


def test_resume_refuses_another_config(data_dir, tmp_path):
    cfg = CASES["teacher-student"].config(data_dir)
    open_run("teacher-student", cfg, out=tmp_path / "run")
    changed = teacher_student.TeacherStudentConfig(**{**cfg.__dict__, "n_train": 64})
    with pytest.raises(ValueError, match=r"differs from the saved one .*'n_train': \(48, 64\)"):
        teacher_student.run_teacher_student(changed, resume=tmp_path / "run", progress=False)
    moved = generalisation.GeneralisationConfig(data_dir="/elsewhere")  # only where the data is
    open_run("generalisation", generalisation.GeneralisationConfig(), out=tmp_path / "gen")
    assert open_run("generalisation", moved, resume=tmp_path / "gen").path == tmp_path / "gen"


def test_unreadable_saved_config_names_its_path(tmp_path):
    cls = vit.ViTConfig
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no run to resume"):
        read_config(tmp_path, cls)
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot read the saved config {path}"):
        read_config(tmp_path, cls)
    path.write_text('{"width": 0}')
    with pytest.raises(ValueError, match=f"cannot use the saved config {path}: ViTConfig: "
                                         "width must be an int >= 1"):
        read_config(tmp_path, cls)


# --------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize(("argv", "flags"), [
    (["generalisation", "--epochs", "3"], "--epochs"),
    (["memory-budget", "--no-unbounded", "--quick"], "--no-unbounded, --quick"),
    (["optimizers", "--no-projection"], "--no-projection"),
    (["deltanet-decay", "--paper", "--seeds", "1"], "--seeds, --paper"),
    (["teacher-student", "--out", "elsewhere"], "--out"),
    (["vit", "--width", "32"], "--width"),
], ids=lambda v: v[0] if isinstance(v, list) else None)  # fmt: skip
def test_cli_resume_refuses_flags_that_change_the_run(argv, flags, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", argv[0], "--resume", str(tmp_path), *argv[1:]])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"--resume continues a run with its saved config; drop {flags}" in err


def test_cli_resume_of_a_folder_without_a_run_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "vit", "--resume", str(tmp_path / "none")])
    assert exc.value.code == 2 and "holds no run to resume" in capsys.readouterr().err


def test_cli_interrupt_prints_the_resume_command_and_resume_finishes(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    folder = tmp_path / "run"
    argv = ["reproduce", "teacher-student", "--n-train", "48", "--n-test", "24", "--d-in", "8",
            "--teacher-width", "16", "--seeds", "0", "--eval-every", "4", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    real = teacher_student._train
    monkeypatch.setattr(teacher_student, "_train", _counting(real, interrupt_at=3))
    assert main([*argv, "--out", str(folder)]) == 130
    err = capsys.readouterr().err
    assert f"rcdl reproduce teacher-student --resume {folder}" in err

    spy = _counting(real)
    monkeypatch.setattr(teacher_student, "_train", spy)
    assert main(["reproduce", "teacher-student", "--resume", str(folder), "--no-progress"]) == 0
    assert spy.calls == 1  # gws and parametric finished before the interrupt
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] and [r["model"] for r in summary["runs"]] == [
        "gws", "parametric", "mlp"]
