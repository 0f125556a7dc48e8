"""Learning classes one task after another without replay, and memories that are kept but
no longer retrieved (docs/continual.md).

Run it with ``rcdl reproduce continual``. Split CIFAR-10, class-incremental: the ten classes
in ``T = 10 / classes_per_task`` tasks — ``(0, 1), (2, 3), …, (8, 9)`` in the natural
order ``"0"``, or the classes of a random order (``"random-K"``, a permutation drawn from
``K``, or ten digits naming one) cut into tasks the same way. Each task's training images
are seen once, in batches of 16 (the one-epoch protocol of docs/cifar10.md), in a random
order drawn from the seed; no image of an earlier task is replayed, and the test images
are classified by one 10-way head with no task label.

Models (``models``):

- the growing networks of the one-epoch comparison (``gws``, ``gauge``, ``rbf``,
  ``hybrid``, with their paper settings, :mod:`rcdl.app.models`);
  they learn by writing entries and remove none;
- the ResNet-MLP fine-tuned with ``mlp-sgd`` / ``mlp-adam`` (or any other network of the
  zoo), and with EWC (``mlp-ewc``) and LwF (``mlp-lwf``) on the ResNet-MLP with
  ``regularised_base``'s optimizer (:mod:`~rcdl.app.experiments.continual.baselines`, which
  says why they are not Avalanche's);
- any network with the labels trick (``rbf+labels``: the loss over the task's classes
  only, so a growing layer's new entries touch only their logits; ``rbf+batch-labels``:
  over the batch's classes), :class:`~rcdl.app.experiments.continual.baselines.LabelsTrick`;
- any growing network read out by the labels of the samples that wrote its readout's
  entries (``rbf+vote``, ``rbf+labels+vote``): each class's kernel mass at the query, the
  readout's kernel sharpened by ``vote_sharpness``,
  :class:`~rcdl.app.experiments.continual.baselines.LabelVote`;
- PEC (``pec``, Zając et al. 2024): one student per class imitating a frozen random
  teacher, on raw pixels, :class:`~rcdl.app.experiments.continual.baselines.PEC`;
- on raw pixels, classifiers whose result does not depend on the order of the images:
  kNN with the L2 or cosine distance (``knn-l2``, ``knn-cosine``; ``k`` chosen on a
  held-out 10 % of the images seen so far, :func:`rcdl.app.classical.fit_knn`), the
  nearest class mean (``ncm``) and streaming LDA (``slda``).

Measured, for each (model, order, seed) — one sub-run:

- the accuracy matrix ``R[i][j]``: accuracy (percent, 10-way) on the test images of task
  ``j``'s classes after learning task ``i`` (all ``j``; the metrics use ``j ≤ i``), and the
  same with a task-aware head (the argmax over task ``j``'s own classes only);
- the final accuracy on all ten classes; the average incremental accuracy
  (:func:`average_incremental_accuracy`); the backward transfer
  (:func:`backward_transfer`) of both matrices and the forgetting (:func:`forgetting`);
- after the last task, for a growing model, per task, the *silent memories*: how many of
  the entries the task wrote are still stored, and the accuracy on its test images of a
  copy of the model that keeps, in every growing layer, only the entries its training
  images wrote (and the initial entries, which no image wrote): :func:`own_entries_copy`.
  Restriction, not re-weighting: it is exact, takes nothing to tune, and asks one plain
  question — can the task's own entries still classify its images? (docs/continual.md).
  A parametric network has nothing to restrict. And the signed value mass the readout's
  entries put on each class, by the task that wrote them (:func:`value_mass`);
- with ``readouts`` (``--readouts as-trained task-inference task-balanced sharper-kernel``,
  default none), for a model with an RBF readout (``rbf``, ``rbf+labels``), the test images
  read out of its trained readout's entries in other ways, nothing trained again
  (:func:`~rcdl.app.experiments.continual.analysis.readouts`; a table of the report and
  ``readouts.json``). A run without it saves a :class:`ContinualConfig`, one with it a
  :class:`~rcdl.app.experiments.continual.spec.ReadoutsConfig`.

and for each (model, seed) the i.i.d. reference: one pass over the same training images
shuffled over all classes (EWC and LwF: their network and optimizer, which is plain
training with one task). The gap is i.i.d. minus class-incremental final accuracy.

Scale. The whole CIFAR-10 is far beyond two CPU cores: the defaults train networks in 90
class-incremental sub-runs and 21 i.i.d. ones (and fit the raw-pixel classifiers in 36 and
12 more), each full-width ResNet-MLP pass over all 50 000 images. The defaults are 2 000
training and 1 000 test images (random subsets: about 200 training images per class, 25
steps per task); most of their time is the ResNet-MLPs' passes (run times in
docs/continual.md, "Time").
``--train-size all --test-size all`` is the whole CIFAR-10, for a GPU; ``--full`` is that
with the natural order and ``random-1``, seed 0, and the models of :data:`FULL`.

The package, by role: :mod:`~rcdl.app.experiments.continual.spec` (the tasks, the model
names of :class:`~rcdl.app.experiments.continual.spec.ModelName` and the settings),
:mod:`~rcdl.app.experiments.continual.run` (a model trained task after task and measured,
the sub-runs), :mod:`~rcdl.app.experiments.continual.baselines` (EWC, LwF, the labels trick,
the label vote, PEC, NCM, streaming LDA), :mod:`~rcdl.app.experiments.continual.analysis`
(the metrics, the silent memories, the summary's rows and verdict),
:mod:`~rcdl.app.experiments.continual.report` and
:mod:`~rcdl.app.experiments.continual.plots`.
"""

