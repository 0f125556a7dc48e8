"""The ``rcdl`` command line: ``rcdl demo``, ``rcdl reproduce``, ``rcdl forget``, ``rcdl info``,
``rcdl --version``.

``rcdl reproduce NAME`` is generated from the experiment's declaration
(:class:`rcdl.app.runner.Experiment`, ``EXPERIMENT_SPEC`` in its module): every field of
its config declared with ``cli=True`` (:func:`rcdl.app.config.setting`) becomes the flag
``--field-name`` with the field's help, metavar and choices, and its default appended to
the help; a bool that defaults to true becomes ``--no-field-name``. Beside those, every
experiment takes ``--quick`` (and ``--paper`` where the config has that scale; both help
texts list the settings they change), its ``switches``, and the common ``--data-dir``,
``--no-download``, ``--out``, ``--resume``, ``--device``, ``--no-progress`` and
``--threads`` (which ``rcdl demo`` takes too), and the experiment's options (on/off flags;
those of :data:`_VALUED_OPTIONS` take a value). Nothing is written twice: a default or a help
text lives in the config only.

Building a command's flags imports its experiment's module, and with it what that
experiment trains with. So :func:`main` builds only the subcommands the command line can
reach (:func:`_experiments_reached`): no experiment for ``rcdl --help``, ``rcdl demo`` or
``rcdl info``, the one named for ``rcdl reproduce NAME ...``, and every one where ``rcdl
reproduce`` answers itself (its ``--help`` lists them, and so does the error for a missing or
unknown name). The experiment modules import plotting libraries only inside the functions
that draw.

The generator is a few dozen lines over ``argparse`` rather than a library such as
``tyro`` or ``simple-parsing``: the commands' flag names, the ``--no-NAME`` form, presets
(``--quick``/``--paper``) that fill the config before the flags, ``--resume`` refusing
flags that would change a run, and errors phrased in flags were all fixed before the
generator existed, and each library would have needed overrides for most of them.

``--data-dir`` must name an existing folder and is saved as an absolute path, so ``--resume
RUN_DIR`` works from any working folder. ``--threads N`` sets the CPU threads (torch's and
numba's: :func:`rcdl.options.set_threads`) before anything runs; it is no setting of the run
(not in ``config.json``, free to change on ``--resume``), and ``environment.json`` records
the count the run used. ``main`` returns the exit status: 0 on success, 2 for a usage error
(bad flag or value, reported in terms of the subcommand's flags, then a line pointing to its
``--help``), 1 for a failed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import shlex
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rcdl._version import __version__
from rcdl.app.experiments import COMMANDS, MAIN

__all__ = ["build_parser", "entry", "main"]

# the experiments register themselves: their package finds them (rcdl.app.experiments.COMMANDS)
EXPERIMENTS = COMMANDS
_COMMON = ("data_dir", "device")  # config fields set by the common flags


class CLIError(Exception):
    """A usage error with a message for the user (exit status 2)."""


def experiment_spec(name: str) -> Any:
    """The :class:`rcdl.app.runner.Experiment` of ``rcdl reproduce name``."""
    return importlib.import_module(f"rcdl.app.experiments.{EXPERIMENTS[name]}").EXPERIMENT_SPEC


# --------------------------------------------------------------------------- flags from configs


_DATA_DIR_HELP = (
    "an existing folder holding cifar10.npz, the extracted cifar-10-batches-py/ or "
    "cifar-10-python.tar.gz (cifar100.npz, cifar-100-python/ or cifar-100-python.tar.gz "
    "for CIFAR-100). rcdl looks there first, then in $RCDL_DATA, then in the cache folder "
    "$XDG_CACHE_HOME/rcdl (default ~/.cache/rcdl); if none holds the data, it downloads "
    "the official archive into the cache (unless --no-download)"
)
_DATA_NOT_FOUND_HINT = ("Give --data-dir DIR, a folder holding one of them (--help shows "
                        "where else rcdl looks).")


def _data_dir(text: str) -> str:
    """``--data-dir``: an existing folder, returned as an absolute (resolved) path, so the
    run config records it independently of the working folder."""
    path = Path(text).expanduser().resolve()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such folder: {path}")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give the folder holding it")
    return str(path)


def _positive_int(text: str) -> int:
    """A count given on the command line (``--threads``, ``--replay-every``): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


