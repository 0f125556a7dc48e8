"""The ``rcdl`` command line: ``rcdl demo``, ``rcdl reproduce``, ``rcdl info``, ``rcdl --version``.

Each experiment subcommand maps its flags onto the experiment's frozen config dataclass;
the resolved config is saved in the run folder. ``--data-dir`` must name an existing folder
and is saved as an absolute path, so ``--resume RUN_DIR`` works from any working folder.
``main`` returns the exit status: 0 on success, 2 for a usage error (bad flag or value,
reported with the subcommand's usage and in terms of its flags), 1 for a failed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rcdl._version import __version__

if TYPE_CHECKING:
    import torch

__all__ = ["main"]


class CLIError(Exception):
    """A usage error with a message for the user (exit status 2)."""


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


def resolve_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (an error if no CUDA device is available) or ``"auto"``."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    device = resolve_device("auto")
    print(f"rcdl {__version__}")
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    print(
        f"device: {device}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
    )
    print(f"threads: {torch.get_num_threads()}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.demo import DemoConfig, run_demo

    if args.seed is not None and args.seed < 0:
        raise CLIError(f"--seed must be >= 0, got {args.seed}")
    device = resolve_device(args.device)
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    if args.seed is not None:
        cfg = dataclasses.replace(
            cfg, seed=args.seed, teacher=dataclasses.replace(cfg.teacher, seed=args.seed)
        )
    try:
        run_demo(cfg, out=args.out, device=device, progress=not args.no_progress)
    except FileExistsError as e:
        raise CLIError(str(e)) from e
    print("\nAvailable commands (see `rcdl --help` and `rcdl COMMAND --help`):")
    print(_command_list())
    print("The paper's CIFAR-10 one-epoch comparison: rcdl reproduce cifar10-1epoch --help")
    return 0


def _cmd_reproduce_cifar10(args: argparse.Namespace) -> int:
    from rcdl.app.cifar import CorruptDataError
    from rcdl.app.experiments.cifar10 import Cifar10Config, load_data, load_run_config, run_cifar10

    settings = {
        "models": args.models, "train_size": args.train_size, "test_size": args.test_size,
        "seeds": args.seeds, "eval_every": args.eval_every,
        "checkpoint": False if args.no_checkpoint else None, "store_dtype": args.store_dtype,
        "incremental_eval": False if args.no_incremental_eval else None,
    }  # fmt: skip
    settings = {k: v for k, v in settings.items() if v is not None}
    if args.combine is not None:
        return _combine_cifar10(args, settings)
    try:
        if args.resume is not None:
            given = _flags(settings)
            given += [flag for flag, on in (("--quick", args.quick), ("--out", args.out)) if on]
            if given:
                raise CLIError(f"--resume continues a run with its saved config; drop "
                               f"{', '.join(given)}")
            cfg = load_run_config(args.resume)
        else:
            cfg = Cifar10Config.quick() if args.quick else Cifar10Config()
            cfg = dataclasses.replace(cfg, **settings)
        if args.data_dir is not None:
            cfg = dataclasses.replace(cfg, data_dir=args.data_dir)
        if args.device is not None and args.resume is None:
            cfg = dataclasses.replace(cfg, device=args.device)
        device = resolve_device(args.device or cfg.device)
        data = load_data(cfg, download=not args.no_download)
    except (OSError, CorruptDataError, ValueError) as e:  # bad settings, data or run folder
        raise CLIError(str(e)) from e
    _warn_if_bfloat16_is_emulated(cfg.store_dtype, device)
    from rcdl.distributed import init_from_env

    distributed = init_from_env(device)  # under torchrun: the stores are sharded over ranks
    try:
        run_cifar10(cfg, out=args.out, resume=args.resume, data=data, device=device,
                    progress=not args.no_progress, keep_checkpoints=args.keep_checkpoints)
    except (FileExistsError, ValueError) as e:
        raise CLIError(str(e)) from e
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _warn_if_bfloat16_is_emulated(store_dtype: str | None, device: torch.device) -> None:
    """Say so when bfloat16 stores will save memory but probably not time (docs/precision.md)."""
    from rcdl.app.rundir import native_bfloat16

    if store_dtype == "bfloat16" and device.type == "cpu" and not native_bfloat16():
        print("note: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products are "
              "converted, not native: the stores take half the memory, but steps may be slower "
              "than float32 (docs/precision.md)", file=sys.stderr)


def _flags(settings: dict) -> list[str]:
    """The command-line flags that set these config keys (for error messages)."""
    negated = ("checkpoint", "incremental_eval")  # set by --no-<name>
    return [f"--{'no-' if k in negated else ''}{k.replace('_', '-')}" for k in settings]


def _combine_cifar10(args: argparse.Namespace, settings: dict) -> int:
    """``--combine RUN_DIR ... --out DIR``: one table from several finished runs."""
    from rcdl.app.experiments.cifar10 import combine_runs

    given = _flags({k: v for k, v in settings.items() if k != "models"})
    given += [flag for flag, on in (("--quick", args.quick), ("--resume", args.resume)) if on]
    if given:
        raise CLIError(f"--combine trains nothing; drop {', '.join(given)}")
    if args.out is None:
        raise CLIError("--combine needs --out DIR, the folder for the combined table")
    try:
        folder, combined = combine_runs(args.combine, args.out, models=settings.get("models"))
    except (OSError, ValueError) as e:  # missing folders, other protocols, duplicates
        raise CLIError(str(e)) from e
    print((folder / "results.md").read_text(encoding="utf-8"), end="")
    print(f"Combined {len(combined['runs'])} runs into {folder}")
    return 0


def _combine_tau_sweep(args: argparse.Namespace, settings: dict) -> int:
    """``hybrid-tau-sweep --combine RUN_DIR ... --out DIR``: one sweep from finished runs."""
    from rcdl.app.experiments.tau_sweep import combine_sweep

    given = _flags({k: v for k, v in settings.items() if k not in ("taus", "references")})
    given += [flag for flag, on in (("--quick", args.quick), ("--full", args.full),
                                    ("--resume", args.resume)) if on]
    if given:
        raise CLIError(f"--combine trains nothing; drop {', '.join(given)}")
    if args.out is None:
        raise CLIError("--combine needs --out DIR, the folder for the combined sweep")
    try:
        folder, combined = combine_sweep(args.combine, args.out, taus=args.taus,
                                         references=args.references)
    except (OSError, ValueError) as e:  # missing folders, other protocols, duplicates
        raise CLIError(str(e)) from e
    print(f"Combined {len(combined['runs'])} runs into {folder}")
    return 0


def _parse_tau(text: str) -> float | None:
    if text == "always":
        return None
    try:
        tau = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'always': {text!r}") from None
    if not (0 <= tau < float("inf")):
        raise argparse.ArgumentTypeError(f"tau must be a finite number >= 0, got {text}")
    return tau


def _cmd_reproduce_tau_sweep(args: argparse.Namespace) -> int:
    from rcdl.app.cifar import CorruptDataError
    from rcdl.app.experiments.cifar10 import load_data, load_run_config
    from rcdl.app.experiments.tau_sweep import TauSweepConfig, run_tau_sweep

    settings = {
        "taus": args.taus, "references": args.references, "train_size": args.train_size,
        "test_size": args.test_size, "eval_every": args.eval_every, "seed": args.seed,
        "checkpoint": False if args.no_checkpoint else None,
    }  # fmt: skip
    settings = {k: v for k, v in settings.items() if v is not None}
    if args.combine is not None:
        return _combine_tau_sweep(args, settings)
    if args.full:
        settings |= {"train_size": None, "test_size": None, "eval_every": 250}
    try:
        if args.resume is not None:
            given = _flags(settings)
            given += [flag for flag, on in (("--quick", args.quick), ("--out", args.out)) if on]
            if given:
                raise CLIError(f"--resume continues a run with its saved config; drop "
                               f"{', '.join(given)}")
            cfg, comparison = None, load_run_config(args.resume)
        else:
            cfg = TauSweepConfig.quick() if args.quick else TauSweepConfig()
            cfg = dataclasses.replace(cfg, **settings)
            if args.data_dir is not None:
                cfg = dataclasses.replace(cfg, data_dir=args.data_dir)
            if args.device is not None:
                cfg = dataclasses.replace(cfg, device=args.device)
            comparison = cfg.comparison()
        if args.data_dir is not None:
            comparison = dataclasses.replace(comparison, data_dir=args.data_dir)
        device = resolve_device(args.device or comparison.device)
        data = load_data(comparison, download=not args.no_download)
    except (OSError, CorruptDataError, ValueError) as e:
        raise CLIError(str(e)) from e
    from rcdl.distributed import init_from_env

    distributed = init_from_env(device)  # under torchrun: the stores are sharded over ranks
    try:
        run_tau_sweep(cfg, out=args.out, resume=args.resume, data=data, device=device,
                      progress=not args.no_progress)
    except (FileExistsError, ValueError) as e:
        raise CLIError(str(e)) from e
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _run_experiment(args: argparse.Namespace, config_cls, fields: Sequence[str], run,  # noqa: ANN001
                    switches: Mapping[str, Mapping[str, Any]] | None = None,
                    shards: bool = False) -> int:
    """A subset-scale experiment made of independent sub-runs, new or resumed.

    A new run: ``config_cls`` (with ``quick()`` and perhaps ``paper()``) filled from the
    flags named ``fields`` and, for each flag of ``switches`` that is on (e.g.
    ``{"no_projection": {"width": None}}``), its settings. A resumed run (``--resume
    RUN_DIR``): the run's saved config, where only ``--data-dir`` (and ``--device``) may
    change; any flag that sets the experiment (``fields``, ``switches``, ``--quick``,
    ``--paper``, ``--out``) is refused. Then ``run(cfg, out=, resume=, device=, progress=,
    download=)``, which skips the sub-runs a resumed run finished earlier. Under ``torchrun``
    the growing stores are sharded over the ranks if ``shards``, else the run is refused.
    """
    from rcdl.app.cifar import CorruptDataError
    from rcdl.app.rundir import read_config
    from rcdl.distributed import init_from_env

    if not shards and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CLIError(f"rcdl reproduce {args.experiment} does not run under torchrun yet "
                       "(cifar10-1epoch, hybrid-tau-sweep and teacher-student do); run it as "
                       "one process")

    switches = switches or {}
    settings = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    for flag, extra in switches.items():
        if getattr(args, flag):
            settings |= extra
    try:
        if args.resume is not None:
            _refuse_beside_resume(args, fields, switches)
            cfg = read_config(args.resume, config_cls)
        else:
            cfg = _new_config(args, config_cls, settings)
        if getattr(args, "data_dir", None) is not None:
            cfg = dataclasses.replace(cfg, data_dir=args.data_dir)
        device = resolve_device(args.device or cfg.device)
        kw = {"download": not args.no_download} if hasattr(args, "no_download") else {}
    except (OSError, CorruptDataError, ValueError) as e:  # bad settings, data or run folder
        raise CLIError(str(e)) from e
    distributed = shards and init_from_env(device)
    try:
        run(cfg, out=args.out, resume=args.resume, device=device,
            progress=not args.no_progress, **kw)
    except (OSError, CorruptDataError, ValueError) as e:  # bad settings, data or run folder
        raise CLIError(str(e)) from e
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _new_config(args: argparse.Namespace, config_cls, settings: dict[str, Any]):  # noqa: ANN001, ANN202
    """``config_cls`` at the scale of ``--quick`` or ``--paper`` (or its defaults), with
    ``settings`` on top."""
    if args.quick and getattr(args, "paper", False):
        raise ValueError("give --quick or --paper, not both")
    if args.quick:
        return config_cls.quick(**settings)
    if getattr(args, "paper", False):
        return config_cls.paper(**settings)
    return config_cls(**settings)


def _refuse_beside_resume(args: argparse.Namespace, fields: Sequence[str],
                          switches: Mapping[str, Any]) -> None:
    """A usage error naming every flag given beside ``--resume`` that would change the
    resumed run's settings."""
    given = [f for f in fields if getattr(args, f) is not None]
    given += [f for f in (*switches, "quick", "paper", "out") if getattr(args, f, None)]
    if given:
        flags = ", ".join(f"--{f.replace('_', '-')}" for f in given)
        raise CLIError(f"--resume continues a run with its saved config; drop {flags}")