from __future__ import annotations

from rcdl.app.experiments.continual.analysis import (
    average_incremental_accuracy,
    backward_transfer,
    entries_by_task,
    finish,
    forgetting,
    own_entries_copy,
    readouts,
    rows,
    value_mass,
)
from rcdl.app.experiments.continual.report import ANCHORS, write_report
from rcdl.app.experiments.continual.run import run_sequence, start, sub_runs
from rcdl.app.experiments.continual.spec import (
    CLASSES,
    ContinualConfig,
    ModelName,
    ReadoutsConfig,
    class_order,
    load_data,
    saved_config,
    task_split,
)
from rcdl.app.runner import Experiment

__all__ = ["ANCHORS", "CLASSES", "EXPERIMENT", "EXPERIMENT_SPEC", "FULL", "ContinualConfig",
           "ModelName", "ReadoutsConfig", "average_incremental_accuracy", "backward_transfer",
           "class_order", "entries_by_task", "forgetting", "load_data", "own_entries_copy",
           "readouts", "rows", "run_sequence", "task_split", "value_mass"]

EXPERIMENT = "continual"

# --full: the full-scale protocol (docs/continual.md, "Running it")
FULL = {"train_size": None, "test_size": None, "orders": ("0", "random-1"), "seeds": (0,),
        "models": ("gws", "rbf", "gws+labels", "rbf+labels", "rbf+vote", "rbf+labels+vote",
                   "pec", "knn-l2", "knn-cosine", "ncm", "slda")}

EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=ReadoutsConfig, saved_config=ContinualConfig,
    to_saved=saved_config,
    help="class-incremental Split CIFAR-10 without replay: growing models against "
    "fine-tuned, EWC and LwF MLPs and raw-pixel kNN / NCM / SLDA, and the silent memories "
    "(docs/continual.md)",
    description="Learns CIFAR-10's classes two at a time (five tasks, natural and random "
    "class orders), one pass over each task's images, no replay, one 10-way head. Reports "
    "the accuracy matrix, final and average incremental accuracy, backward transfer and "
    "forgetting, each model's gap to its i.i.d. one-pass accuracy on the same images, and, "
    "for the growing models, whether an earlier task's entries are still stored and "
    "whether they alone still classify its images; with --readouts, the rbf models' "
    "trained readout read out in other ways. See docs/continual.md.",
    sub_runs=sub_runs, report=write_report, load_data=load_data, start=start,
    finish=finish, switches={"full": (
        "the whole CIFAR-10 (all 50 000 / 10 000 images), the natural order and random-1, "
        "seed 0: the growing models with and without the labels trick and the label vote, "
        "PEC and the "
        "raw-pixel classifiers (the MLPs stay at the reduced scale; docs/continual.md)",
        FULL)},
)  # fmt: skip