_THREADS_HELP = (
    "the number of CPU threads torch computes with, and numba's kernels with it "
    "(rcdl.options.set_threads), set before anything runs and recorded in the run folder's "
    "environment.json{resume} (default: "
    "torch's, from $OMP_NUM_THREADS or the core count). On a machine other processes are "
    "using, try one thread per process (docs/install.md compares the two): --threads 1, "
    "or OMP_NUM_THREADS=1"
)


# experiment options (Experiment.options: not settings, not in config.json) that take a
# value, with its parser and metavar; every other option is an on/off flag
_VALUED_OPTIONS = {"replay_every": (_positive_int, "N")}


def _add_threads(parser: argparse.ArgumentParser, resume: bool) -> None:
    resume_note = "; not a setting of the run, so --resume takes it too" if resume else ""
    parser.add_argument("--threads", type=_positive_int, metavar="N",
                        help=_THREADS_HELP.format(resume=resume_note))


def _flag(name: str, negated: bool = False) -> str:
    return f"--{'no-' if negated else ''}{name.replace('_', '-')}"


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join("always" if v is None else str(v) for v in value)
    return str(value)


def _field_help(f: dataclasses.Field) -> str:
    meta = f.metadata
    text = meta.get("flag_help") or meta["help"]
    default = meta.get("default_text")
    if default is None and f.default is not None and not isinstance(f.default, bool):
        default = _shown(f.default)
    return text if default is None else f"{text} (default: {default})"


def config_flags(config_cls: type) -> list[dataclasses.Field]:
    """The fields of ``config_cls`` that have a flag."""
    return [f for f in dataclasses.fields(config_cls)
            if f.metadata.get("cli", False) and f.name not in _COMMON]


def _add_field(parser: argparse.ArgumentParser, config_cls: type, f: dataclasses.Field) -> None:
    from rcdl.app.config import field_type

    kind, is_tuple, _ = field_type(config_cls, f.name)
    meta = f.metadata
    if kind is bool:
        parser.add_argument(_flag(f.name, negated=f.default is True), dest=f.name,
                            action="store_const", const=not f.default, help=_field_help(f))
        return
    metavar = meta.get("metavar") or ("K" if f.name.endswith("seed") else None)
    kw: dict[str, Any] = {"type": meta.get("parse") or kind, "metavar": metavar,
                          "help": _field_help(f)}  # fmt: skip
    if meta.get("choices") and kind is str:
        kw["choices"] = meta["choices"]
    if is_tuple:
        kw["nargs"] = "+"
    parser.add_argument(_flag(f.name), dest=f.name, **kw)


def _preset_help(preset: Mapping[str, Any], what: str) -> str:
    settings = ", ".join(f"{k.replace('_', '-')} {_shown(v)}" for k, v in preset.items())
    return f"{what}: {settings}" if settings else what


def _add_common(parser: argparse.ArgumentParser, spec: Any) -> None:
    """The scale, data, device, output, resume and display flags every experiment takes."""
    config = spec.config
    parser.add_argument("--quick", action="store_true",
                        help=_preset_help(config.QUICK, "the smoke-test scale"))
    if config.PAPER is not None:
        parser.add_argument("--paper", action="store_true",
                            help=_preset_help(config.PAPER, "the paper's scale"))
    for name, (text, _) in spec.switches.items():
        parser.add_argument(_flag(name), action="store_true", help=text)
    if spec.load_data is not None:
        parser.add_argument("--data-dir", type=_data_dir, metavar="DIR", help=_DATA_DIR_HELP)
        parser.add_argument("--no-download", action="store_true",
                            help="never download the data set when no local copy is found")
    parser.add_argument("--out", metavar="DIR",
                        help=f"run folder to write (default: runs/{spec.name}-<timestamp>)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run with "
                        "its saved config: finished sub-runs are skipped, the others rerun")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="default: auto (CUDA when available)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    _add_threads(parser, resume=True)
    for flag, text in spec.options.items():
        if flag in _VALUED_OPTIONS:
            parse, metavar = _VALUED_OPTIONS[flag]
            parser.add_argument(_flag(flag), type=parse, metavar=metavar, help=text)
        else:
            parser.add_argument(_flag(flag), action="store_true", help=text)
    if spec.combine is not None:
        parser.add_argument("--combine", nargs="+", metavar="RUN_DIR", help="train nothing: "
                            "merge the finished runs of these folders (same protocol) into one "
                            "table and figure in --out")


