"""Experiments: one module per experiment, or one package for an experiment with a toolbox of
its own, each declaring its command (``EXPERIMENT = "name"``), its config and its
``EXPERIMENT_SPEC`` (:class:`rcdl.app.runner.Experiment`; a package declares them in its
``__init__.py``); docs/adding_an_experiment.md. The package finds them itself
(:data:`COMMANDS`), reading each module's source rather than importing it. What several
experiments train with is in :mod:`rcdl.app.recipes`, and the models they train in
:mod:`rcdl.app.models`; the one-epoch comparison (``cifar10/``) keeps its settings, runs,
report, ``--combine`` and the hybrid's bfloat16 diagnostics in ``cifar10.config``,
``cifar10.run``, ``cifar10.report``, ``cifar10.combine`` and ``cifar10.bf16_effects``, and
the continual study (``continual/``) its model names, runs, baselines, analysis, report
and figures in ``continual.spec``, ``continual.run``, ``continual.baselines``,
``continual.analysis``, ``continual.report`` and ``continual.plots``.

- :mod:`rcdl.app.experiments.demo` — teacher–student regression: a growing RBF network against
  MLPs trained by SGD and by Adam, one pass over the data (``rcdl demo``).
- :mod:`rcdl.app.experiments.cifar10` — the paper's one-epoch CIFAR-10 comparison, Fig. 2
  (``rcdl reproduce cifar10-1epoch``).
- :mod:`rcdl.app.experiments.tau_sweep` — the hybrid network over distance thresholds τ, Fig. 5
  (``rcdl reproduce hybrid-tau-sweep``).
- :mod:`rcdl.app.experiments.generalisation` — parametric vs growing softmax networks over
  several epochs (``rcdl reproduce generalisation``).
- :mod:`rcdl.app.experiments.memory_budget` — the growing ``gws`` model under a bounded memory:
  test accuracy against entries per layer for several eviction policies (docs/reference.md §8;
  ``rcdl reproduce memory-budget``).
- :mod:`rcdl.app.experiments.optimizers` — MLP optimizers (incl. Muon and FOOF) against the
  growing networks over several epochs (docs/reference.md §7, §8; ``rcdl reproduce optimizers``).
- :mod:`rcdl.app.experiments.deltanet_decay` — DeltaNet decay against weight decay and none
  (docs/reference.md §7, §8; ``rcdl reproduce deltanet-decay``).
- :mod:`rcdl.app.experiments.teacher_student` — growing vs size-matched parametric softmax
  students of a random teacher (docs/reference.md §8; ``rcdl reproduce teacher-student``).
- :mod:`rcdl.app.experiments.vit` — a small ViT with MLP against hybrid RCDL feed-forward
  blocks, one epoch (docs/reference.md §8; ``rcdl reproduce vit``).
- :mod:`rcdl.app.experiments.attention_bench` — the streaming attention's speed against the
  matrix products it is made of (``rcdl reproduce attention-bench``).
- :mod:`rcdl.app.experiments.attribution` — rcdl's native attribution measured: the linear
  datamodeling score against retrained models, mislabel detection by self-influence, and
  test images beside the training images they rest on; as options the readout cascade, the
  seed ceiling and the TRAK peer (``rcdl reproduce attribution``).
- :mod:`rcdl.app.experiments.unlearning` — forgetting training samples (``rcdl.forget``)
  against retraining without them, with a membership-inference score, and the studies of
  ``--studies`` (exact forgetting's cost, the ``rcdl forget`` command, a replay log's size,
  the repair's time budget), a module each in the package (``rcdl reproduce unlearning``).
- :mod:`rcdl.app.experiments.continual` — class-incremental Split CIFAR-10 without replay:
  growing models against fine-tuned, EWC and LwF MLPs and raw-pixel baselines, and whether
  an earlier task's entries still classify its images (``rcdl reproduce continual``).
"""

import re
from pathlib import Path

__all__ = ["COMMANDS", "MAIN", "declared_commands", "experiment_sources"]

# An experiment module declares its command on a line of its own, `EXPERIMENT = "name"`, and
# its spec as `EXPERIMENT_SPEC = ...`; the index reads those lines from the source, so that
# the command line knows every command without importing an experiment it does not run.
_COMMAND = re.compile(r'^EXPERIMENT = "([a-z0-9][a-z0-9-]*)"', re.MULTILINE)
_SPEC = re.compile(r"^EXPERIMENT_SPEC = ", re.MULTILINE)


def experiment_sources(folder: Path = Path(__file__).parent) -> dict[str, Path]:
    """``{module: source}`` of the modules of ``folder`` (``name.py``) and of its packages
    (``name/__init__.py``, where a package declares its experiment), sorted by module."""
    found = {path.stem: path for path in folder.glob("*.py") if path.stem != "__init__"}
    found |= {path.parent.name: path for path in folder.glob("*/__init__.py")}
    return dict(sorted(found.items()))


def declared_commands(folder: Path = Path(__file__).parent) -> dict[str, str]:
    """``{command: module}`` for every module or package of ``folder`` that declares an
    experiment (an ``EXPERIMENT_SPEC`` and its ``EXPERIMENT = "command"`` line), sorted by
    command.

    Raises:
        ImportError: a module declares a spec without its command line, or two modules
            declare the same command.
    """
    found: dict[str, str] = {}
    sources = experiment_sources(folder)
    for module, path in sources.items():
        text = path.read_text(encoding="utf-8")
        if not _SPEC.search(text):
            continue  # a module the experiments share, not an experiment
        match = _COMMAND.search(text)
        if match is None:
            raise ImportError(f"{path} declares EXPERIMENT_SPEC but not its command: add the "
                              'line EXPERIMENT = "<command>" and give the spec name=EXPERIMENT '
                              "(docs/adding_an_experiment.md)")
        command = match.group(1)
        if command in found:
            raise ImportError(f"{path} and {sources[found[command]]} both declare the "
                              f"command {command!r}")
        found[command] = module
    return dict(sorted(found.items()))


# `rcdl reproduce NAME` -> the module of NAME, in the order `rcdl reproduce --help` lists them
COMMANDS = declared_commands()
# the paper's main experiment: `rcdl demo` ends by pointing to it
MAIN = "cifar10-1epoch"
