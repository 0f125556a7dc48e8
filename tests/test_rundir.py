"""Run folders: the files a run leaves, atomic writes, the metrics log."""

import dataclasses
import json
import math
import os
import shlex

import pytest
import torch

from rcdl.app.rundir import (
    RunDir,
    atomic_save_torch,
    atomic_write_bytes,
    atomic_write_json,
    environment_info,
    resume_command,
    to_jsonable,
)


@dataclasses.dataclass(frozen=True)
class _Config:
    lr: float = 0.1
    sizes: tuple[int, ...] = (2, 3)


def test_create_writes_config_and_environment(tmp_path):
    run = RunDir.create("exp", root=tmp_path, config=_Config(), device="cpu")
    assert run.path.parent == tmp_path and run.path.name.startswith("exp-")
    assert json.loads(run.file("config.json").read_text()) == {"lr": 0.1, "sizes": [2, 3]}
    env = json.loads(run.file("environment.json").read_text())
    for key in ("python", "torch", "device", "cuda_available", "num_threads", "cpu_model",
                "platform", "hostname", "git_revision", "git_dirty", "command"):  # fmt: skip
        assert key in env
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"


def test_named_runs_in_the_same_second_get_distinct_folders(tmp_path):
    paths = {RunDir.create("exp", root=tmp_path).path for _ in range(3)}
    assert len(paths) == 3


def test_exact_path_refuses_an_existing_run(tmp_path):
    RunDir.create("exp", path=tmp_path / "run", config=_Config())
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunDir.create("exp", path=tmp_path / "run", config=_Config())


def test_out_at_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError) as error:
        RunDir.create("exp", path=tmp_path / "notes.txt")
    assert str(error.value) == (f"--out {tmp_path / 'notes.txt'} is a file, not a folder: "
                                "give --out a new (or empty) folder for the run")
    with pytest.raises(FileExistsError, match=r"notes.txt is a file, not a folder"):
        RunDir.create("exp", path=tmp_path / "notes.txt" / "run")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_out_at_an_earlier_run_says_where_to_go(tmp_path):
    folder = tmp_path / "run"
    run = RunDir.create("exp", path=folder, config=_Config())
    # no summary yet, or one that says the run is not complete: unfinished
    for summary in (None, {"complete": False}):
        if summary is not None:
            run.write_summary(summary)
        with pytest.raises(FileExistsError) as error:
            RunDir.create("exp", path=folder, resume_with="rcdl reproduce exp")
        assert str(error.value) == (
            f"--out {folder} already holds a run that did not finish: continue it with "
            f"`rcdl reproduce exp --resume {folder.resolve()}`, or choose another --out for "
            "a new run")
        # a command that cannot resume (the demo) is not told to
        with pytest.raises(FileExistsError, match="already holds a run .config.json exists.: "
                           "choose another --out") as error:
            RunDir.create("exp", path=folder)
        assert "--resume" not in str(error.value)
    for summary in ({"complete": True}, {"models": {}}):  # the demo's has no "complete"
        run.write_summary(summary)
        with pytest.raises(FileExistsError) as error:
            RunDir.create("exp", path=folder, resume_with="rcdl reproduce exp")
        assert str(error.value) == (
            f"--out {folder} already holds a finished run: choose another --out for a new "
            "run, or delete that folder to redo it")


