"""The demo: a growing RBF network against MLP baselines on teacher–student regression.

A random teacher MLP (:mod:`rcdl.app.data`) labels Gaussian inputs; three students see the
training set once, in batches, and are evaluated on held-out test MSE as they go:

- ``growing RBF``: :class:`rcdl.nn.networks.GrowingRBFNet`, no parameters; every training
  sample writes one entry per layer (``Grower.step``), docs/reference.md §2–3;
- ``MLP + SGD`` and ``MLP + Adam``: :class:`rcdl.nn.networks.MLP` of the same shape.

Everything lands in one run folder: ``config.json``, ``environment.json``,
``metrics.jsonl`` (every evaluation of every model), ``summary.json``, ``results.md`` (the
table below, a line reading it (:func:`reading`), and the machine) and ``test_mse.png`` (test
MSE against samples seen).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rcdl.app.config import ExperimentConfig, setting
from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.app.report import Curve, Panel, markdown_table, plot_panels, write_outputs
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.nn.networks import MLP, GrowingRBFNet
from rcdl.nn.rules import FunctionalSGD
from rcdl.nn.store import format_bytes
from rcdl.optim.grower import Grower
from rcdl.train.loop import train_one_pass

__all__ = ["DemoConfig", "reading", "run_demo"]


@dataclass(frozen=True)
class DemoConfig(ExperimentConfig):
    """The demo's settings; the defaults are sized for a laptop CPU (README, "Quick start").

    ``rcdl demo`` sets only ``seed`` (``--seed``, which also sets the task's own seed,
    ``teacher.seed``) and the scale (``--quick``); the other settings have no flag.

    The defaults were tuned briefly on this task (seed 0, 4 000 and 16 000 samples):
    ``T`` over 0.3–4 and ``η`` over 0.1–1 (``rbf_width = 64`` with its fixed random input
    map did worse); SGD ``lr`` over 0.003–0.03 (0.1 diverges); Adam ``lr`` over 1e-3–1e-2.
    """

    # A tiny configuration (for tests and smoke checks). With d_in = 8
    # the RBF kernels overlap more, so η is halved: a growing RBF step overshoots (and the
    # net diverges) once η times the kernel mass of a batch is too large.
    QUICK = {"teacher": TeacherConfig(d_in=8, hidden=16, depth=1, n_train=128, n_test=64),
             "mlp_hidden": 16, "eval_every": 4, "rbf_lr": 0.25}  # fmt: skip

    teacher: TeacherConfig = setting(
        TeacherConfig(n_train=16_000, n_test=2_000), "the regression task: sizes of the "
        "teacher and of the data sets, and the task's seed", cli=False)
    batch_size: int = setting(16, "samples per step B", cli=False)
    eval_every: int = setting(50, "steps between evaluations of the test MSE", cli=False)
    seed: int = setting(0, "seed of the task, data order and models", minimum=0)
    depth: int = setting(2, "blocks of every student: MLP(d_in, mlp_hidden, d_out, depth) "
                         "and GrowingRBFNet(d_in, d_out, depth, ...), depth + 1 growing "
                         "layers with its readout", minimum=0, cli=False)
    mlp_hidden: int = setting(64, "hidden width of the MLP baselines", cli=False)
    rbf_width: int | None = setting(None, "residual-stream width of the growing RBF net; "
                                    "None keeps d_in (the paper's setting, no input "
                                    "projection)", cli=False)
    rbf_temperature: float = setting(1.0, "temperature T of the growing RBF layers",
                                     positive=True, cli=False)
    rbf_lr: float = setting(0.5, "per-sample learning rate η of the growing RBF layers",
                            positive=True, cli=False)
    sgd_lr: float = setting(0.03, "learning rate of the SGD baseline", positive=True,
                            cli=False)
    sgd_momentum: float = setting(0.9, "momentum of the SGD baseline", cli=False)
    adam_lr: float = setting(1e-3, "learning rate of the Adam baseline", positive=True,
                             cli=False)

    def check(self) -> None:
        """``teacher`` is a :class:`rcdl.app.data.TeacherConfig` (a mapping, as read back from
        ``config.json``, becomes one)."""
        if isinstance(self.teacher, Mapping):
            object.__setattr__(self, "teacher", TeacherConfig(**self.teacher))
        elif not isinstance(self.teacher, TeacherConfig):
            raise ValueError(f"DemoConfig: teacher must be a TeacherConfig, got "
                             f"{self.teacher!r}")


def _students(cfg: DemoConfig, device: torch.device) -> dict[str, dict[str, Any]]:
    """Build each student with its learner, seeded so the run is reproducible."""
    t = cfg.teacher

    def seeded(cls: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
        torch.manual_seed(cfg.seed)  # every student starts from the same seed
        return cls(*args, **kwargs).to(device=device, dtype=t.torch_dtype)

    rbf = seeded(
        GrowingRBFNet, t.d_in, t.d_out, cfg.depth, width=cfg.rbf_width,
        temperature=cfg.rbf_temperature, rule=FunctionalSGD(cfg.rbf_lr),
    )  # fmt: skip
    mlp = (t.d_in, cfg.mlp_hidden, t.d_out, cfg.depth)
    mlp_sgd, mlp_adam = seeded(MLP, *mlp), seeded(MLP, *mlp)
    sgd = torch.optim.SGD(mlp_sgd.parameters(), lr=cfg.sgd_lr, momentum=cfg.sgd_momentum)
    return {"growing RBF": {"model": rbf, "grower": Grower(rbf)},
            "MLP + SGD": {"model": mlp_sgd, "optimizer": sgd},
            "MLP + Adam": {"model": mlp_adam,
                           "optimizer": torch.optim.Adam(mlp_adam.parameters(), lr=cfg.adam_lr)}}


def results_table(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of the students' final results."""
    header = ("model", "test MSE", "entries", "store", "parameters", "train s", "eval s")
    return markdown_table(header, [[
        name, f"{r['test_mse']:.4f}", "—" if r["entries"] is None else f"{r['entries']:,}",
        "—" if r["bytes"] is None else format_bytes(r["bytes"]), f"{r['parameters']:,}",
        f"{r['train_seconds']:.1f}", f"{r['eval_seconds']:.1f}",
    ] for name, r in results.items()])  # fmt: skip


