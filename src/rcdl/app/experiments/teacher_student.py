"""Teacher–student regression: growing vs size-matched parametric softmax (docs/reference.md §8).

Run it with ``rcdl reproduce teacher-student`` (see docs/teacher_student.md).

The paper's claim (docs/reference.md §8): a random teacher network generates the data, and the
growing weighted-softmax student clearly beats a parametric softmax whose size matches the
student's final database. For every seed a fresh random teacher MLP
(:func:`rcdl.app.data.make_teacher_data`: Gaussian inputs ``x ~ N(0, I_{d_in})``, targets
rescaled to mean 0 and variance 1, so predicting 0 scores a test MSE of about 1) labels
``n_train`` training and ``n_test`` test inputs, and three students see the training set
once, in the same order and the same batches, on the squared loss:

==============  ===========================================================================
``gws``         growing weighted softmax: the residual backbone of docs/reference.md §6 on the input
                (width ``d_in``, no input projection), ``depth`` blocks ``d_in → d_in`` and
                a readout ``d_in → d_out``, all :class:`~rcdl.nn.layers.GrowingSoftmax` with
                ``initial_entries`` initial entries; learns by growth only, the clipped rule
                ``ClippedSoftmaxRule(η, β)`` (docs/reference.md §3): one entry per sample per layer,
                ``initial_entries + n_train`` entries per layer at the end
``parametric``  parametric softmax (docs/reference.md §5): the same backbone with a fixed table of
                ``P`` entries per layer (keys, weighted values, weights), trained by Adam; ``P``
                defaults to ``initial_entries + n_train``, the growing student's final size
``mlp``         :class:`~rcdl.nn.networks.MLP` ``d_in → mlp_width × mlp_depth → d_out`` (ReLU),
                trained by Adam
==============  ===========================================================================

Decisions (measured in docs/teacher_student.md):

- **Size matching.** The parametric table holds exactly as many entries per layer as the
  growing student stores after the pass (``initial_entries + n_train``); both use the same
  backbone, so the parametric student's ``depth`` block tables of ``P · (2 d_in + 1)``
  numbers and readout table of ``P · (d_in + d_out + 1)`` hold exactly as many numbers as
  the growing stores (which add a timestamp per entry).
- **Hyperparameters.** Each student got a small sweep on this task (seeds 0 and 1):
  the growing rule over T 0.25–2, β 0.1–3, η 0.01–3 at 4 000 samples, then the best few at
  16 000: T = 0.7, β = η = 1 (β/η ≥ 30 diverges). docs/reference.md §6's CIFAR-10 setting (T = 6,
  β = 3, η = 0.003) diverges here within ten steps: at ``d_in = 32`` the self-logit
  ``√d_in / T`` is below 1, so every new entry weighs on every query about as much as on
  its own, while its weight is at most ``η B``; a batch's values ``−β g`` overshoot. The
  parametric student keeps docs/reference.md §5's T = 3 and Adam 1e−3, the best of T ∈ {1, 3} ×
  lr ∈ {1e−3, 3e−3, 1e−2} at 16 000 samples (lr 1e−2 wins at 4 000 samples, with four
  times fewer steps). The MLP: width 256, Adam 3e−3 (of widths 64, 256 × lr 1e−3–1e−2).
- **Seeds.** Seed ``s`` fixes the teacher (``TeacherConfig(seed=s)``), the data, the
  students' initialisation and the order of the samples: the spread over seeds is over
  tasks as well as over runs.

Run folder, besides what every run writes (:mod:`rcdl.app.runner`)::

    metrics.jsonl         every evaluation of every (model, seed), tagged with both
    summary.json          per-(model, seed) results and histories, per-model rows, the
                          mean ± sd curves, the verdict; ``complete``
    results.md/.csv       final test MSE (mean ± sd), entries, parameters, store, times
    test_mse.png          test MSE against samples seen, mean ± sd band over seeds
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rcdl.app.config import ExperimentConfig, device_setting, setting
from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.app.report import (
    Curve,
    Panel,
    csv_text,
    group_runs,
    markdown_table,
    mean_sd,
    plot_panels,
    pm,
    write_outputs,
)
from rcdl.app.rundir import RunDir, describe_machine
from rcdl.app.runner import Experiment, Session, run_experiment
from rcdl.distributed import rank_and_world, shard
from rcdl.nn.layers import ParametricSoftmax
from rcdl.nn.networks import MLP, GrowingSoftmaxNet, ParametricSoftmaxNet
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.nn.store import format_bytes
from rcdl.optim.grower import Grower
from rcdl.train.loop import train_one_pass

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "MODELS", "TeacherStudentConfig", "build_model",
           "make_data", "run_teacher_student"]  # fmt: skip

EXPERIMENT = "teacher-student"
MODELS = {
    "gws": "growing weighted softmax (gws)",
    "parametric": "parametric softmax, size-matched",
    "mlp": "MLP + Adam",
}


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class TeacherStudentConfig(ExperimentConfig):
    """Settings of the teacher–student comparison (docs/reference.md §8).

    The defaults: a 32 → 64 × 2 → 1 tanh teacher, 16 000 training samples, three seeds. The
    growing student's step attends over every entry so far, so its cost grows with the
    square of ``n_train``; the parametric one takes 1 000 Adam steps on three tables of
    16 016 entries (2.6 M parameters). Run times in docs/teacher_student.md. ``--quick``: 512
    train / 256 test samples, three seeds; the numbers mean little at this size.
    """

    QUICK = {"n_train": 512, "n_test": 256, "eval_every": 4}

    d_in: int = setting(32, "input dimension", metavar="D")
    d_out: int = setting(1, "output dimension of the task and of every student", metavar="D")
    teacher_width: int = setting(64, "teacher width", metavar="W")
    teacher_depth: int = setting(2, "teacher hidden layers", metavar="L")
    teacher_act: str = setting("tanh", "the teacher's activation between its hidden layers",
                               choices=("tanh", "relu"))
    n_train: int = setting(16_000, "training samples", metavar="N")
    n_test: int = setting(1_000, "test samples", metavar="N")
    noise: float = setting(0.0, "target noise sd")
    seeds: tuple[int, ...] = setting((0, 1, 2), "seeds", minimum=0, metavar="K")
    depth: int = setting(2, "residual blocks of both softmax students (and a readout)",
                         metavar="L")
    initial_entries: int = setting(16, "initial entries per layer of the growing student "
                                   "(docs/reference.md §6)", minimum=0, metavar="N")
    temperature: float = setting(0.7, "growing student's T", positive=True, metavar="T")
    beta: float = setting(1.0, "growing student's β", positive=True)
    eta: float = setting(1.0, "growing student's η", positive=True)
    parametric_entries: int | None = setting(
        None, "table size P per layer of the parametric student", metavar="N",
        default_text="initial entries + n_train, the growing student's final size")
    parametric_temperature: float = setting(3.0, "T of the parametric student "
                                            "(docs/reference.md §5)", positive=True,
                                            metavar="T")
    parametric_lr: float = setting(1e-3, "Adam lr of the parametric student", positive=True)
    mlp_width: int = setting(256, "hidden width of the MLP student (ReLU)", metavar="W")
    mlp_depth: int = setting(2, "hidden layers of the MLP student", minimum=0, metavar="L")
    mlp_lr: float = setting(3e-3, "Adam lr of the MLP", positive=True)
    batch_size: int = setting(16, "samples per step B", metavar="B")
    eval_every: int = setting(50, "steps between test evaluations", metavar="STEPS")
    eval_batch_size: int = setting(1000, "test samples per prediction batch", metavar="N")
    device: str = device_setting()

    @property
    def entries(self) -> int:
        """Entries ``P`` per layer of the parametric student: by default the growing
        student's final store per layer, ``initial_entries + n_train``."""
        if self.parametric_entries is None:
            return self.initial_entries + self.n_train
        return self.parametric_entries

    def teacher(self, seed: int) -> TeacherConfig:
        """The task of ``seed``: the teacher and data-set sizes of this config."""
        return TeacherConfig(d_in=self.d_in, hidden=self.teacher_width, d_out=self.d_out,
                             depth=self.teacher_depth, act=self.teacher_act,
                             n_train=self.n_train, n_test=self.n_test, noise=self.noise,
                             seed=seed)  # fmt: skip