def test_the_command_line_reports_a_taken_out_as_a_usage_error(tmp_path, capsys):
    from rcdl.app.cli import main

    teacher = ["reproduce", "teacher-student", "--n-train", "48", "--n-test", "24", "--d-in",
               "8", "--teacher-width", "16", "--seeds", "0", "--eval-every", "4", "--device",
               "cpu", "--no-progress"]  # fmt: skip
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main([*teacher, "--out", str(tmp_path / "notes.txt")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Errno" not in err
    assert f"--out {tmp_path / 'notes.txt'} is a file, not a folder" in err
    folder = tmp_path / "run"
    assert main([*teacher, "--out", str(folder)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([*teacher, "--out", str(folder)])
    assert exit_.value.code == 2
    assert f"--out {folder} already holds a finished run" in capsys.readouterr().err
    summary = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**summary, "complete": False}))
    with pytest.raises(SystemExit) as exit_:
        main([*teacher, "--out", str(folder)])
    assert exit_.value.code == 2
    assert (f"continue it with `rcdl reproduce teacher-student --resume {folder.resolve()}`"
            in capsys.readouterr().err)


def test_attach_to_missing_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        RunDir(tmp_path / "nope")


def test_metrics_are_appended_one_json_line_each(tmp_path):
    run = RunDir.create("exp", path=tmp_path)
    assert run.read_metrics() == []
    run.log(step=0, loss=1.5)
    run.log({"step": 1}, loss=float("nan"), entries=torch.tensor(3))
    lines = run.file("metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == {"step": 0, "loss": 1.5}
    last = run.read_metrics()[1]
    assert last["step"] == 1 and math.isnan(last["loss"]) and last["entries"] == 3


def test_summary_is_written(tmp_path):
    run = RunDir.create("exp", path=tmp_path)
    run.write_summary({"mse": 0.25, "path": tmp_path})
    assert json.loads(run.file("summary.json").read_text()) == {"mse": 0.25, "path": str(tmp_path)}


def test_atomic_write_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(b"old", path)
    atomic_write_bytes(b"new", path)
    assert path.read_bytes() == b"new"
    assert os.listdir(path.parent) == ["f.bin"]


def test_failed_atomic_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "c.json"
    atomic_write_json({"a": 1}, path)
    with pytest.raises(TypeError, match="object"):
        atomic_write_json({"a": object()}, path)
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["c.json"]


def test_atomic_save_torch_round_trips(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    path = atomic_save_torch(state, tmp_path / "ckpt.pt")
    loaded = torch.load(path)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], state["w"])
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_to_jsonable_converts_torch_types_and_rejects_unknown():
    assert to_jsonable({"d": torch.device("cpu"), "t": torch.float64}) == {
        "d": "cpu",
        "t": "torch.float64",
    }
    with pytest.raises(TypeError, match="set"):
        to_jsonable({1, 2})


def test_environment_records_the_command_line():
    env = environment_info()
    assert isinstance(env["command"], list) and env["device"] is None


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        path = atomic_write_bytes(b"x", tmp_path / "f")
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o644


def test_resume_command_has_absolute_quoted_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my data").mkdir()
    command = resume_command("rcdl reproduce vit", "runs/vit-1", "my data")
    assert shlex.split(command) == ["rcdl", "reproduce", "vit", "--resume",
                                    str(tmp_path / "runs" / "vit-1"), "--data-dir",
                                    str(tmp_path / "my data")]  # fmt: skip
    assert resume_command("rcdl reproduce vit", "runs/vit-1") == (
        f"rcdl reproduce vit --resume {tmp_path / 'runs' / 'vit-1'}")


def test_resumable_prints_the_resume_command_on_interrupt(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = RunDir.create("exp", path="run")
    with pytest.raises(KeyboardInterrupt), run.resumable("rcdl reproduce exp", "."):
        raise KeyboardInterrupt
    err = capsys.readouterr().err
    assert (f"Interrupted. Continue with: rcdl reproduce exp --resume {tmp_path / 'run'} "
            f"--data-dir {tmp_path}") in err  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_the_machine_line_names_the_cpu_its_threads_and_the_world_size(threads, monkeypatch):
    from rcdl.app import rundir

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    line = rundir.describe_machine("cpu")
    assert rundir.cpu_model() in line and line.endswith(f"{threads} thread{'s' * (threads > 1)}")
    monkeypatch.setattr(rundir, "rank_and_world", lambda: (0, 3))
    assert rundir.describe_machine("cpu").endswith(
        "; 3 processes (torch.distributed, growing stores sharded over them)")


def test_the_environment_records_the_half_precision_options():
    import torch

    from rcdl.ops.half import half_products
    from rcdl.optim.half_adam import half_adam

    with half_products("float32"), half_adam("eager"):
        env = environment_info(torch.device("cpu"))
    assert env["half_products"] == "float32" and env["half_adam"] == "eager"
    assert env["half_product_paths"] == {"bfloat16": "float32 chunks",
                                         "float16": "float32 chunks"}
    assert env["half_adam_paths"] == {"bfloat16": "eager", "float16": "eager"}
    with half_products("native"):
        assert environment_info("cpu")["half_product_paths"]["bfloat16"] == "native"


def test_the_environment_records_the_instruction_set_caps(monkeypatch):
    """An emulated machine class (docs/precision.md) is told by the caps in effect."""
    import torch

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    env = environment_info("cpu")
    assert env["isa_caps"]["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert "MKL_ENABLE_INSTRUCTIONS" not in env["isa_caps"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_a_sub_run_collection_frees_the_new_cycles_and_gives_the_old_objects_back():
    """collecting_new_objects: inside, the objects made before are set aside (a collection
    scans only the new ones, which it still frees); after, the collector has them all."""
    import gc
    import weakref

    from rcdl.app.rundir import collecting_new_objects, release_memory

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    assert gc.get_freeze_count() == 0
    with collecting_new_objects():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with collecting_new_objects():  # nested: the outer freeze stays
            new = cycle()
            release_memory("cpu")
            assert new() is None  # the new cycle was collected
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