def _cmd_reproduce_generalisation(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.generalisation import GeneralisationConfig, run_generalisation

    fields = ("train_size", "test_size", "epochs", "seeds", "train_eval_size",
              "parametric_entries")
    return _run_experiment(args, GeneralisationConfig, fields, run_generalisation)


def _cmd_reproduce_memory_budget(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.memory_budget import MemoryBudgetConfig, run_memory_budget

    fields = ("model", "train_size", "test_size", "capacities", "policies", "slack", "seed",
              "eval_every")
    return _run_experiment(args, MemoryBudgetConfig, fields, run_memory_budget,
                           switches={"no_unbounded": {"unbounded": False}})


def _cmd_reproduce_vit(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.vit import ViTConfig, run_vit

    fields = ("models", "train_size", "test_size", "seeds", "patch_size", "width", "depth",
              "heads", "temperature", "tau_rel", "eta", "beta", "lr", "eval_every")
    return _run_experiment(args, ViTConfig, fields, run_vit)


def _cmd_reproduce_teacher_student(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.teacher_student import TeacherStudentConfig, run_teacher_student

    fields = ("n_train", "n_test", "seeds", "d_in", "teacher_width", "teacher_depth", "noise",
              "temperature", "beta", "eta", "parametric_lr", "mlp_lr", "eval_every")
    return _run_experiment(args, TeacherStudentConfig, fields, run_teacher_student, shards=True)


def _cmd_reproduce_optimizers(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.optimizers import OptimizerComparisonConfig, run_optimizer_comparison

    fields = ("datasets", "methods", "train_size", "test_size", "epochs", "seeds", "width")
    return _run_experiment(args, OptimizerComparisonConfig, fields, run_optimizer_comparison,
                           switches={"no_projection": {"width": None}})


def _cmd_reproduce_deltanet_decay(args: argparse.Namespace) -> int:
    from rcdl.app.experiments.deltanet_decay import DeltaNetDecayConfig, run_deltanet_decay

    fields = ("variants", "train_size", "test_size", "epochs", "seeds", "width", "depth", "lr",
              "weight_decay", "deltanet_decay")
    return _run_experiment(args, DeltaNetDecayConfig, fields, run_deltanet_decay,
                           switches={"no_projection": {"width": None}})


def _add_common(parser: argparse.ArgumentParser, experiment: str, data: bool = True) -> None:
    """The data, device, output, resume and display flags every experiment takes."""
    if data:
        parser.add_argument("--data-dir", type=_data_dir, metavar="DIR", help=_DATA_DIR_HELP)
        parser.add_argument("--no-download", action="store_true",
                            help="never download the data set when no local copy is found")
    parser.add_argument("--out", metavar="DIR",
                        help=f"run folder to write (default: runs/{experiment}-<timestamp>)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run with "
                        "its saved config: finished sub-runs are skipped, the others rerun")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="default: auto (CUDA when available)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


_COMMANDS = {
    "demo": "teacher–student regression: a growing RBF net vs MLPs (SGD, Adam), one pass",
    "reproduce": "reproduce an experiment of the paper (see `rcdl reproduce --help`)",
    "info": "print the rcdl and torch versions and the device rcdl would use",
}

_EXPERIMENTS = {
    "cifar10-1epoch": "the paper's Fig. 2: growing and parametric models, one epoch of "
    "CIFAR-10 (docs/reference.md §6)",
    "hybrid-tau-sweep": "the paper's Fig. 5: the hybrid network over a range of distance "
    "thresholds τ, entries stored against accuracy (docs/reference.md §4)",
    "generalisation": "parametric vs growing softmax networks over several epochs: train and "
    "test accuracy and their gap (docs/reference.md §8)",
    "memory-budget": "growing networks under a memory budget: accuracy against capacity for "
    "several eviction policies (docs/reference.md §8, known limits)",
    "optimizers": "several epochs of MLPs trained by SGD, Adam, RMSprop, Muon and FOOF beside "
    "the growing gws and RBF networks, CIFAR-10 and CIFAR-100 (docs/reference.md §7, §8)",
    "deltanet-decay": "a 10-block residual MLP without decay, with weight decay and with "
    "DeltaNet decay, many epochs (docs/reference.md §7, §8)",
    "teacher-student": "teacher–student regression: growing weighted-softmax student vs a "
    "size-matched parametric softmax and an MLP (docs/reference.md §8)",
    "vit": "a small ViT with MLP feed-forward blocks against the same ViT with hybrid RCDL "
    "feed-forward blocks, one epoch of CIFAR-10 (docs/reference.md §8)",
}


def _command_list() -> str:
    width = max(map(len, _COMMANDS))
    return "\n".join(f"  rcdl {name:<{width}} {help_}" for name, help_ in _COMMANDS.items())


def _add_reproduce(sub: argparse._SubParsersAction) -> None:
    reproduce = sub.add_parser(
        "reproduce", help=_COMMANDS["reproduce"],
        description="Reproduce an experiment of the paper. `rcdl reproduce EXPERIMENT --help` "
        "lists the flags of one experiment.",
    )  # fmt: skip
    which = reproduce.add_subparsers(title="experiments", dest="experiment",
                                     metavar="EXPERIMENT", required=True)
    cifar = which.add_parser(
        "cifar10-1epoch", help=_EXPERIMENTS["cifar10-1epoch"],
        description="One epoch of CIFAR-10, batch 16, for the growing models (gws, gauge, rbf, "
        "hybrid; hybrid-tau<τ> and hybrid-always for other thresholds),"
        " the ResNet-MLP baselines (mlp-sgd, mlp-adam, mlp-adamw, mlp-rmsprop, mlp-muon) and the"
        " parametric-softmax baselines (psoftmax-5000, psoftmax-50016; any psoftmax-<N>). "
        "Writes a run folder with results.md, results.csv and test_accuracy.png. "
        "See docs/cifar10.md.",
    )  # fmt: skip
    cifar.add_argument("--models", nargs="+", metavar="NAME", help="models to train, in order "
                       "(default: all; with --quick: gws gauge rbf mlp-adam)")
    cifar.add_argument("--train-size", type=int, metavar="N",
                       help="random subset of N training images (default: all 50000)")
    cifar.add_argument("--test-size", type=int, metavar="N",
                       help="random subset of N test images (default: all 10000)")
    cifar.add_argument("--seeds", nargs="+", type=int, metavar="K",
                       help="one run per seed, reported as mean ± sd (default: 0)")
    cifar.add_argument("--eval-every", type=int, metavar="STEPS",
                       help="steps between test evaluations (default: 250; --quick: 50)")
    cifar.add_argument("--data-dir", type=_data_dir, metavar="DIR", help=_DATA_DIR_HELP)
    cifar.add_argument("--out", metavar="DIR",
                       help="run folder to write (default: runs/cifar10-1epoch-<timestamp>)")
    cifar.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run: "
                       "finished models are skipped, the interrupted one resumes from its "
                       "checkpoint")
    cifar.add_argument("--combine", nargs="+", metavar="RUN_DIR", help="train nothing: merge "
                       "the finished models of these run folders (same protocol) into one "
                       "table and figure in --out")
    cifar.add_argument("--device", choices=("auto", "cpu", "cuda"),
                       help="default: auto (CUDA when available)")
    cifar.add_argument("--store-dtype", choices=("bfloat16", "float16"),
                       help="keep the growing layers' keys and values in half precision: half "
                       "the memory, and several times the speed on CPUs with avx512_bf16 or "
                       "AMX (docs/precision.md; default: the model's float32)")
    cifar.add_argument("--no-incremental-eval", action="store_true",
                       help="evaluate every layer over its whole store each time (default: the "
                       "first layer folds only the entries written since the last evaluation "
                       "into cached partials; exact up to rounding)")
    cifar.add_argument("--quick", action="store_true", help="2000 train / 1000 test images, "
                       "evaluations every 50 steps, models gws gauge rbf mlp-adam: a smoke "
                       "test (minutes)")
    cifar.add_argument("--keep-checkpoints", action="store_true",
                       help="keep each model's last checkpoint after it finishes")
    cifar.add_argument("--no-checkpoint", action="store_true",
                       help="write no checkpoints (an interrupted model then restarts from "
                       "scratch); saves the disk writes of large stores and optimizer states")
    cifar.add_argument("--no-download", action="store_true",
                       help="never download the data set when no local copy is found")
    cifar.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    cifar.set_defaults(func=_cmd_reproduce_cifar10, command_parser=cifar)

    sweep = which.add_parser(
        "hybrid-tau-sweep", help=_EXPERIMENTS["hybrid-tau-sweep"],
        description="The hybrid growing network (docs/reference.md §4, §6) trained for one "
        "epoch with each distance threshold τ, beside the pure growing gws network and a "
        "parametric-softmax network on the same images. Writes the one-epoch comparison's "
        "run folder plus "
        "tau_sweep.md, tau_sweep.csv and entries_vs_accuracy.png. See docs/hybrid.md.",
    )  # fmt: skip
    sweep.add_argument("--taus", nargs="+", type=_parse_tau, metavar="TAU",
                       help="thresholds, 'always' for always grow (default: always 30 40 50 "
                       "55 60 65 70)")
    sweep.add_argument("--references", nargs="*", metavar="NAME", help="other models of "
                       "cifar10-1epoch to train on the same images (default: gws psoftmax-5000)")
    sweep.add_argument("--train-size", type=int, metavar="N",
                       help="training images (default: 2000; --full: all 50000)")
    sweep.add_argument("--test-size", type=int, metavar="N",
                       help="test images (default: 1000; --full: all 10000)")
    sweep.add_argument("--eval-every", type=int, metavar="STEPS",
                       help="steps between test evaluations (default: 25; --full: 250)")
    sweep.add_argument("--seed", type=int, help="seed of the models and data order (default 0)")
    sweep.add_argument("--full", action="store_true", help="the paper's scale: all 50 000 / "
                       "10 000 images (hours per threshold on a CPU)")
    sweep.add_argument("--quick", action="store_true", help="3 thresholds and gws on 300 / 200 "
                       "images: a smoke test (about a minute)")
    sweep.add_argument("--data-dir", type=_data_dir, metavar="DIR", help=_DATA_DIR_HELP)
    sweep.add_argument("--out", metavar="DIR",
                       help="run folder to write (default: runs/hybrid-tau-sweep-<timestamp>)")
    sweep.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted sweep")
    sweep.add_argument("--combine", nargs="+", metavar="RUN_DIR", help="train nothing: merge "
                       "the finished models of these run folders of the sweep or of "
                       "cifar10-1epoch (same protocol) into one sweep table and figure in "
                       "--out; --taus and --references then pick the models (default: all)")
    sweep.add_argument("--no-checkpoint", action="store_true",
                       help="write no checkpoints (an interrupted model restarts from scratch)")
    sweep.add_argument("--device", choices=("auto", "cpu", "cuda"),
                       help="default: auto (CUDA when available)")
    sweep.add_argument("--no-download", action="store_true",
                       help="never download the data set when no local copy is found")
    sweep.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    sweep.set_defaults(func=_cmd_reproduce_tau_sweep, command_parser=sweep)

    gen = which.add_parser(
        "generalisation", help=_EXPERIMENTS["generalisation"],
        description="The growing gws network (writing entries every epoch) against the same "
        "architecture with its key/value/weight tables trained as parameters by Adam, over "
        "several epochs on a CIFAR-10 subset. Writes results.md, results.csv and "
        "generalisation.png. See docs/generalisation.md.",
    )  # fmt: skip
    gen.add_argument("--train-size", type=int, metavar="N", help="training images (1000)")
    gen.add_argument("--test-size", type=int, metavar="N", help="test images (1000)")
    gen.add_argument("--epochs", type=int, metavar="E", help="passes over the subset (15)")
    gen.add_argument("--seeds", nargs="+", type=int, metavar="K", help="seeds (0)")
    gen.add_argument("--train-eval-size", type=int, metavar="N",
                     help="training images on which train accuracy is measured (2000, capped "
                     "at the subset)")
    gen.add_argument("--parametric-entries", type=int, metavar="N", help="table size of the "
                     "parametric model per layer (default: train size + 16, the growing "
                     "model's size after one epoch)")
    gen.add_argument("--quick", action="store_true",
                     help="200 / 200 images, 3 epochs: a smoke test")
    _add_common(gen, "generalisation")
    gen.set_defaults(func=_cmd_reproduce_generalisation, command_parser=gen)

    mem = which.add_parser(
        "memory-budget", help=_EXPERIMENTS["memory-budget"],
        description="One epoch of a growing model on a CIFAR-10 subset with every layer's "
        "store capped at a capacity, for each eviction policy, beside the unbounded model. "
        "Writes results.md, results.csv and accuracy_vs_capacity.png. See docs/memory.md.",
    )  # fmt: skip
    mem.add_argument("--model", choices=("gws", "gauge", "rbf", "hybrid"),
                     help="the growing model (gws)")
    mem.add_argument("--train-size", type=int, metavar="N", help="training images (10000)")
    mem.add_argument("--test-size", type=int, metavar="N", help="test images (2000)")
    mem.add_argument("--capacities", nargs="+", type=int, metavar="N",
                     help="entries per layer, initial entries included (250 1000 4000)")
    mem.add_argument("--policies", nargs="+", metavar="NAME", help="eviction policies, "
                     "optionally with +merge (oldest newest random contribution "
                     "contribution+merge newest+merge)")
    mem.add_argument("--no-unbounded", action="store_true",
                     help="skip the unbounded reference run")
    mem.add_argument("--slack", type=float, metavar="F", help="a full store is cut to "
                     "(1 − F) × capacity at once, so evictions happen every few steps (0.125)")
    mem.add_argument("--seed", type=int, help="seed of the model, data order and the random "
                     "policy (0)")
    mem.add_argument("--eval-every", type=int, metavar="STEPS", help="steps between test "
                     "evaluations (250)")
    mem.add_argument("--quick", action="store_true", help="480 / 200 images, capacities 60 "
                     "and 240: a smoke test (under a minute)")
    _add_common(mem, "memory-budget")
    mem.set_defaults(func=_cmd_reproduce_memory_budget, command_parser=mem)

    from rcdl.app.experiments.deltanet_decay import VARIANTS
    from rcdl.app.experiments.optimizers import DATASETS, METHODS

    opt = which.add_parser(
        "optimizers", help=_EXPERIMENTS["optimizers"],
        description="MLPs trained by SGD, Adam, RMSprop, Muon and FOOF beside the growing gws "
        "and RBF networks (plain functional-gradient rules, writing every epoch), several "
        "epochs on CIFAR-10 and, when its files are found, CIFAR-100; all see the same fixed "
        "random projection of the pixels to --width dimensions. Writes results.md, "
        "results.csv and the training-loss and test-accuracy figures. See "
        "docs/optimizer_experiments.md.",
    )  # fmt: skip
    opt.add_argument("--datasets", nargs="+", choices=tuple(DATASETS),
                     help="(cifar10 cifar100; a missing one is reported and skipped)")
    opt.add_argument("--methods", nargs="+", choices=tuple(METHODS), help="(all)")
    opt.add_argument("--train-size", type=int, metavar="N", help="training images (5000)")
    opt.add_argument("--test-size", type=int, metavar="N", help="test images (2000)")
    opt.add_argument("--epochs", type=int, metavar="E", help="epochs (10)")
    opt.add_argument("--seeds", nargs="+", type=int, metavar="K", help="seeds (0)")
    opt.add_argument("--width", type=int, metavar="W", help="projected input width (256)")
    opt.add_argument("--no-projection", action="store_true",
                     help="the raw 3 072 pixels (the paper's setting)")
    opt.add_argument("--quick", action="store_true", help="300 / 300 images, width 64, 3 "
                     "epochs: a smoke test")
    opt.add_argument("--paper", action="store_true", help="whole data sets, no projection, "
                     "docs/reference.md §6's baselines: a GPU job")
    _add_common(opt, "optimizers")
    opt.set_defaults(func=_cmd_reproduce_optimizers, command_parser=opt)

    dn = which.add_parser(
        "deltanet-decay", help=_EXPERIMENTS["deltanet-decay"],
        description="A 10-block residual MLP trained by SGD without decay, with "
        "multiplicative weight decay and with DeltaNet decay (docs/reference.md §7: "
        "forgetting only along the current inputs' directions), many epochs on a CIFAR-10 "
        "subset. Writes "
        "results.md, results.csv and the curves. See docs/optimizer_experiments.md.",
    )  # fmt: skip
    dn.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), help="(all three)")
    dn.add_argument("--train-size", type=int, metavar="N", help="training images (2000)")
    dn.add_argument("--test-size", type=int, metavar="N", help="test images (2000)")
    dn.add_argument("--epochs", type=int, metavar="E", help="epochs (150; the paper: 2000)")
    dn.add_argument("--seeds", nargs="+", type=int, metavar="K", help="seeds (0)")
    dn.add_argument("--width", type=int, metavar="W", help="projected input width (256)")
    dn.add_argument("--no-projection", action="store_true", help="the raw 3 072 pixels")
    dn.add_argument("--depth", type=int, metavar="L", help="residual blocks (10)")
    dn.add_argument("--lr", type=float, help="SGD learning rate (0.03)")
    dn.add_argument("--weight-decay", type=float, help="multiplicative decay (1e-4)")
    dn.add_argument("--deltanet-decay", type=float, help="DeltaNet decay λ (1e-5)")
    dn.add_argument("--quick", action="store_true", help="300 / 300 images, width 64, 5 "
                    "epochs: a smoke test")
    dn.add_argument("--paper", action="store_true", help="the paper's run: all images, no "
                    "projection, 2000 epochs (days on a CPU)")
    _add_common(dn, "deltanet-decay")
    dn.set_defaults(func=_cmd_reproduce_deltanet_decay, command_parser=dn)

    ts = which.add_parser(
        "teacher-student", help=_EXPERIMENTS["teacher-student"],
        description="A random teacher network generates a regression stream; a growing "
        "weighted-softmax student (gws rule), a parametric-softmax student with as many "
        "entries as the growing one stores at the end (Adam) and an MLP (Adam) learn it in "
        "one pass, several seeds. Writes results.md, results.csv and test_mse.png. No data "
        "files needed. See docs/teacher_student.md.",
    )  # fmt: skip
    ts.add_argument("--n-train", type=int, metavar="N", help="training samples (16000)")
    ts.add_argument("--n-test", type=int, metavar="N", help="test samples (1000)")
    ts.add_argument("--seeds", nargs="+", type=int, metavar="K", help="seeds (0 1 2)")
    ts.add_argument("--d-in", type=int, metavar="D", help="input dimension (32)")
    ts.add_argument("--teacher-width", type=int, metavar="W", help="teacher width (64)")
    ts.add_argument("--teacher-depth", type=int, metavar="L", help="teacher hidden layers (2)")
    ts.add_argument("--noise", type=float, help="target noise sd (0)")
    ts.add_argument("--temperature", type=float, metavar="T",
                    help="growing student's T (0.7)")
    ts.add_argument("--beta", type=float, help="growing student's β (1.0)")
    ts.add_argument("--eta", type=float, help="growing student's η (1.0)")
    ts.add_argument("--parametric-lr", type=float, help="Adam lr of the parametric student "
                    "(1e-3)")
    ts.add_argument("--mlp-lr", type=float, help="Adam lr of the MLP (3e-3)")
    ts.add_argument("--eval-every", type=int, metavar="STEPS", help="steps between test "
                    "evaluations (50)")
    ts.add_argument("--quick", action="store_true", help="a smoke test (seconds)")
    _add_common(ts, "teacher-student", data=False)
    ts.set_defaults(func=_cmd_reproduce_teacher_student, command_parser=ts)

    vit = which.add_parser(
        "vit", help=_EXPERIMENTS["vit"],
        description="One epoch of CIFAR-10 for a small ViT with MLP feed-forward blocks and "
        "the same ViT whose feed-forward blocks are hybrid weighted-softmax RCDL layers "
        "(entries trained by Adam, growth gated at τ = tau_rel·√width), same data order. "
        "Writes results.md, results.csv and vit.png. See docs/vit.md.",
    )  # fmt: skip
    vit.add_argument("--models", nargs="+", choices=("mlp", "rcdl"), help="(mlp rcdl)")
    vit.add_argument("--train-size", type=int, metavar="N", help="training images (all)")
    vit.add_argument("--test-size", type=int, metavar="N", help="test images (all)")
    vit.add_argument("--seeds", nargs="+", type=int, metavar="K", help="seeds (0)")
    vit.add_argument("--patch-size", type=int, metavar="P", help="patch side in pixels (8)")
    vit.add_argument("--width", type=int, metavar="D", help="token width (64)")
    vit.add_argument("--depth", type=int, metavar="L", help="blocks (4)")
    vit.add_argument("--heads", type=int, metavar="H", help="attention heads (4)")
    vit.add_argument("--temperature", type=float, metavar="T",
                     help="softmax temperature of the RCDL layers (2.0)")
    vit.add_argument("--tau-rel", type=float, metavar="R",
                     help="growth threshold in units of √width (1.0)")
    vit.add_argument("--eta", type=float, help="gws rule η of the RCDL layers (10)")
    vit.add_argument("--beta", type=float, help="gws rule β of the RCDL layers (0.3)")
    vit.add_argument("--lr", type=float, help="Adam learning rate, both models (1e-3)")
    vit.add_argument("--eval-every", type=int, metavar="STEPS", help="steps between test "
                     "evaluations (500)")
    vit.add_argument("--quick", action="store_true", help="500 / 200 images, width 32, 2 "
                     "blocks: a smoke test (seconds)")
    vit.add_argument("--paper", action="store_true", help="a larger ViT (patch 4, width 128, "
                     "6 blocks) on all images: hours on a CPU, for a GPU")
    _add_common(vit, "vit")
    vit.set_defaults(func=_cmd_reproduce_vit, command_parser=vit)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rcdl`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="rcdl",
        description="Retrieval-Centric Deep Learning: growing nonparametric networks.",
    )
    parser.add_argument("--version", action="version", version=f"rcdl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help=_COMMANDS["demo"], description=_COMMANDS["demo"])
    demo.add_argument("--quick", action="store_true", help="tiny sizes; runs in seconds")
    demo.add_argument(
        "--out", metavar="DIR", help="run folder to write (default: runs/demo-<timestamp>)"
    )
    demo.add_argument("--seed", type=int, help="seed of the task, data order and models")
    demo.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    demo.set_defaults(func=_cmd_demo, command_parser=demo)

    _add_reproduce(sub)

    info = sub.add_parser("info", help=_COMMANDS["info"], description=_COMMANDS["info"])
    info.set_defaults(func=_cmd_info, command_parser=info)
    return parser


def entry() -> int:
    """The ``rcdl`` command: :func:`main` after tuning the allocator for training
    (:func:`rcdl.app.allocator.keep_freed_memory`; ``RCDL_MALLOC=system`` turns that off)."""
    from rcdl.app.allocator import keep_freed_memory

    keep_freed_memory()
    return main()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rcdl`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)  # exits with status 2 on a usage error
    if unknown:  # reported with the subcommand's usage, not that of rcdl
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except CLIError as e:
        command = args.command_parser  # the subcommand's, so its usage is shown
        command.error(_explain(e, command))  # prints usage and exits with status 2
    except KeyboardInterrupt:
        print("rcdl: interrupted", file=sys.stderr)
        return 130
