"""The ``rcdl`` command line: ``rcdl demo``, ``rcdl info``, ``rcdl --version``.

Each experiment subcommand maps its flags onto the experiment's frozen config dataclass;
the resolved config is saved in the run folder. ``main`` returns the exit status:
0 on success, 2 for a usage error (bad flag or value), 1 for a failed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rcdl._version import __version__

if TYPE_CHECKING:
    import torch

__all__ = ["main"]


class CLIError(Exception):
    """A usage error with a message for the user (exit status 2)."""


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
    from rcdl.experiments.demo import DemoConfig, run_demo

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
    print("The CIFAR-10 one-epoch comparison of the paper comes in a later release.")
    return 0


_COMMANDS = {
    "demo": "teacher–student regression: a growing RBF net vs MLPs (SGD, Adam), one pass",
    "info": "print the rcdl and torch versions and the device rcdl would use",
}


def _command_list() -> str:
    return "\n".join(f"  rcdl {name:<6} {help_}" for name, help_ in _COMMANDS.items())


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
    demo.set_defaults(func=_cmd_demo)

    info = sub.add_parser("info", help=_COMMANDS["info"], description=_COMMANDS["info"])
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rcdl`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with status 2 on a usage error
    try:
        return args.func(args)
    except CLIError as e:
        parser.error(f"{args.command}: {e}")  # prints usage and exits with status 2
    except KeyboardInterrupt:
        print("rcdl: interrupted", file=sys.stderr)
        return 130