def reading(cfg: DemoConfig, results: dict[str, dict[str, Any]], zero_mse: float) -> str:
    """One line under the table saying which students beat predicting 0, from the numbers.

    A row worse than the zero predictor needs its reason beside it: at the ``--quick`` size
    one pass is only a handful of optimizer steps, too few for the MLP baselines to move far
    from their untrained output, which scores worse than predicting 0. So when an
    MLP does not beat predicting 0, the line adds their steps and their test MSE before and
    after training.
    """
    beat = [name for name, r in results.items() if r["test_mse"] < zero_mse]
    worse = [name for name in results if name not in beat]
    zero = f"test MSE {zero_mse:.4f}"
    if not worse:
        line = f"Reading: every model beats predicting 0 ({zero})."
    elif not beat:
        line = f"Reading: no model beats predicting 0 ({zero})."
    else:
        line = (f"Reading: {_and(beat)} beat{'s' if len(beat) == 1 else ''} predicting 0 "
                f"({zero}); {_and(worse)} do{'es' if len(worse) == 1 else ''} not.")
    mlps = [name for name, r in results.items() if r["entries"] is None]  # parametric ones
    if any(name in worse for name in mlps):
        steps = max(results[name]["steps"] for name in mlps)
        moves = ", ".join(f"{name} {results[name]['history'][0]['test_mse']:.4f} → "
                          f"{results[name]['test_mse']:.4f}" for name in mlps)
        line += (" At this size the MLP baselines have "
                 f"had {steps} steps (one pass of {cfg.teacher.n_train} samples in batches "
                 f"of {cfg.batch_size}), too few to train them: {moves} (test MSE untrained "
                 "→ after the pass).")
    return line


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def plot_curves(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Plot test MSE against samples seen for every student (log scale) to ``path``."""
    curves = [Curve([h["samples"] for h in r["history"]], [h["test_mse"] for h in r["history"]],
                    name, style={"marker": "."}) for name, r in results.items()]  # fmt: skip
    return plot_panels(path, [Panel(curves, "training samples seen", "test MSE", title,
                                    yscale="log", grid="both", legend={})],
                       figsize=(6.4, 4.2))  # fmt: skip


def run_demo(
    cfg: DemoConfig,
    *,
    out: str | Path | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> tuple[RunDir, dict[str, dict[str, Any]]]:
    """Run the demo into a run folder (``out``, or ``runs/demo-<timestamp>``).

    Returns:
        The run folder and ``{model name: result}`` (see :func:`rcdl.train.loop.train_one_pass`,
        plus ``"parameters"``).
    """
    start = time.perf_counter()
    device = torch.device(device)
    run = RunDir.create("demo", path=out, config=cfg, device=device)
    data = make_teacher_data(cfg.teacher)
    zero_mse = float(data[3].pow(2).mean())  # predicting 0 everywhere

    results: dict[str, dict[str, Any]] = {}
    for name, student in _students(cfg, device).items():
        model = student.pop("model")
        result = train_one_pass(
            model, data, batch_size=cfg.batch_size, seed=cfg.seed, eval_every=cfg.eval_every,
            device=device, run=run, name=name, progress=progress, **student,
        )  # fmt: skip
        result["parameters"] = sum(p.numel() for p in model.parameters())
        results[name] = result

    t = cfg.teacher
    task = (
        f"teacher MLP {t.d_in}→{t.hidden}×{t.depth}→{t.d_out} ({t.act}), "
        f"{t.n_train} train / {t.n_test} test samples, batch {cfg.batch_size}, one pass"
    )
    report = write_outputs(run, (
        f"# rcdl demo: teacher–student regression\n\n{task}.\n"
        f"Predicting 0 everywhere scores test MSE {zero_mse:.4f}.\n\n{results_table(results)}"
        f"\n\n{reading(cfg, results, zero_mse)}\n\nMachine: {describe_machine(device)}.\n"
    ), figures={"test_mse.png": partial(plot_curves, results,
                                        title=f"one pass, {t.n_train} samples")})
    total = time.perf_counter() - start
    run.write_summary(
        {"task": task, "zero_predictor_mse": zero_mse, "total_seconds": total, "models": results}
    )
    print("\n" + report, end="")
    print(f"Total {total:.1f} s. Run folder: {run.path}")
    return run, results
