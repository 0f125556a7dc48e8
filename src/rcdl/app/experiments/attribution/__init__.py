"""rcdl's native attribution measured on CIFAR-10: the linear datamodeling score, mislabel
detection by self-influence, and test images beside the training images they rest on
(docs/attribution.md, "rcdl reproduce attribution").

Run it with ``rcdl reproduce attribution``. Every model is a growing model of the one-epoch
comparison (:mod:`rcdl.app.models`), trained one epoch, batch 16, on a
random CIFAR-10 training subset (docs/cifar10.md). rcdl's score ``τ(x, i)`` of training
image ``i`` for an output ``f(x)`` is :func:`rcdl.memory.attribution.explain`'s per-sample
contribution: the sum, over the entries ``i`` wrote in every growing layer, of their
contribution to ``f(x)`` (the readout's exact shares, first order through earlier layers).

**Linear datamodeling score** (LDS; TRAK, Park et al. 2023; the dattri benchmark). Score
every (test image ``x``, training image ``i``) pair towards ``x``'s correct-class logit with
the model trained on the whole subset (seed 0); retrain ``M = halves`` models on random
halves ``S_m`` of the subset (seeds 100, 101, ...); for each test image, the Spearman
correlation over ``m`` between ``Σ_{i ∈ S_m} τ(x, i)`` and the retrained model's
correct-class margin ``f_y(x) − log Σ_{c ≠ y} e^{f_c(x)}``; LDS is its mean over test
images. Three variants of ``τ`` (:data:`VARIANTS`): summed over every growing layer, the
readout's exact shares alone, and minus the readout's exact deletion effect
(:func:`rcdl.memory.attribution.deletion_effects`).

**Mislabel detection.** Flip the labels of ``flip`` of the training images (to another
class, at random; seed 2), train once (seed 0), and rank the training images by
**self-influence**: the contribution of an image's own entries, in every layer, to its own
(noisy) label's logit. A flipped image can only be fitted by its own entries, so it should
rank high. And by the **leave-one-out margin**: minus the image's label margin when the
model answers it with its own entries deleted from every layer, exactly
(:func:`rcdl.memory.leave_one_out.leave_one_out`): a flipped label that only its own
entries supported loses its margin. By the **leave-one-out label vote**: minus the label's
margin when the labels of the samples that wrote the readout's entries vote, weighed by the
readout's kernel (:class:`~rcdl.app.experiments.continual.baselines.LabelVote`), the image's
own entries left out (:func:`leave_one_out_vote_margins`); and by the mean of its ranks
under the two leave-one-out rankings. Baselines: the trained model's cross-entropy on each
training image, and a random ranking. Measured: the ROC-AUC of telling flipped from clean
images, and the share of the flipped images among the top 10 % and 20 % of each ranking
(inspected).

**Explanations** (``explanations.png``): the first ``shown`` test images, each beside the
``top`` training images with the largest summed contribution to its predicted logit under
each model trained on the whole subset.

Sub-runs, per model, in order (``--resume`` keeps the finished ones); the tensors one
sub-run hands to a later one are files of the run folder:

- ``<model>-lds-full``: train on the whole subset, score every pair, save every half's
  summed scores (``lds-<model>-predicted.pt``) and the shown explanations' images
  (``lds-<model>-shown.pt``);
- ``<model>-lds-halves-<first>``: retrain ``halves_per_sub_run`` models on their halves and
  save their margins (``lds-<model>-margins-<first>.pt``);
- ``<model>-lds``: the Spearman correlations and the LDS;
- ``<model>-mislabel``: mislabel detection.

**Options** (not settings: ``config.json`` is the same with or without them; each adds
sub-runs, which a resumed run keeps or leaves with the option):

- ``cascade`` (``--cascade``): two more LDS scores, the readout's shares with the first-order
  change of the readout's later writes (:func:`rcdl.memory.cascade.readout_cascade`: to one
  later write, ``readout, one-level``, and through every later write, ``readout, cascade``),
  where the readout does not normalise (RBF; a softmax readout such as gws's is noted as
  refused). Sub-run ``<model>-lds-cascade``, after ``<model>-lds``: the full model trained
  again (the same seed and data), its cascade summed over each half and correlated with the
  retrained margins;
- ``seed_ceiling`` (``--seed-ceiling``): every half retrained a second time from seed
  ``1000 + m`` (sub-runs ``<model>-lds-again-<first>``, margins in
  ``lds-<model>-again-<first>.pt``), and the LDS of those margins against the first
  retraining's (``<model>-lds-ceiling``, the row ``seed ceiling``): no score of the half
  alone predicts the part of a retrained margin that the seed decides;
- ``trak`` (``--trak``): the same-data peer, TRAK (dattri) on the ResNet-MLP, on the same
  halves and flipped labels (:mod:`~rcdl.app.experiments.attribution.peer_trak`; sub-runs
  ``mlp-adam-w192-*``); it needs dattri, the ``peers`` extra.

The package, by role: :mod:`~rcdl.app.experiments.attribution.config` (settings, names,
anchors), :mod:`~rcdl.app.experiments.attribution.lds` (the LDS and its options),
:mod:`~rcdl.app.experiments.attribution.mislabel` (mislabel detection),
:mod:`~rcdl.app.experiments.attribution.peer_trak` (the TRAK peer) and
:mod:`~rcdl.app.experiments.attribution.report` (rows, tables, figures).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from rcdl.app.cifar import CifarData, cifar_summary
from rcdl.app.experiments.attribution import peer_trak
from rcdl.app.experiments.attribution.config import (
    CASCADE_VARIANTS,
    CEILING,
    CURVE,
    EVAL_IMAGES,
    FIRST_HALF_SEED,
    FLIP_SEED,
    FULL_SEED,
    HALVES_SEED,
    KRONFLUENCE_FOUND,
    LDS_ANCHORS,
    LDS_TARGETS,
    MEASUREMENTS,
    MISLABEL_TARGET,
    OPTIONS,
    RANKINGS,
    SECOND_SEED,
    TRAK_AUC,
    VARIANTS,
    VOTE_SHARPNESS,
    AttributionConfig,
    load_data,
)
from rcdl.app.experiments.attribution.lds import (
    _firsts,
    attribution_scores,
    cascade_scores,
    half_masks,
    half_sums,
    lds_cascade,
    lds_ceiling,
    lds_full,
    lds_halves,
    lds_halves_again,
    lds_score,
    margins,
    spearman,
    to_pixels,
)
from rcdl.app.experiments.attribution.mislabel import (
    auc,
    detection,
    flip_labels,
    found_in_top,
    leave_one_out_margins,
    leave_one_out_vote_margins,
    mislabel_one,
    self_influence,
)
from rcdl.app.experiments.attribution.report import (
    COLUMNS,
    draw_explanations,
    draw_results,
    rows,
    targets,
    write_report,
)
from rcdl.app.recipes import train_model
from rcdl.app.runner import Experiment, Session

__all__ = [
    "CASCADE_VARIANTS", "CEILING", "COLUMNS", "CURVE", "EVAL_IMAGES", "EXPERIMENT",
    "EXPERIMENT_SPEC", "FIRST_HALF_SEED", "FLIP_SEED", "FULL_SEED", "HALVES_SEED",
    "KRONFLUENCE_FOUND", "LDS_ANCHORS", "LDS_TARGETS", "MEASUREMENTS", "MISLABEL_TARGET",
    "OPTIONS", "RANKINGS", "SECOND_SEED", "TRAK_AUC", "VARIANTS", "VOTE_SHARPNESS",
    "AttributionConfig",
    "attribution_scores", "auc", "cascade_scores", "detection", "draw_explanations",
    "draw_results", "flip_labels", "found_in_top", "half_masks", "half_sums", "lds_cascade",
    "lds_ceiling", "lds_full", "lds_halves", "lds_halves_again", "leave_one_out_margins",
    "leave_one_out_vote_margins", "lds_score", "load_data", "margins", "mislabel_one",
    "rows", "self_influence", "spearman", "targets", "to_pixels", "train_model",
    "write_report",
]  # fmt: skip

EXPERIMENT = "attribution"


def _sub_runs(cfg: AttributionConfig, data: CifarData, session: Session) -> Iterator:
    options = session.options
    if options.get("trak"):  # say what to install before anything trains
        peer_trak.require_dattri()
    for name in cfg.models:
        if "lds" in cfg.measurements:
            yield f"{name}-lds-full", partial(lds_full, name, cfg, data, session)
            for first in _firsts(cfg):
                yield (f"{name}-lds-halves-{first}",
                       partial(lds_halves, name, first, cfg, data, session))
            if options.get("seed_ceiling"):
                for first in _firsts(cfg):
                    yield (f"{name}-lds-again-{first}",
                           partial(lds_halves_again, name, first, cfg, data, session))
            yield f"{name}-lds", partial(lds_score, name, cfg, session)
            if options.get("cascade"):
                yield f"{name}-lds-cascade", partial(lds_cascade, name, cfg, data, session)
            if options.get("seed_ceiling"):
                yield f"{name}-lds-ceiling", partial(lds_ceiling, name, cfg, session)
        if "mislabel" in cfg.measurements:
            yield f"{name}-mislabel", partial(mislabel_one, name, cfg, data, session)
    if options.get("trak"):
        yield from peer_trak.sub_runs(cfg, data, session)


def _start(cfg: AttributionConfig, data: CifarData) -> dict[str, Any]:
    return {**cifar_summary(cfg, data), "class_names": list(data.class_names)}


def _finish(cfg: AttributionConfig, summary: dict[str, Any]) -> None:
    summary["rows"] = rows(summary["runs"], summary["data"]["n_train"])


EXPERIMENT_SPEC = Experiment(
    name=EXPERIMENT, config=AttributionConfig,
    help="rcdl's native attribution: the linear datamodeling score, mislabel detection by "
    "self-influence, and test images beside the training images they rest on "
    "(docs/attribution.md)",
    description="Measures rcdl.explain's per-sample attribution on CIFAR-10 for each growing "
    "model: the linear datamodeling score against models retrained on random halves, and "
    "mislabel detection by self-influence against the training loss and random. Writes "
    "results.md, results.csv, explanations.png (test images beside the training images "
    "they rest on) and attribution.png. Options: --cascade adds the readout cascade's "
    "scores to the LDS, --seed-ceiling what any score can reach (each half retrained with a "
    "second seed), --trak the same-data peer, TRAK (dattri) on the ResNet-MLP. See "
    "docs/attribution.md.",
    sub_runs=_sub_runs, report=write_report, load_data=load_data, start=_start,
    finish=_finish, options=OPTIONS,
)  # fmt: skip