def _add_experiment(which: argparse._SubParsersAction, name: str) -> None:
    spec = experiment_spec(name)
    parser = which.add_parser(name, help=spec.help, description=spec.description)
    for f in config_flags(spec.config):
        _add_field(parser, spec.config, f)
    _add_common(parser, spec)
    parser.set_defaults(func=_cmd_reproduce, command_parser=parser, spec=spec)


# --------------------------------------------------------------------------- running


def _settings(args: argparse.Namespace, spec: Any) -> dict[str, Any]:
    """The config settings the flags give: the switches' presets, then the fields given,
    which win (``--full --orders 0`` is the full preset in the natural order only)."""
    settings: dict[str, Any] = {}
    for name, (_, extra) in spec.switches.items():
        if getattr(args, name):
            settings |= extra
    return settings | {f.name: getattr(args, f.name) for f in config_flags(spec.config)
                       if getattr(args, f.name) is not None}


def _given(args: argparse.Namespace, spec: Any, also: Sequence[str] = ()) -> list[str]:
    """The flags given that set the experiment (refused beside ``--resume``/``--combine``)."""
    given = [_flag(f.name, negated=f.default is True) for f in config_flags(spec.config)
             if getattr(args, f.name) is not None]
    given += [_flag(n) for n in (*spec.switches, "quick", "paper", *also)
              if getattr(args, n, None)]
    return given


def _new_config(args: argparse.Namespace, spec: Any, settings: dict[str, Any]) -> Any:
    """The config at the scale of ``--quick`` or ``--paper`` (or its defaults), with
    ``settings`` on top."""
    if args.quick and getattr(args, "paper", False):
        raise ValueError("give --quick or --paper, not both")
    if args.quick:
        return spec.config.quick(**settings)
    if getattr(args, "paper", False):
        return spec.config.paper(**settings)
    return spec.config(**settings)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    """``rcdl reproduce NAME``: a new run, a resumed one, or (where offered) a combination
    of finished ones; the run itself is :func:`rcdl.app.runner.run_experiment`'s."""
    from rcdl.app.cifar import CorruptDataError
    from rcdl.app.rundir import read_config, resolve_device
    from rcdl.distributed import init_from_env, rank_and_world

    spec = args.spec
    if not spec.shards and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sharded = [name for name in EXPERIMENTS if experiment_spec(name).shards]
        raise CLIError(f"rcdl reproduce {spec.name} does not run under torchrun yet "
                       f"({', '.join(sharded)} do); run it as one process")
    if getattr(args, "combine", None) is not None:
        return _combine(args, spec)
    try:
        if args.resume is not None:
            given = _given(args, spec, also=("out",))
            if given:
                raise CLIError(f"--resume continues a run with its saved config; drop "
                               f"{', '.join(given)}")
            cfg = read_config(args.resume, spec.saved_config or spec.config)
        else:  # a new run records the device asked for; a resumed one may change it
            cfg = _new_config(args, spec, _settings(args, spec))
            if args.device is not None:
                cfg = dataclasses.replace(cfg, device=args.device)
        if getattr(args, "data_dir", None) is not None:
            cfg = dataclasses.replace(cfg, data_dir=args.data_dir)
        device = resolve_device(args.device or cfg.device)
    except (OSError, CorruptDataError, ValueError) as e:  # bad settings or run folder
        raise CLIError(str(e)) from e
    options = {flag: getattr(args, flag) for flag in spec.options}
    if options.get("replay_every") is not None and not options.get("keep_models"):
        raise CLIError("--replay-every records a replay log for the kept models; give "
                       "--keep-models too")
    if spec.load_data is not None:
        options["download"] = not args.no_download
    distributed = spec.shards and init_from_env(device)
    if distributed and rank_and_world()[0] != 0:  # one rank reports; errors reach stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    try:
        spec.run(cfg, out=args.out, resume=args.resume, device=device,
                 progress=not args.no_progress, **options)
    except (OSError, CorruptDataError, ValueError) as e:  # bad settings, data or run folder
        raise CLIError(str(e)) from e
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _combine(args: argparse.Namespace, spec: Any) -> int:
    """``--combine RUN_DIR ... --out DIR``: one table from finished runs, by the experiment's
    :class:`rcdl.app.runner.Combine`: its ``keep`` settings pick what to combine (any other
    flag that sets a run is refused); ``show`` prints the combined ``results.md``."""
    keep, show = spec.combine.keep, spec.combine.show
    given = [flag for flag in _given(args, spec, also=("resume",))
             if flag not in {_flag(k) for k in keep}]
    if given:
        raise CLIError(f"--combine trains nothing; drop {', '.join(given)}")
    if args.out is None:
        raise CLIError("--combine needs --out DIR, the folder for the combined table")
    try:
        folder, combined = spec.combine.runs(args.combine, args.out,
                                             **{k: getattr(args, k) for k in keep})
    except (OSError, ValueError) as e:  # missing folders, other protocols, duplicates
        raise CLIError(str(e)) from e
    if show:
        print((folder / "results.md").read_text(encoding="utf-8"), end="")
    print(f"Combined {len(combined['runs'])} runs into {folder}")
    return 0


