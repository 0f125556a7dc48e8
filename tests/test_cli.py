"""The ``rcdl`` command line as a user meets it: the resume command printed on Ctrl-C works
from any folder, ``--data-dir`` is checked at once, usage errors name the flag typed and show
the subcommand's usage, and the help and the README list every experiment once."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from rcdl.app import cifar
from rcdl.app.cli import experiment_spec, main
from rcdl.app.experiments import (
    COMMANDS,
    deltanet_decay,
    generalisation,
    memory_budget,
    optimizers,
    vit,
)
from rcdl.app.experiments.cifar10 import run as cifar10

# every experiment the package finds, and those that read a data set (--data-dir)
EXPERIMENTS = tuple(COMMANDS)
DATA_EXPERIMENTS = tuple(e for e in EXPERIMENTS if experiment_spec(e).load_data is not None)
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """No download, no $RCDL_DATA, and an empty cache folder of our own."""

    def no_download(*args, **kwargs):
        raise AssertionError("the command line tried to download the data")

    monkeypatch.setattr(cifar, "download_cifar", no_download)
    monkeypatch.setattr(cifar, "_open_url", no_download)
    monkeypatch.delenv("RCDL_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def _usage_error(argv, capsys) -> str:
    """Run ``rcdl argv``, check it is a usage error (status 2), return its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _error_message(err: str, command: str) -> str:
    """The message after ``<command>: error: `` (all its lines but the pointer to --help)."""
    message = err.split(f"{command}: error: ", 1)[1].rstrip("\n")
    return message.removesuffix(f"\nRun '{command} --help' for its usage and flags.")


# --------------------------------------------------------------------------- resume anywhere

# a tiny run of each experiment on the synthetic data, and the function that trains one of
# its sub-runs (replaced to simulate Ctrl-C before the first one finishes)
TINY_RUNS = {
    "cifar10-1epoch": (cifar10, "_train", ["--models", "rbf", "gws", "--train-size", "48",
                                           "--test-size", "24", "--eval-every", "2"]),
    "hybrid-tau-sweep": (cifar10, "_train", ["--taus", "50", "--references", "rbf",
                                             "--train-size", "48", "--test-size", "24",
                                             "--eval-every", "2"]),
    "generalisation": (generalisation, "_train", ["--train-size", "32", "--test-size", "16",
                                                  "--epochs", "1", "--train-eval-size", "16"]),
    "memory-budget": (memory_budget, "_train", ["--train-size", "48", "--test-size", "24",
                                                "--capacities", "20", "--policies", "oldest",
                                                "--slack", "0", "--eval-every", "2"]),
    "optimizers": (optimizers, "train_method", ["--datasets", "cifar10", "--methods",
                                                "mlp-sgd", "rbf", "--train-size", "48",
                                                "--test-size", "24", "--epochs", "1",
                                                "--width", "16"]),
    "deltanet-decay": (deltanet_decay, "train_method", ["--variants", "none", "deltanet",
                                                        "--train-size", "48", "--test-size",
                                                        "24", "--epochs", "1", "--width", "16",
                                                        "--depth", "2"]),
    "vit": (vit, "_train", ["--quick", "--train-size", "48", "--test-size", "24",
                            "--eval-every", "2"]),
}  # fmt: skip


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("experiment", list(TINY_RUNS))
def test_printed_resume_command_works_from_another_folder(experiment, data_dir, tmp_path,
                                                          monkeypatch, capsys):  # fmt: skip
    module, train, flags = TINY_RUNS[experiment]
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    relative_data = os.path.relpath(data_dir, start)

    real = getattr(module, train)
    monkeypatch.setattr(module, train, _interrupt)
    argv = ["reproduce", experiment, *flags, "--data-dir", str(relative_data), "--out", "run",
            "--device", "cpu", "--no-progress", "--no-download"]  # fmt: skip
    assert main(argv) == 130
    err = capsys.readouterr().err
    command = re.search(r"Continue with: (.+)", err).group(1)
    run = (start / "run").resolve()
    assert command == (f"rcdl reproduce {experiment} --resume {run} "
                       f"--data-dir {data_dir.resolve()}")  # fmt: skip
    saved = json.loads((run / "config.json").read_text())
    assert saved["data_dir"] == str(data_dir.resolve())  # absolute, not as typed

    monkeypatch.setattr(module, train, real)  # then run the command from elsewhere
    monkeypatch.chdir(elsewhere)
    words = shlex.split(command)
    assert words[:2] == ["rcdl", "reproduce"]
    assert main([*words[1:], "--no-progress", "--device", "cpu", "--no-download"]) == 0
    assert json.loads((run / "summary.json").read_text())["complete"]
    assert not (elsewhere / "runs").exists()  # nothing written where the command ran