# --------------------------------------------------------------------------- running


def make_data(cfg: TeacherStudentConfig, seed: int) -> tuple[torch.Tensor, ...]:
    """The task of ``seed``: ``(x_train (n_train, d_in), y_train (n_train, d_out),
    x_test (n_test, d_in), y_test (n_test, d_out))``, float32 on the CPU."""
    return make_teacher_data(cfg.teacher(seed))


def build_model(
    name: str, seed: int, cfg: TeacherStudentConfig, *, device: torch.device | str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer | None, Grower | None]:
    """Student ``name`` of :data:`MODELS` with its learner, reproducibly from ``seed``.

    ``gws``: ``GrowingSoftmaxNet(d_in, d_out, depth, T, ClippedSoftmaxRule(η, β))`` with
    ``initial_entries`` initial entries per layer seeded from ``seed``, and a grower with
    room for ``n_train`` more entries per layer. ``parametric``:
    ``ParametricSoftmaxNet(d_in, d_out, depth, entries=cfg.entries, T)`` and Adam.
    ``mlp``: ``MLP(d_in, mlp_width, d_out, mlp_depth)`` and Adam. Parametric students are
    initialised from torch's global generator seeded with ``seed``.

    Returns:
        ``(model, optimizer or None, grower or None)``, the model on ``device``.
    """
    torch.manual_seed(seed)
    if name == "gws":
        rule = ClippedSoftmaxRule(eta=cfg.eta, beta=cfg.beta)
        model: nn.Module = GrowingSoftmaxNet(cfg.d_in, cfg.d_out, cfg.depth,
                                             temperature=cfg.temperature,
                                    rule=rule, initial_entries=cfg.initial_entries,
                                    seed=seed).to(device)  # fmt: skip
        grower = Grower(model)
        grower.reserve(cfg.n_train)
        return model, None, grower
    if name == "parametric":
        model = ParametricSoftmaxNet(cfg.d_in, cfg.d_out, cfg.depth, entries=cfg.entries,
                                     temperature=cfg.parametric_temperature).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.parametric_lr), None
    if name == "mlp":
        model = MLP(cfg.d_in, cfg.mlp_width, cfg.d_out, cfg.mlp_depth).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.mlp_lr), None
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def _train(name: str, seed: int, cfg: TeacherStudentConfig, data: tuple,
           session: Session) -> dict[str, Any]:  # fmt: skip
    """One pass of student ``name`` on the task of ``seed``; its result and its identity."""
    model, optimizer, grower = build_model(name, seed, cfg, device=session.device)
    if grower is not None and rank_and_world()[1] > 1:  # under torchrun: split the stores
        shard(model)  # (the parametric students are replicated: every rank trains the same)
    result = train_one_pass(
        model, data, batch_size=cfg.batch_size, seed=seed, optimizer=optimizer, grower=grower,
        eval_every=cfg.eval_every, eval_batch_size=cfg.eval_batch_size, device=session.device,
        run=session.log(model=name, seed=seed), name=f"{name}-seed{seed}",
        progress=session.progress,
    )  # fmt: skip
    per_layer = None  # weighted-softmax entries per layer, blocks then readout
    if grower is not None:
        per_layer = grower.entries_per_layer_all_ranks()
    elif name == "parametric":
        per_layer = [layer.keys.shape[0] for layer in model.modules()  # blocks, readout
                     if isinstance(layer, ParametricSoftmax)]
    result.pop("resumed")
    return {
        "model": name, "seed": seed, "entries_per_layer": per_layer,
        "table_entries": None if per_layer is None else sum(per_layer),
        "parameters": sum(p.numel() for p in model.parameters()), **result,
    }  # fmt: skip


