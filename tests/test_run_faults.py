"""Run folders under faults: each test injects one (a disk that fills, an interrupt inside
torch's writer, a damaged or foreign folder, a torn metrics line, leftovers of a kill, a
second process on the folder) and checks what the command does: its exit status, its
message, and what it keeps."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rcdl.app.cli import main
from rcdl.app.experiments import teacher_student
from rcdl.app.rundir import RunDir

TEACHER = ["reproduce", "teacher-student", "--n-train", "48", "--n-test", "24", "--d-in", "8",
           "--teacher-width", "16", "--seeds", "0", "--eval-every", "4", "--device", "cpu",
           "--no-progress"]  # fmt: skip
CIFAR = ["reproduce", "cifar10-1epoch", "--train-size", "48", "--test-size", "24",
         "--eval-every", "2", "--checkpoint-every", "1", "--device", "cpu", "--no-progress",
         "--no-download"]  # fmt: skip


def interrupt_at(monkeypatch, call):
    """teacher-student's sub-run ``call`` (1-based) raises KeyboardInterrupt."""
    real, calls = teacher_student._train, {"n": 0}

    def train(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher_student, "_train", train)


def test_a_full_disk_says_what_failed_where_and_how_to_continue(data_dir, tmp_path,
                                                                monkeypatch, capsys):
    """ENOSPC while a checkpoint is moved into place: exit 1, the errno and the file, the
    resume command, no usage text; what was saved is kept, and the resume finishes."""
    import rcdl._io

    real = os.replace

    def full(src, dst):
        if ".step00000002" in str(dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst)

    monkeypatch.setattr(rcdl._io.os, "replace", full)
    out = tmp_path / "run"
    argv = [*CIFAR, "--data-dir", str(data_dir), "--models", "gws", "rbf"]
    assert main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "No space left on device (errno 28, ENOSPC) at" in err and ".step00000002.pt" in err
    assert f"--resume {out}" in err and "usage:" not in err
    assert not list(out.glob("checkpoints/.*.tmp"))  # the interrupted write left nothing
    monkeypatch.setattr(rcdl._io.os, "replace", real)
    assert main(["reproduce", "cifar10-1epoch", "--resume", str(out), "--data-dir",
                 str(data_dir), "--no-progress", "--no-download"]) == 0


def test_an_interrupt_that_torch_turns_into_another_error_exits_130(data_dir, tmp_path,
                                                                    monkeypatch, capsys):
    """Ctrl-C inside ``torch.save``: torch's zip writer raises its own error from the
    KeyboardInterrupt; the run is still reported as interrupted, with its resume command."""
    import rcdl.train.checkpoint

    real = rcdl.train.checkpoint.torch.save

    def save(obj, f, *args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from e

    monkeypatch.setattr(rcdl.train.checkpoint.torch, "save", save)
    out = tmp_path / "run"
    assert main([*CIFAR, "--data-dir", str(data_dir), "--models", "rbf", "--out", str(out)]) \
        == 130
    assert f"Interrupted. Continue with: rcdl reproduce cifar10-1epoch --resume {out}" in \
        capsys.readouterr().err
    monkeypatch.setattr(rcdl.train.checkpoint.torch, "save", real)


def test_resuming_an_empty_config_is_refused(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["reproduce", "teacher-student", "--resume", str(folder)])
    assert exit_.value.code == 2
    assert "not a complete config of this experiment" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]  # nothing written


def test_resuming_another_experiments_folder_is_refused(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*CIFAR, "--data-dir", str(data_dir), "--models", "rbf", "--out", str(out)]) \
        == 0
    before = (out / "summary.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["reproduce", "hybrid-tau-sweep", "--resume", str(out), "--data-dir",
              str(data_dir)])
    assert exit_.value.code == 2
    assert "is a run of cifar10-1epoch, not of hybrid-tau-sweep" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == before


def test_a_damaged_summary_is_named_on_resume(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    assert main([*TEACHER, "--out", str(folder)]) == 130
    (folder / "summary.json").write_text('{"runs": [1, 2,')
    capsys.readouterr()
    assert main(["reproduce", "teacher-student", "--resume", str(folder), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "summary.json is damaged" in err and "usage:" not in err and "--resume" in err


def test_a_torn_metrics_line_is_repaired_on_resume(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    assert main([*TEACHER, "--out", str(folder)]) == 130
    metrics = folder / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"model": "parametric", "step": 4, "test_m')  # a kill mid-append
    monkeypatch.undo()
    assert main(["reproduce", "teacher-student", "--resume", str(folder), "--no-progress"]) == 0
    assert "removed its torn last line" in capsys.readouterr().err
    records = RunDir(folder).read_metrics()  # every line parses again
    assert records and all("model" in r for r in records)
    with open(metrics, "a") as f:
        f.write("not json\n{}\n")
    with pytest.raises(ValueError, match=rf"metrics.jsonl: line {len(records) + 1} is damaged"):
        RunDir(folder).read_metrics()


def test_leftover_temporaries_are_removed_on_resume_and_at_the_end(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    assert main([*TEACHER, "--out", str(folder)]) == 130
    stale = folder / ".summary.json.x8z2.tmp"
    stale.write_bytes(b"half")
    monkeypatch.undo()
    assert main(["reproduce", "teacher-student", "--resume", str(folder), "--no-progress"]) == 0
    assert not list(folder.glob(".*.tmp")) and not (folder / ".lock").exists()


def test_a_session_is_recorded_when_it_starts(data_dir, tmp_path, monkeypatch):
    """Killed during its first model: summary.json already lists the session."""
    from rcdl.app.experiments.cifar10 import run as cifar10

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cifar10, "train_one_pass", killed)
    out = tmp_path / "run"
    assert main([*CIFAR, "--data-dir", str(data_dir), "--models", "rbf", "--out", str(out)]) \
        == 130
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["sessions"]) == 1 and not summary["complete"] and summary["runs"] == []


def test_out_pointing_at_a_folder_of_other_files_is_refused(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a run")
    with pytest.raises(SystemExit) as exit_:
        main([*TEACHER, "--out", str(folder)])
    assert exit_.value.code == 2
    assert "is not empty (notes.txt) and holds no run" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


@pytest.mark.spawns
def test_a_folder_another_process_runs_in_is_refused_until_that_process_dies(tmp_path,
                                                                            monkeypatch,
                                                                            capsys):
    folder = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    assert main([*TEACHER, "--out", str(folder)]) == 130
    monkeypatch.undo()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rcdl.app.rundir import RunDir; "
         "RunDir(sys.argv[1]).lock(); print('locked', flush=True); time.sleep(60)",
         str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        capsys.readouterr()
        assert main(["reproduce", "teacher-student", "--resume", str(folder),
                     "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert f"is in use by process {holder.pid}" in err
        assert json.loads((folder / "summary.json").read_text())["complete"] is False
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup: the OS drops the lock
        holder.wait()
        holder.stdout.close()
    time.sleep(0.05)
    assert main(["reproduce", "teacher-student", "--resume", str(folder), "--no-progress"]) == 0
