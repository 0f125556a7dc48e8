"""The paper's one-epoch CIFAR-10 comparison, its Fig. 2 (docs/reference.md §6).

Run it with ``rcdl reproduce cifar10-1epoch`` (see docs/cifar10.md).

Protocol (docs/reference.md §6): every model sees the training images once, in batches of 16 taken
from a seeded random permutation, and minimises the batch-mean cross-entropy; test accuracy and
test loss on the whole test set are computed from one prediction pass every ``eval_every``
steps and at the end. Images are standardised and flattened to ``d = 3072``
(:mod:`rcdl.app.cifar`). All models share the residual backbone of :mod:`rcdl.nn.networks`.

Models (:data:`MODELS`). Each builder uses the library's networks, rules and optimizers.
None of them reimplements a layer.

====================  ==================================================================
``gws``               growing weighted softmax, L = 2, T = 6, clipped rule β = 3, η = 0.003
``gauge``             gauge-invariant weighted softmax, L = 2, T = 5, α = 10, η = 0.03, β = 100
``rbf``               growing RBF, L = 2, T = 10, η = 10
``mlp-<opt>``         ResNet-MLP (8 blocks) trained by ``sgd``, ``adam``, ``adamw``,
                      ``rmsprop`` or ``muon`` with the tuned settings of
                      :mod:`rcdl.app.baseline_optim`
``hybrid``            hybrid growing weighted softmax, L = 3, T = 5, τ = 50, η = 1, β = 30,
                      entries also trained by Adam 1e−3 (docs/reference.md §4)
``psoftmax-<N>``      parametric softmax, L = 2, T = 3, N entries per layer, Adam 1e−3
                      (docs/reference.md §5; the paper's N are 5000 and 50016)
``knn-l2``,           k-nearest neighbours (k chosen on 10 % of the training set held out),
``knn-cosine``        L2 or cosine distance (:mod:`rcdl.app.classical`)
``svm-linear``        linear SVM (hinge loss, SGD solver, penalty chosen on the held-out 10 %)
``svm-rbf``           RBF SVM through a Nyström map with 2 000 landmarks, then a linear SVM
====================  ==================================================================

The classical baselines are fitted on the whole training set at once and scored once; their
"train" and "eval" seconds are fit and predict times, and they report no test loss.

The growing models write one entry per training sample per layer. They have no
parameters, so :class:`rcdl.optim.grower.Grower` plays the optimizer's part. The hybrid writes
only the samples its distance gate lets through (the table gives its entries as a fraction
of the possible ones) and trains its entries by :class:`rcdl.optim.entry_adam.EntryAdam`.

Run folder (one per invocation, every model and seed in it), besides what every run
writes (:mod:`rcdl.app.runner`; ``environment.json`` is the first session's)::

    metrics.jsonl       every evaluation of every (model, seed), tagged with both
    summary.json        ``runs``: per (model, seed) accuracy, loss, entries, bytes,
                        parameters, seconds and the ``history`` of evaluations; ``models``:
                        per-model rows (:func:`model_rows`); the data; the sessions
    results.md/.csv     the table: accuracy (mean ± sd over seeds), loss, entries, store,
                        parameters, train/eval seconds, the paper's reference
    test_accuracy.png   test accuracy against training samples seen (mean over seeds)
    checkpoints/<model>-seed<k>.*    while that model trains (deleted when it finishes): the
                        checksummed ``.step<N>.pt`` files of the last two checkpoints and the
                        ``.manifest.json`` that commits them (:mod:`rcdl.train.checkpoint`)
    models/<model>-seed<k>.pt        with the option ``keep_models``, each growing model once
                        it finishes (:func:`save_model`): its state, its learners' states and
                        the training data's SHA-256, what ``rcdl forget`` edits
    models/<model>-seed<k>.log.pt    with ``replay_every`` too, the run's replay log
                        (:class:`rcdl.train.replay.ReplayLog`), what exact forgetting replays

Diagnostics (:class:`~rcdl.app.experiments.cifar10.config.DiagnosticConfig`, the command's
settings; a run saves them only when one is asked for): ``bf16_effect`` trains the hybrid with
one bfloat16 effect switched on for that run only, by the application's diagnostic changes
of :mod:`~rcdl.app.experiments.cifar10.bf16_effects` (results/speed/LOG.md, "The hybrid's
accuracy with a bfloat16 store"), and ``entry_grads`` writes every hybrid layer's entry
gradients' size at every Adam step to ``entry_grads/<model>-seed<k>.jsonl``.

The finished pairs are kept in ``summary.json`` (no ``finished.json``:
:attr:`rcdl.app.runner.Experiment.finished_in_summary`). A resumed run continues an
interrupted pair from its checkpoint to the result of an uninterrupted run
(:func:`rcdl.train.loop.train_one_pass`); ``metrics.jsonl`` may repeat the evaluations made
between the last checkpoint and the interruption.

The package, by role: :mod:`~rcdl.app.experiments.cifar10.config` (the settings and the
data), :mod:`~rcdl.app.experiments.cifar10.run` (one (model, seed) trained or fitted, the
sub-runs, the files a run keeps), :mod:`~rcdl.app.experiments.cifar10.report` (rows, tables,
the figure), :mod:`~rcdl.app.experiments.cifar10.combine` (one table from several run
folders) and :mod:`~rcdl.app.experiments.cifar10.bf16_effects` (the hybrid's bfloat16
diagnostics); the models are the application's zoo, :mod:`rcdl.app.models`.
"""

