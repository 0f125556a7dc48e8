"""Forgetting training samples against retraining without them (docs/attribution.md,
"Forgetting: measured").

Run it with ``rcdl reproduce unlearning`` (docs/unlearning.md, docs/fast_forgetting.md).
Every entry of a growing layer was written by one training sample
(:mod:`rcdl.memory.provenance`), so :func:`rcdl.memory.forgetting.forget` removes a sample's
entries in milliseconds. Retraining from scratch without the samples is the gold
standard any unlearning method is judged against; this experiment puts the two side by side.

For each model and seed, one sub-run:

1. trains the model one epoch (batch 16, the one-epoch protocol of docs/cifar10.md) on the
   whole training subset: the *original*;
2. for each forget set (``scenarios``): ``random``, a random ``forget_fraction`` of the
   training images (drawn from the seed), and ``class``, every training image of class
   ``forget_class``:

   - *forget* (growing models): the original with :func:`rcdl.memory.forgetting.forget` applied,
     timed;
   - *repair* (growing models whose readout a rule writes: not the hybrid): the original
     with :func:`rcdl.memory.repair.forget_and_repair` applied, timed (the readout's
     later entries re-written on its stored keys); *repair+keys*: the same with the
     readout's keys recomputed first from the training images;
   - *exact* (growing models): the original with
     :func:`rcdl.train.unlearning.forget_exactly` applied (restore the snapshot before the
     earliest forgotten image, replay the rest of the stream without them), timed; it must
     equal *retrain* bit for bit, and the run checks that its test predictions do;
   - *fine-tune* (the parametric baseline): the original trained further, with a fresh
     optimizer of its kind, on a random ``finetune_fraction`` of the retained images (one
     pass over them), timed: the cheap approximate method of the unlearning literature;
   - *retrain*: the same model trained from the same seed on the original's stream with the
     forgotten images taken out (every other image in the same order, batches re-formed).

Measured for each variant: accuracy on the forget set, on the retained set (at most
``retain_eval_size`` of its images, a random subset) and on the test set, and a
membership-inference score (:func:`mia_score`), the simple attack of the starting kit of
the NeurIPS 2023 machine-unlearning challenge: a logistic regression on per-sample
cross-entropy losses, told forget-set images from test images, its accuracy
averaged over 10 stratified random splits (half the pairs held out each time), on equal
numbers of each (the larger set subsampled). For the ``class`` scenario the test images are
those of the forgotten class, so that the attack sees one class on both sides. A
perfect unlearner scores what the retrained model scores (about 0.5 when the forgotten
images look like unseen ones), not 0.5 by construction.

Anchors (the starting kit, CIFAR-10, ResNet-18, forgetting a random subset): MIA 0.579 for
the original model, 0.512 after fine-tuning on the retained set, 0.502 for the retrained
one.

Studies (``studies``; the default is the forgetting comparison above alone, ``run.py``).
Each other study has its own sub-runs per (model, seed), named ``<study>-<model>-seed<k>``,
which resume as the comparison's do, and writes its own files into the run folder beside a
section of ``results.md``:

- ``exact-cost`` (``exact_cost.py``): exact forgetting's seconds against retraining's over
  the earliest forgotten sample's position, with the bit-for-bit check
  (``exact_forgetting.json``, ``.png``);
- ``forget-command`` (``forget_command.py``): ``rcdl forget --mode exact`` on a kept
  one-epoch run, in a new process, against retraining (``forget_command.json``);
- ``log-size`` (``log_size.py``): a saved replay log's size on disk and one exact forget
  from it (``replay_log_size.json``);
- ``repair-budget`` (``repair_budget.py``): fast forgetting's gap to retraining against the
  share of the readout's steps it re-writes (``repair_budget.json``, ``.md``, ``.png``).

A run of the comparison alone, with every study setting at its default, saves a
:class:`ForgettingConfig` (:func:`saved_form`): its folder is what it was before the studies
existed. Modules: ``config`` (the settings: the comparison's, :class:`ForgettingConfig`,
and the studies' on top, :class:`UnlearningConfig`), ``run`` (the comparison's sub-runs and
measures: forget sets, per-sample losses, the attack), one module per other study,
``report`` (the tables, the figure, each study's section) and ``combine`` (``--combine``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rcdl.app.experiments.unlearning.combine import combine_runs
from rcdl.app.experiments.unlearning.config import (
    SCENARIOS,
    STUDIES,
    ForgettingConfig,
    SavedConfig,
    UnlearningConfig,
    full,
    load_data,
    saved_form,
)
from rcdl.app.experiments.unlearning.report import (
    ANCHORS,
    METRICS,
    STUDY_MODULES,
    finish,
    plot,
    rows,
    write_report,
)
from rcdl.app.experiments.unlearning.run import (
    MIA_SPLITS,
    forget_indices,
    mia_score,
    per_sample_losses,
    start,
    unlearn_one,
)
from rcdl.app.experiments.unlearning.run import sub_runs as forgetting_sub_runs
from rcdl.app.runner import Combine, Experiment, Session

__all__ = ["ANCHORS", "EXPERIMENT", "EXPERIMENT_SPEC", "METRICS", "MIA_SPLITS", "SCENARIOS",
           "STUDIES", "ForgettingConfig", "SavedConfig", "UnlearningConfig", "combine_runs",
           "forget_indices", "load_data", "mia_score", "per_sample_losses", "plot", "rows",
           "saved_form", "unlearn_one", "write_report"]  # fmt: skip

EXPERIMENT = "unlearning"


def sub_runs(cfg: ForgettingConfig, data: Any, session: Session) -> Iterator:
    """Every study's sub-runs, the forgetting comparison's first, the others in the order
    ``studies`` names them."""
    studies = full(cfg).studies
    if "forgetting" in studies:
        yield from forgetting_sub_runs(cfg, data, session)
    for study in studies:
        if study != "forgetting":
            yield from STUDY_MODULES[study].sub_runs(full(cfg), data, session)


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=UnlearningConfig,
    help="forgetting training samples (rcdl.forget) against retraining without them and "
    "fine-tuning an MLP, with a membership-inference score (docs/attribution.md)",
    description="Trains each model one epoch on a CIFAR-10 subset, then forgets a random "
    "10 % of the training images and, separately, one whole class: growing models by "
    "removing the images' entries (rcdl.forget), parametric ones by fine-tuning on the "
    "retained images; and retrains each model without them. Reports accuracy on the "
    "forget, retained and test images, a membership-inference score and the seconds "
    "each took. See docs/attribution.md. --studies measures more (or other) things: the "
    "cost of exact forgetting, the rcdl forget command in a new process, a replay log's "
    "size on disk, the repair's gap to retraining against its budget "
    "(docs/unlearning.md).",
    sub_runs=sub_runs, report=write_report, load_data=load_data, start=start,
    finish=finish, combine=Combine(combine_runs, show=True), saved_config=SavedConfig,
    to_saved=saved_form,
)  # fmt: skip