def test_resume_of_a_run_started_without_data_dir_says_no_data_dir(tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    from rcdl.app.experiments import teacher_student

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(teacher_student, "_train", _interrupt)
    argv = ["reproduce", "teacher-student", "--quick", "--out", "run", "--no-progress"]
    assert main(argv) == 130
    command = re.search(r"Continue with: (.+)", capsys.readouterr().err).group(1)
    assert command == f"rcdl reproduce teacher-student --resume {(tmp_path / 'run').resolve()}"


# --------------------------------------------------------------------------- --data-dir


@pytest.mark.parametrize("experiment", DATA_EXPERIMENTS)
def test_missing_data_dir_is_an_error_at_once(experiment, tmp_path, capsys):
    missing = tmp_path / "no-such-folder"
    err = _usage_error(["reproduce", experiment, "--data-dir", str(missing)], capsys)
    assert err.startswith(f"rcdl reproduce {experiment}: error: ") and "usage:" not in err
    message = _error_message(err, f"rcdl reproduce {experiment}")
    assert message == f"argument --data-dir: no such folder: {missing}"
    assert not (tmp_path / "xdg-cache").exists()  # no download was prepared


def test_data_dir_that_is_a_file_is_an_error(tmp_path, capsys):
    file = tmp_path / "cifar10.npz"
    file.write_bytes(b"")
    err = _usage_error(["reproduce", "vit", "--data-dir", str(file)], capsys)
    assert f"argument --data-dir: {file} is a file; give the folder holding it" in err


@pytest.mark.parametrize("experiment", DATA_EXPERIMENTS)
def test_data_not_found_message_is_short(experiment, tmp_path, monkeypatch, capsys):
    def offline(name):
        raise OSError("offline")

    monkeypatch.setattr(cifar, "download_cifar", offline)
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = ["--datasets", "cifar10"] if experiment == "optimizers" else []
    argv = ["reproduce", experiment, "--quick", "--data-dir", str(empty), *extra,
            "--device", "cpu", "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    cache = tmp_path / "xdg-cache" / "rcdl"
    for download, why in ((["--no-download"], ""),
                          ([], "; the download failed (OSError: offline)")):  # fmt: skip
        err = _usage_error([*argv, *download], capsys)
        message = _error_message(err, f"rcdl reproduce {experiment}").splitlines()
        assert len(message) == 2
        assert message[0] == (f"CIFAR-10 not found: no cifar10.npz, cifar-10-batches-py/ or "
                              f"cifar-10-python.tar.gz in {empty} or {cache}{why}")
        assert "--data-dir" in message[1] and "--help" in message[1]


@pytest.mark.parametrize("experiment", DATA_EXPERIMENTS)
def test_data_dir_help_gives_the_search_order(experiment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", experiment, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    text = text[text.index("--data-dir DIR an existing folder"):]  # the flag's help
    for earlier, later in (("there first", "$RCDL_DATA"), ("$RCDL_DATA", "~/.cache/rcdl"),
                           ("~/.cache/rcdl", "--no-download")):
        assert text.index(earlier) < text.index(later)


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(("experiment", "argv", "message"), [
    ("cifar10-1epoch", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("cifar10-1epoch", ["--seeds", "1", "1"], "--seeds must not repeat, got [1, 1]"),
    ("hybrid-tau-sweep", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("hybrid-tau-sweep", ["--seed", "-1"], "--seed must be an int >= 0, got -1"),
    ("generalisation", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("generalisation", ["--epochs", "0"], "--epochs must be an int >= 1, got 0"),
    ("memory-budget", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("memory-budget", ["--slack", "2"], "--slack is a fraction of the capacity"),
    ("optimizers", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("optimizers", ["--epochs", "0"], "--epochs must be an int >= 1, got 0"),
    ("deltanet-decay", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("deltanet-decay", ["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    ("teacher-student", ["--n-train", "0"], "--n-train must be an int >= 1, got 0"),
    ("vit", ["--train-size", "0"], "--train-size must be an int >= 1, got 0"),
    ("vit", ["--heads", "3"], "--heads (3) must divide width (64)"),
])  # fmt: skip
def test_errors_name_the_flag_and_point_to_the_subcommands_help(experiment, argv, message,
                                                             tmp_path, capsys):  # fmt: skip
    data = [] if experiment == "teacher-student" else ["--data-dir", str(tmp_path),
                                                       "--no-download"]
    err = _usage_error(["reproduce", experiment, *argv, *data], capsys)
    assert_message_first(err, f"rcdl reproduce {experiment}")
    assert _error_message(err, f"rcdl reproduce {experiment}").startswith(message)
    assert "Config" not in err
    assert not (tmp_path / "runs").exists()


def test_a_too_large_subset_names_the_flag(data_dir, tmp_path, capsys):
    argv = ["reproduce", "vit", "--quick", "--train-size", "100", "--data-dir", str(data_dir),
            "--device", "cpu", "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    err = _usage_error(argv, capsys)
    assert "rcdl reproduce vit: error: --train-size 100 is larger than the 64 images" in err


def assert_message_first(err: str, prog: str) -> None:
    """A usage error is the message, then one line pointing to the command's --help (not
    argparse's usage block, which would push the message out of sight)."""
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"{prog}: error: ") and "usage:" not in err, err
    assert lines[-1] == f"Run '{prog} --help' for its usage and flags.", err


def test_demo_error_points_to_the_demo_help(capsys):
    err = _usage_error(["demo", "--seed", "-1"], capsys)
    assert_message_first(err, "rcdl demo")
    assert "rcdl demo: error: --seed must be >= 0, got -1" in err


def test_an_unknown_flag_points_to_the_subcommands_help(capsys):
    err = _usage_error(["reproduce", "teacher-student", "--data-dir", "."], capsys)
    assert_message_first(err, "rcdl reproduce teacher-student")
    assert "rcdl reproduce teacher-student: error: unrecognized arguments: --data-dir ." in err


def test_saved_config_errors_name_the_file_not_the_class(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"width": 0}')
    err = _usage_error(["reproduce", "vit", "--resume", str(tmp_path)], capsys)
    assert (f"cannot use the saved config {tmp_path / 'config.json'}: width must be an int "
            ">= 1, got 0") in err  # fmt: skip
    assert "ViTConfig" not in err


# --------------------------------------------------------------------------- listings


def test_reproduce_help_lists_each_experiment_once(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in EXPERIMENTS:
        entries = re.findall(rf"^\s+{re.escape(name)}(?:\s|$)", out, flags=re.MULTILINE)
        assert len(entries) == 1, (name, out)
    listed = re.findall(r"^ {4}([a-z0-9-]+)(?:\s|$)", out, flags=re.MULTILINE)
    assert listed == list(EXPERIMENTS)  # every experiment, and no other


def test_every_experiment_has_its_subcommand(capsys):
    for name in EXPERIMENTS:
        with pytest.raises(SystemExit) as exc:
            main(["reproduce", name, "--help"])
        assert exc.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: rcdl reproduce {name} ")


def test_readme_lists_every_experiment_command():
    commands = set(re.findall(r"^rcdl reproduce ([a-z0-9-]+)",
                              README.read_text(encoding="utf-8"), flags=re.MULTILINE))
    missing, unknown = sorted(set(EXPERIMENTS) - commands), sorted(commands - set(EXPERIMENTS))
    assert not missing, (f"README.md's experiment list (section 'The experiments') has no line "
                         f"`rcdl reproduce NAME ...  # what it measures` for {missing}; add one")
    assert not unknown, f"README.md lists `rcdl reproduce` {unknown}, which no module declares"


# --------------------------------------------------------------------------- --threads

TINY_TEACHER_STUDENT = ["reproduce", "teacher-student", "--n-train", "48", "--n-test", "24",
                        "--d-in", "8", "--teacher-width", "16", "--seeds", "0",
                        "--eval-every", "4", "--device", "cpu", "--no-progress"]  # fmt: skip


@pytest.fixture
def torch_threads():
    """torch's thread count, put back after the test (``--threads`` sets it for the process);
    the test starts from 2 threads, so that ``--threads 1`` visibly changes it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_threads_are_set_before_the_run_and_recorded_as_environment(tmp_path, monkeypatch,
                                                                    torch_threads):  # fmt: skip
    from rcdl.app.experiments import teacher_student
    from rcdl.app.rundir import cpu_isa, machine_key

    seen, real = [], teacher_student._train

    def train(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher_student, "_train", train)
    run = tmp_path / "run"
    assert main([*TINY_TEACHER_STUDENT, "--threads", "1", "--out", str(run)]) == 0
    assert seen and set(seen) == {1}  # every sub-run trained on one thread
    environment = json.loads((run / "environment.json").read_text())
    assert environment["num_threads"] == 1
    assert machine_key(cpu_isa(), environment["torch"], environment["num_threads"]).endswith(
        "/ 1 thread")
    assert ", 1 thread." in (run / "results.md").read_text()  # the report's machine line
    assert "threads" not in json.loads((run / "config.json").read_text())  # no setting

    # not a setting of the run: --resume takes it (a finished run has nothing left to do)
    assert main(["reproduce", "teacher-student", "--resume", str(run), "--threads", "2",
                 "--no-progress"]) == 0  # fmt: skip
    assert torch.get_num_threads() == 2


def test_demo_takes_threads(tmp_path, torch_threads, capsys):
    assert main(["demo", "--quick", "--threads", "1", "--no-progress",
                 "--out", str(tmp_path / "demo")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "demo" / "environment.json").read_text())["num_threads"] == 1


@pytest.mark.parametrize("command", [["reproduce", "teacher-student"], ["demo"]],
                         ids=lambda c: c[-1])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_below_one_is_a_usage_error_naming_the_flag(command, value, tmp_path,
                                                            torch_threads, capsys):  # fmt: skip
    err = _usage_error([*command, "--threads", value, "--out", str(tmp_path / "run")], capsys)
    prog = "rcdl " + " ".join(command)
    assert_message_first(err, prog)
    assert _error_message(err, prog) == f"argument --threads: must be an int >= 1, got {value}"
    assert torch.get_num_threads() == 2 and not (tmp_path / "run").exists()


def test_threads_help_suggests_one_thread_on_a_shared_machine(capsys):
    for command in (["reproduce", "vit"], ["demo"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--threads N the number of CPU threads torch computes with" in text
        assert "try one thread per process" in text
        assert "--threads 1, or OMP_NUM_THREADS=1" in text