def _sub_runs(cfg: TeacherStudentConfig, data: None, session: Session) -> Iterator:
    """The three students for every seed, on that seed's task."""
    for seed in cfg.seeds:
        task = tuple(t.to(session.device) for t in make_data(cfg, seed))
        for name in MODELS:
            yield f"{name}-seed{seed}", partial(_train, name, seed, cfg, task, session)


def _start(cfg: TeacherStudentConfig, data: None) -> dict[str, Any]:
    """The parametric table size and, per seed, the test MSE of predicting 0 everywhere."""
    zero = {str(seed): float(make_data(cfg, seed)[3].pow(2).mean()) for seed in cfg.seeds}
    return {"parametric_entries": cfg.entries, "zero_predictor_mse": zero}


def _finish(cfg: TeacherStudentConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = model_rows(summary["runs"])
    summary["curves"] = mean_curves(summary["runs"])
    summary["verdict"] = verdict(summary["runs"])


def run_teacher_student(cfg: TeacherStudentConfig, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
    """Train the three students for every seed (:func:`rcdl.app.runner.run_experiment`;
    the tasks are made here, so ``data`` and ``download`` have no use).

    The summary adds ``parametric_entries``, ``zero_predictor_mse`` (per seed), ``rows``
    (per model, mean ± sd over seeds), ``curves`` (per model, mean ± sd test MSE at every
    evaluation) and ``verdict`` (gws against the size-matched parametric student); each of
    ``runs`` holds the final ``test_mse``, entries, parameters, seconds and ``history``.

    Raises:
        FloatingPointError: if a student's training loss is not finite (naming the step).
        ValueError: if a growing layer is handed a non-finite gradient (the growing rule
            diverged: lower β/η or raise T).
    """
    return run_experiment(EXPERIMENT_SPEC, cfg, **kw)


# --------------------------------------------------------------------------- reporting


def model_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model: final test MSE, training and evaluation seconds (mean and sd over
    seeds), entries (per layer and in all), parameters and store bytes."""
    rows = []
    for name, rs in group_runs(runs, MODELS).items():
        row: dict[str, Any] = {"model": name, "label": MODELS[name],
                               "seeds": [r["seed"] for r in rs]}  # fmt: skip
        for key in ("test_mse", "train_seconds", "eval_seconds"):
            row[key], row[f"{key}_sd"] = mean_sd([r[key] for r in rs])
        for key in ("entries_per_layer", "table_entries", "parameters", "bytes"):
            row[key] = rs[0][key]  # the same for every seed
        rows.append(row)
    return rows


def mean_curves(runs: list[dict[str, Any]]) -> dict[str, dict[str, list]]:
    """Per model: ``samples`` seen at each evaluation and the test MSE there, mean and sd
    over seeds (``sd`` is ``None`` with one seed)."""
    curves = {}
    for name, rs in group_runs(runs, MODELS).items():
        samples = [h["samples"] for h in rs[0]["history"]]  # every seed evaluates alike
        points = [mean_sd([r["history"][i]["test_mse"] for r in rs]) for i in range(len(samples))]
        curves[name] = {"samples": samples, "mean": [m for m, _ in points],
                        "sd": [s for _, s in points]}  # fmt: skip
    return curves


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The growing student against the size-matched parametric one: the ratio of their mean
    final test MSEs, the ratio on each seed, and the seeds on which the growing student is
    better."""
    by = {(r["model"], r["seed"]): r["test_mse"] for r in runs}
    seeds = [s for m, s in by if m == "gws" and ("parametric", s) in by]
    if not seeds:
        return None
    gws = statistics.fmean(by["gws", s] for s in seeds)
    parametric = statistics.fmean(by["parametric", s] for s in seeds)
    wins = [s for s in seeds if by["gws", s] < by["parametric", s]]
    per_seed = [by["gws", s] / by["parametric", s] for s in seeds]
    return {"mse_ratio": gws / parametric, "per_seed_ratio": per_seed, "gws_better_on": wins,
            "seeds": seeds}  # fmt: skip


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`model_rows`."""
    header = ("model", "test MSE", "entries per layer", "entries, all layers", "parameters",
              "store", "train s", "eval s")  # fmt: skip
    return markdown_table(header, [[
        r["label"], pm(r["test_mse"], r["test_mse_sd"], 4),
        "—" if r["entries_per_layer"] is None else " / ".join(
            f"{n:,}" for n in r["entries_per_layer"]),
        "—" if r["table_entries"] is None else f"{r['table_entries']:,}",
        f"{r['parameters']:,}", "—" if r["bytes"] is None else format_bytes(r["bytes"]),
        pm(r["train_seconds"], r["train_seconds_sd"], 1),
        pm(r["eval_seconds"], r["eval_seconds_sd"], 1),
    ] for r in rows])  # fmt: skip


def plot_curves(curves: dict[str, dict[str, list]], path: Path, *, title: str,
                zero_mse: float | None = None) -> Path:  # fmt: skip
    """Test MSE against samples seen (log scale), one line per model with a ± sd band when
    there are several seeds (its lower edge clipped at half the mean, for the log axis), and
    the zero predictor's MSE as a dotted line."""
    lines = [Curve(c["samples"], c["mean"], MODELS[name], sd=c["sd"], floor=0.5,
                   style={"marker": "."}) for name, c in curves.items()]  # fmt: skip
    zero = [] if zero_mse is None else [{"y": zero_mse, "color": "grey", "linestyle": ":",
                                         "linewidth": 1, "label": "predict 0"}]  # fmt: skip
    return plot_panels(path, [Panel(lines, "training samples seen", "test MSE", title,
                                    yscale="log", hlines=zero, grid="both")],
                       figsize=(6.4, 4.2))  # fmt: skip


def _outcome(v: dict[str, Any] | None) -> str:
    """The verdict in words ("" without one)."""
    if v is None:
        return ""
    return (
        f"The growing student's mean test MSE is {v['mse_ratio']:.3f} × the size-matched "
        f"parametric student's (per seed: {', '.join(f'{r:.3f}' for r in v['per_seed_ratio'])}"
        f"); it is lower on {len(v['gws_better_on'])} of {len(v['seeds'])} seeds. The paper "
        "reports that the growing student clearly beats the size-matched parametric softmax "
        "(docs/reference.md §8; no numbers given)."
    )


def write_report(run: RunDir, cfg: TeacherStudentConfig, summary: dict[str, Any],
                 device: torch.device) -> str:  # fmt: skip
    """Write ``results.md``, ``results.csv`` and ``test_mse.png``; return the markdown."""
    steps = math.ceil(cfg.n_train / cfg.batch_size)
    zero = statistics.fmean(summary["zero_predictor_mse"].values())
    noise = f", training-target noise sd {cfg.noise:g}" if cfg.noise else ""
    task = (
        f"Teacher: a random MLP {cfg.d_in} → {cfg.teacher_width} × {cfg.teacher_depth} → "
        f"{cfg.d_out} ({cfg.teacher_act}), outputs scaled to unit variance{noise}; a fresh "
        f"teacher per seed. {cfg.n_train:,} training / {cfg.n_test:,} test samples, one pass, "
        f"batch {cfg.batch_size} ({steps:,} steps, the same batches for every student), "
        f"squared loss. Seeds: {' '.join(map(str, cfg.seeds))}. Predicting 0 scores test MSE "
        f"{zero:.4f}."
    )
    matched = (f" (the growing student's final size: {cfg.initial_entries} + {cfg.n_train:,})"
               if cfg.parametric_entries is None else "")  # fmt: skip
    students = "\n".join([
        f"- **gws**: {cfg.depth} residual blocks and a readout, all growing weighted-softmax "
        f"layers, T = {cfg.temperature:g}, clipped rule β = {cfg.beta:g}, η = {cfg.eta:g}, "
        f"{cfg.initial_entries} initial entries per layer; growth only.",
        f"- **parametric**: the same backbone with {cfg.entries:,} entries per layer{matched}, "
        f"T = {cfg.parametric_temperature:g}, Adam {cfg.parametric_lr:g}.",
        f"- **mlp**: {cfg.d_in} → {cfg.mlp_width} × {cfg.mlp_depth} → {cfg.d_out} (ReLU), "
        f"Adam {cfg.mlp_lr:g}.",
    ])  # fmt: skip
    report = "\n\n".join(part for part in [
        "# Teacher–student regression (docs/reference.md §8)", task, students,
        results_table(summary["rows"]),
        "Test MSE after the pass, mean ± sd over seeds; train s: seconds of training "
        "(forward, backward, update or growth), eval s: seconds of evaluating the test MSE "
        f"every {cfg.eval_every} steps. Entries: weighted-softmax entries (for the parametric "
        "student, its table rows); store: the growing student's entry store.",
        _outcome(summary["verdict"]),
        f"Machine: {describe_machine(device)}.\n",
    ] if part)  # fmt: skip
    title = f"teacher–student, one pass over {cfg.n_train:,} samples"
    return write_outputs(run, report, csv_text(summary["rows"]), {
        "test_mse.png": partial(plot_curves, summary["curves"], title=title, zero_mse=zero)})


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=TeacherStudentConfig,
    help="teacher–student regression: growing weighted-softmax student vs a "
    "size-matched parametric softmax and an MLP (docs/reference.md §8)",
    description="A random teacher network generates a regression stream; a growing "
    "weighted-softmax student (gws rule), a parametric-softmax student with as many "
    "entries as the growing one stores at the end (Adam) and an MLP (Adam) learn it in "
    "one pass, several seeds. Writes results.md, results.csv and test_mse.png. No data "
    "files needed. See docs/teacher_student.md.",
    sub_runs=_sub_runs, report=write_report, load_data=None, start=_start, finish=_finish,
    shards=True,
)  # fmt: skip