# --------------------------------------------------------------------------- errors


def _explain(error: CLIError, parser: argparse.ArgumentParser) -> str:
    """The message of a usage error in the terms of the command line the user typed: data
    not found in two lines, and settings named by their flags (:func:`_in_flag_terms`)."""
    from rcdl.app.cifar import CifarNotFoundError

    if isinstance(error.__cause__, CifarNotFoundError):
        return f"{error.__cause__.brief}\n{_DATA_NOT_FOUND_HINT}"
    return _in_flag_terms(str(error), parser)


_CONFIG_CLASS = re.compile(r"\b[A-Z]\w*Config: ")
# a setting's name at the start of a message about it ("train_size must be", "slack is",
# "heads (3) must divide", "train_size 100 is larger"); not a path such as "out/run holds"
_LEADING_SETTING = re.compile(r"[a-z][a-z0-9_]*(?= (?:must|is|are|\(|\d))")


def _in_flag_terms(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` without the experiments' config class names ("Cifar10Config: "), and
    with a leading setting name replaced by the flag of ``parser`` that sets it:
    "Cifar10Config: train_size must be an int >= 1, got 0" becomes "--train-size must be
    an int >= 1, got 0"."""
    message = _CONFIG_CLASS.sub("", message)
    match = _LEADING_SETTING.match(message)
    if match is None:
        return message
    flag = "--" + match.group().replace("_", "-")
    if flag not in parser._option_string_actions:  # argparse has no public list of its flags
        return message
    return flag + message[match.end():]


# --------------------------------------------------------------------------- other commands


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from rcdl.app.rundir import cpu_flags, cpu_isa, cpu_model, machine_key, resolve_device

    device = resolve_device("auto")
    threads = torch.get_num_threads()  # --threads, when given, is set before this runs
    print(f"rcdl {__version__}")
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    print(f"device: {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
    print(f"cpu: {cpu_model()} ({os.cpu_count()} CPUs; flags {' '.join(cpu_flags()) or 'none'})")
    print(f"threads: {threads}")
    print(f"machine class: {machine_key(cpu_isa(), torch.__version__, threads)} "
          "(quick results reproduce exactly within one class: docs/results.md)")
    return 0


def _cmd_forget(args: argparse.Namespace) -> int:
    """``rcdl forget RUN_DIR --samples ...``: :func:`rcdl.app.forget_request.forget_request`,
    its refusals as usage errors (status 2, nothing changed); status 1 when the request was
    carried out but the final scan found a forgotten key (the receipt names where)."""
    from rcdl.app.forget_request import RequestRefused, forget_request

    try:
        result = forget_request(args.run_dir, args.samples, mode=args.mode, model=args.model,
                                seed=args.seed, data_dir=args.data_dir)
    except RequestRefused as e:
        raise CLIError(str(e)) from e
    print(result.describe())
    if not result.clean:
        print("rcdl forget: a forgotten sample's key is still in the run folder (see the "
              "receipt's file_scan.hits)", file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.demo import DemoConfig, run_demo
    from rcdl.app.rundir import resolve_device

    if args.seed is not None and args.seed < 0:
        raise CLIError(f"--seed must be >= 0, got {args.seed}")
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CLIError(str(e)) from e
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    if args.seed is not None:
        cfg = dataclasses.replace(
            cfg, seed=args.seed, teacher=dataclasses.replace(cfg.teacher, seed=args.seed)
        )
    try:
        run_demo(cfg, out=args.out, device=device, progress=not args.no_progress)
    except FileExistsError as e:
        raise CLIError(str(e)) from e
    rcdl = invocation()
    print(f"\nAvailable commands (see `{rcdl} --help` and `{rcdl} COMMAND --help`):")
    print(_command_list(rcdl))
    print(f"The real experiments start with {experiment_spec(MAIN).help}: "
          f"{rcdl} reproduce {MAIN} --help")
    return 0


def invocation() -> str:
    """How to run ``rcdl`` again from the shell this process was started in: ``rcdl`` where
    that name on ``PATH`` is this interpreter's own script, else ``<this interpreter> -m
    rcdl`` (a virtual environment used without activating it, say, or a ``python -m rcdl``
    whose ``rcdl`` on ``PATH`` belongs to another Python)."""
    found = shutil.which("rcdl")
    scripts = Path(sysconfig.get_path("scripts")).resolve()
    if found is not None and Path(found).resolve().parent == scripts:
        return "rcdl"
    return f"{shlex.quote(sys.executable)} -m rcdl"


_COMMANDS = {
    "demo": "teacher–student regression: a growing RBF net vs MLPs (SGD, Adam), one pass",
    "reproduce": "reproduce an experiment of the paper (see `rcdl reproduce --help`)",
    "forget": "forget training samples from a run's kept models (`rcdl reproduce "
              "cifar10-1epoch --keep-models`): edit them, clean the run folder, write a receipt",
    "info": "print the rcdl and torch versions, the device, CPU, threads and machine class "
            "rcdl would use",
}