from __future__ import annotations

from typing import Any

from rcdl.app.experiments.cifar10.combine import combine_runs
from rcdl.app.experiments.cifar10.config import (
    Cifar10Config,
    DiagnosticConfig,
    load_data,
    saved_config,
)
from rcdl.app.experiments.cifar10.report import model_rows, write_report
from rcdl.app.experiments.cifar10.run import (
    MODEL_FORMAT,
    add_rows,
    data_digest,
    log_path,
    model_path,
    result_name,
    save_model,
    start,
    sub_runs,
)
from rcdl.app.rundir import RunDir
from rcdl.app.runner import Combine, Experiment, run_experiment

__all__ = ["EXPERIMENT", "EXPERIMENT_SPEC", "MODEL_FORMAT", "Cifar10Config", "DiagnosticConfig",
           "combine_runs", "data_digest", "log_path", "model_path", "model_rows", "run_cifar10",
           "save_model"]

EXPERIMENT = "cifar10-1epoch"  # also the run folders' `experiment` (config.EXPERIMENT)


def run_cifar10(cfg: Cifar10Config, **kw: Any) -> tuple[RunDir, dict[str, Any]]:
    """:func:`rcdl.app.runner.run_experiment` of the comparison; its option
    ``keep_checkpoints`` keeps each model's last checkpoint after it finishes,
    ``keep_models=True`` saves each growing model once it finishes (:func:`model_path`) and
    ``replay_every=N`` (with ``keep_models``) trains it with a replay log saved beside it."""
    return run_experiment(EXPERIMENT_SPEC, cfg, **kw)


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=DiagnosticConfig, saved_config=Cifar10Config,
    to_saved=saved_config,
    help="the paper's Fig. 2: growing and parametric models, one epoch of CIFAR-10 "
    "(docs/reference.md §6)",
    description="One epoch of CIFAR-10, batch 16, for the growing models (gws, gauge, rbf, "
    "hybrid; hybrid-tau<τ> and hybrid-always for other thresholds; laplacian, not in the "
    "paper, only when named), the ResNet-MLP baselines "
    "(mlp-sgd, mlp-adam, mlp-adamw, mlp-rmsprop, mlp-muon) and the parametric-softmax "
    "baselines (psoftmax-5000, psoftmax-50016; any psoftmax-<N>). Writes a run folder with "
    "results.md, results.csv and test_accuracy.png. See docs/cifar10.md.",
    sub_runs=sub_runs, report=write_report, load_data=load_data, start=start,
    update=add_rows, shards=True, sessions=True, finished_in_summary=result_name,
    options={"keep_checkpoints": "keep each model's last checkpoint after it finishes",
             "keep_models": "save each growing model, with its learners' states, under "
             "models/ once it finishes: what `rcdl forget RUN_DIR` edits (docs/unlearning.md)",
             "replay_every": "with --keep-models, train with a replay log that snapshots "
             "every N steps and save it beside the model, so that `rcdl forget --mode exact` "
             "can replay the run without the forgotten samples (docs/unlearning.md)"},
    combine=Combine(combine_runs, keep=("models",), show=True),
)  # fmt: skip
