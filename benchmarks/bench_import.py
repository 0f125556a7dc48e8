"""How long a fresh interpreter takes to start rcdl, against starting torch alone.

Every ``rcdl`` command pays torch's import first; what rcdl adds on top is the library's
modules and, for a command, the modules of what it runs. ``rcdl --help`` runs nothing, so
it should cost little beyond ``import torch``: the command imports an experiment's module
only for that experiment's subcommand, and plotting only where a figure is drawn
(``rcdl.app.cli``). This times, each in a fresh process:

- ``python -c "import torch"``, the floor;
- ``python -c "import rcdl"``, the library;
- ``python -m rcdl --help``, the command;

interleaved (one of each per round, after one untimed round that fills the file cache),
and prints the median wall time of each over ``--rounds`` rounds and its ratio to the
floor. The exit status is 1 when ``rcdl --help`` takes more than ``--max-ratio`` times the
floor, so a regression fails a script that runs this.

    python benchmarks/bench_import.py [--rounds 5] [--max-ratio 1.5]

Prints the CPU model and speed-relevant flags first: times compare only within one run, on
one machine. The rcdl measured is the one ``import rcdl`` finds (its folder is printed).
Without bytecode caching (``PYTHONDONTWRITEBYTECODE``, or a read-only source folder) every
start compiles the imported rcdl sources again, which the line about the cache says.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from harness import case, machine_line, timeit

COMMANDS = {
    'python -c "import torch"': ["-c", "import torch"],
    'python -c "import rcdl"': ["-c", "import rcdl"],
    "python -m rcdl --help": ["-m", "rcdl", "--help"],
}
FLOOR = 'python -c "import torch"'
HELP = "python -m rcdl --help"


def machine() -> str:
    """The CPU's model and speed flags, torch (:func:`harness.machine_line`), the core count
    and Python."""
    return f"{machine_line()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def time_once(args: Sequence[str]) -> float:
    """Seconds from starting ``python args`` in a fresh process to its exit."""
    done: list[subprocess.CompletedProcess] = []
    seconds = timeit(lambda: done.append(subprocess.run(
        [sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)),
        1, warmup=0).median
    if done[0].returncode != 0:
        raise SystemExit(f"bench_import: `python {' '.join(args)}` failed "
                         f"(exit status {done[0].returncode}):\n{done[0].stderr}")
    return seconds


def measure(rounds: int) -> dict[str, list[float]]:
    """The wall times of every command over ``rounds`` interleaved rounds (after one untimed
    round); each round starts with another command, so none is always run first."""
    names = list(COMMANDS)
    for name in names:
        time_once(COMMANDS[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_once(COMMANDS[name]))
    return times


@case("startup", quick={"rounds": 1}, rounds=5)
def startup(rounds: int) -> dict[str, float]:
    """Each start-up command of :data:`COMMANDS` in a fresh process: median seconds over
    ``rounds`` interleaved rounds after one untimed round."""
    return {name: statistics.median(ts) for name, ts in measure(rounds).items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Start-up time of `import rcdl` and `rcdl "
                                "--help` against `import torch`, in fresh processes.")
    p.add_argument("--rounds", type=int, default=5, metavar="N",
                   help="interleaved rounds; the medians are over them (default: 5)")
    p.add_argument("--max-ratio", type=float, default=1.5, metavar="R",
                   help="exit with status 1 if `rcdl --help` takes more than R times "
                   "`import torch` (default: 1.5)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")

    import rcdl

    caching = "off (PYTHONDONTWRITEBYTECODE)" if sys.dont_write_bytecode else "on"
    print(f"machine: {machine()}")
    print(f"rcdl {rcdl.__version__} from {Path(rcdl.__file__).parent}; bytecode cache {caching}")
    print(f"median of {args.rounds} interleaved rounds, each command in a fresh process\n")
    times = measure(args.rounds)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    width = max(map(len, medians))
    print(f"{'command':<{width}}  median s  vs import torch  all rounds (s)")
    for name, median in medians.items():
        rounds = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:<{width}}  {median:8.3f}  {median / medians[FLOOR]:15.2f}  {rounds}")
    ratio = medians[HELP] / medians[FLOOR]
    if ratio > args.max_ratio:
        print(f"\n`rcdl --help` takes {ratio:.2f} times `import torch`, over the limit "
              f"{args.max_ratio:g} (--max-ratio)")
        return 1
    print(f"\n`rcdl --help` takes {ratio:.2f} times `import torch` (limit {args.max_ratio:g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