def _command_list(rcdl: str = "rcdl") -> str:
    width = max(map(len, _COMMANDS))
    return "\n".join(f"  {rcdl} {name:<{width}} {help_.replace('`rcdl ', f'`{rcdl} ')}"
                     for name, help_ in _COMMANDS.items())


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors printed as the message first and one line pointing to
    ``--help`` instead of argparse's usage block (which for an experiment is 15+ lines that
    push the message out of sight). Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"Run '{self.prog} --help' for its usage and flags.\n")


def build_parser(experiments: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``rcdl`` and its subcommands.

    ``experiments`` limits the ``rcdl reproduce`` subcommands to those named (default: all
    of them); each one built imports its experiment's module."""
    parser = _Parser(
        prog="rcdl",
        description="Retrieval-Centric Deep Learning: growing nonparametric networks.",
    )
    parser.add_argument("--version", action="version", version=f"rcdl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help=_COMMANDS["demo"], description=_COMMANDS["demo"])
    demo.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    demo.add_argument("--out", metavar="DIR",
                      help="run folder to write (default: runs/demo-<timestamp>)")
    demo.add_argument("--seed", type=int, help="seed of the task, data order and models")
    demo.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    _add_threads(demo, resume=False)
    demo.set_defaults(func=_cmd_demo, command_parser=demo)

    reproduce = sub.add_parser(
        "reproduce", help=_COMMANDS["reproduce"],
        description="Reproduce an experiment of the paper. `rcdl reproduce EXPERIMENT --help` "
        "lists the flags of one experiment.",
    )  # fmt: skip
    which = reproduce.add_subparsers(title="experiments", dest="experiment",
                                     metavar="EXPERIMENT", required=True)
    for name in EXPERIMENTS if experiments is None else experiments:
        _add_experiment(which, name)

    forget = sub.add_parser(
        "forget", help=_COMMANDS["forget"],
        description="A deletion request against a run folder of `rcdl reproduce cifar10-1epoch "
        "--keep-models`: each kept model (and its replay log) forgets the samples and is saved "
        "back, every other file of the folder holding their data is removed, a receipt is "
        "appended to forget_receipts.jsonl, and every file of the folder is scanned for the "
        "samples' keys. Bad input changes nothing. See docs/unlearning.md.")
    forget.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    forget.add_argument("--samples", required=True, metavar="IDS_OR_FILE",
                        help="the training samples to forget: their indices into the run's "
                        "training set, comma-separated (3,17,42), or a file of them "
                        "(separated by commas, spaces or lines; # starts a comment)")
    forget.add_argument("--mode", choices=("fast", "repair", "exact"), default="fast",
                        help="fast: remove the samples' entries (rcdl.forget); repair: remove "
                        "them and re-write the readout (rcdl.forget_and_repair); exact: the "
                        "model trained without them, bit for bit (forget_exactly; needs the "
                        "replay log of --replay-every) (default: fast)")
    forget.add_argument("--model", metavar="NAME",
                        help="only this kept model (default: every kept model)")
    forget.add_argument("--seed", type=int, metavar="S",
                        help="only the kept models of this seed (default: every seed)")
    forget.add_argument("--data-dir", type=_data_dir, metavar="DIR",
                        help="where the run's data are, for --mode repair and exact (default: "
                        "the run's data_dir); never downloaded")
    _add_threads(forget, resume=False)
    forget.set_defaults(func=_cmd_forget, command_parser=forget)

    info = sub.add_parser("info", help=_COMMANDS["info"], description=_COMMANDS["info"])
    info.add_argument("--threads", type=_positive_int, metavar="N",
                      help="report for N CPU threads, as `--threads N` on a run would set them "
                      "(default: torch's, from $OMP_NUM_THREADS or the core count)")
    info.set_defaults(func=_cmd_info, command_parser=info)
    return parser


def entry() -> int:
    """The ``rcdl`` command: :func:`main` after tuning the allocator for training
    (:func:`rcdl.app.allocator.keep_freed_memory`; ``RCDL_MALLOC=system`` turns that off)."""
    from rcdl.app.allocator import keep_freed_memory

    keep_freed_memory()
    return main()


def _experiments_reached(argv: Sequence[str]) -> list[str] | None:
    """The experiments whose subcommands parsing ``argv`` can reach, for
    :func:`build_parser`: none unless the command is ``reproduce``; the one named right
    after ``reproduce``; all of them (``None``) where ``rcdl reproduce`` itself answers (its
    ``--help``, a missing or unknown name), whose message lists them."""
    words = iter(argv)
    command = next((w for w in words if not w.startswith("-")), None)
    if command != "reproduce":  # rcdl takes no option with a value before its command
        return []
    name = next(words, None)
    return [name] if name in EXPERIMENTS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rcdl`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_experiments_reached(argv))
    args, unknown = parser.parse_known_args(argv)  # exits with status 2 on a usage error
    if unknown:  # reported with the subcommand's usage, not that of rcdl
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "threads", None) is not None:  # before anything runs, the data included
        from rcdl.options import set_threads

        set_threads(args.threads)
    try:
        return args.func(args)
    except CLIError as e:
        command: argparse.ArgumentParser = args.command_parser  # the subcommand's: its usage
        command.error(_explain(e, command))  # prints the message and exits with status 2
    except KeyboardInterrupt:
        print("rcdl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # failures of a run once its folder exists: no usage text
        from rcdl.app.rundir import RunFailed, RunFolderBusy

        if isinstance(e, RunFailed):  # what failed, where and how to go on are printed
            return 1
        if isinstance(e, RunFolderBusy):
            print(f"rcdl: {e}", file=sys.stderr)
            return 1
        raise
