"""What the class-incremental experiment runs (:mod:`rcdl.app.experiments.continual`): the
tasks of a class order, the names of its models (:class:`ModelName`) and its settings
(:class:`ContinualConfig`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import torch

from rcdl.app.cifar import load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import model_spec

__all__ = ["CLASSES", "LABELS", "PIXELS", "READOUTS", "REGULARISED", "VOTE", "ContinualConfig",
           "ModelName", "ReadoutsConfig", "class_order", "load_data", "reads_out",
           "saved_config", "task_split"]

CLASSES = 10
REGULARISED = {"mlp-ewc": "EWC", "mlp-lwf": "LwF"}
PIXELS = {"knn-l2": "kNN, L2", "knn-cosine": "kNN, cosine", "ncm": "nearest class mean",
          "slda": "streaming LDA", "pec": "PEC"}
# the labels trick as a switch of any network: a name's suffix, and the scope it restricts to
LABELS = {"+labels": "task", "+batch-labels": "batch"}
# a growing network read out by its readout entries' labels (baselines.LabelVote)
VOTE = "+vote"
# other readouts of a trained RBF readout's entries (``--readouts``; analysis.readouts)
READOUTS = {"as-trained": "as trained: the model's own 10-way output",
            "task-inference": "task inference: the task whose readout entries carry the most "
            "kernel mass at the query, then the argmax over its classes",
            "task-balanced": "task-balanced: each task's logits divided by its entries' kernel "
            "mass at the query",
            "sharper-kernel": "sharper kernel: the readout's temperature halved, values as "
            "learnt"}
_RANDOM = re.compile(r"random-([0-9]+)")


# --------------------------------------------------------------------------- tasks


def class_order(order: str) -> tuple[int, ...]:
    """The ten classes in the order the tasks take them: ``"0"`` the natural order,
    ``"random-K"`` a permutation drawn from ``K`` (``torch.randperm`` with seed ``K``), or
    ten distinct digits (``"1032547698"``).

    Raises:
        ValueError: for any other string.
    """
    if order == "0":
        return tuple(range(CLASSES))
    match = _RANDOM.fullmatch(order)
    if match:
        gen = torch.Generator().manual_seed(int(match.group(1)))
        return tuple(torch.randperm(CLASSES, generator=gen).tolist())
    if len(order) == CLASSES and order.isdigit() and len(set(order)) == CLASSES:
        return tuple(int(c) for c in order)
    raise ValueError(f"unknown class order {order!r}: expected '0' (natural), 'random-K' "
                     "(a permutation drawn from K) or the ten digits 0-9 in some order")


def task_split(order: str, classes_per_task: int = 2) -> tuple[tuple[int, ...], ...]:
    """The tasks of ``order``: its classes cut into consecutive groups of
    ``classes_per_task`` (``"0"``, 2: ``(0, 1), (2, 3), …, (8, 9)``)."""
    if classes_per_task < 1 or CLASSES % classes_per_task:
        raise ValueError(f"classes_per_task must divide {CLASSES}, got {classes_per_task}")
    classes = class_order(order)
    return tuple(classes[i : i + classes_per_task]
                 for i in range(0, CLASSES, classes_per_task))


# --------------------------------------------------------------------------- model names


@dataclass(frozen=True)
class ModelName:
    """A model of the experiment, parsed from its name. The grammar::

        NAME    := PIXELS | REGULARISED | NETWORK [LABELS] [+vote]
        PIXELS  := knn-l2 | knn-cosine | ncm | slda | pec       (raw-pixel classifiers)
        REGULARISED := mlp-ewc | mlp-lwf       (the ``regularised_base`` network, EWC / LwF)
        NETWORK := a network of the zoo trained by its loss (:func:`rcdl.app.models.model_spec`:
                   gws, rbf, hybrid, mlp-adam, psoftmax-<N>, ...; not its classical ones)
        LABELS  := +labels (the task's classes) | +batch-labels (the batch's)

    ``+vote`` reads a growing network out by its readout entries' labels, and comes last
    (``rbf+labels+vote``). :meth:`parse` checks a name, ``str`` writes it back unchanged.

    Attributes:
        network: the network of the zoo trained, or the raw-pixel or regularised name
            itself (``"knn-l2"``, ``"mlp-ewc"``).
        labels: the labels trick's scope, ``"task"`` or ``"batch"``; ``None`` without it.
        vote: whether the model answers by the label vote.
    """

    network: str
    labels: str | None = None
    vote: bool = False

    @classmethod
    def parse(cls, name: str) -> ModelName:
        """``"rbf+labels+vote"`` is ``ModelName("rbf", "task", vote=True)``.

        Raises:
            ValueError: an unknown network, a label vote of a model without a growing
                readout or not written last, the labels trick on a raw-pixel or regularised
                model, or a classical model of the zoo that is not one of :data:`PIXELS`.
        """
        if name in PIXELS or name in REGULARISED:
            return cls(name)
        if name.endswith(VOTE):
            trained = cls.parse(name.removesuffix(VOTE))
            if trained.kind != "growing":
                raise ValueError(f"{name!r}: the label vote reads a growing readout's entries "
                                 f"(rbf+vote, rbf+labels+vote, ...), not {trained}'s")
            if trained.vote:
                raise ValueError(f"{name!r}: write the label vote once (NAME+labels+vote)")
            return replace(trained, vote=True)
        network, scope = name, None
        for suffix, label_scope in LABELS.items():
            if name.endswith(suffix):
                network, scope = name.removesuffix(suffix), label_scope
                break
        if VOTE in network:
            raise ValueError(f"{name!r}: write the label vote last (NAME+labels+vote)")
        if scope is not None and (network in PIXELS or network in REGULARISED):
            raise ValueError(f"{name!r}: the labels trick is a switch of a network trained by "
                             f"its loss (gws+labels, rbf+labels, mlp-adam+labels, ...), not of "
                             f"{network}")
        if model_spec(network).classical:
            raise ValueError(f"{name!r} is not a baseline of this experiment; the raw-pixel "
                             f"ones are {', '.join(PIXELS)}")
        return cls(network, scope)

    def __str__(self) -> str:
        suffixes = {scope: suffix for suffix, scope in LABELS.items()}
        return (self.network + ("" if self.labels is None else suffixes[self.labels])
                + (VOTE if self.vote else ""))

    @property
    def kind(self) -> str:
        """``"growing"``, ``"parametric"`` (trained by an optimizer; EWC and LwF too) or
        ``"pixels"`` (an order-independent classifier on raw pixels)."""
        if self.network in PIXELS:
            return "pixels"
        if self.network in REGULARISED:
            return "parametric"
        return "growing" if model_spec(self.network).growing else "parametric"

    def iid(self, regularised_base: str) -> str:
        """The model whose i.i.d. one-pass run is this one's reference: EWC and LwF train
        ``regularised_base``'s network with its optimizer (one task: plain training), and
        the labels trick over the task's classes is plain training when one task holds
        every class (``rbf+labels``: ``rbf``'s run). The batch-scoped trick changes i.i.d.
        training too, so it is its own reference. A label vote reads the i.i.d.-trained
        network the same way (``rbf+labels+vote``: ``rbf+vote``'s run)."""
        if self.network in REGULARISED:
            return regularised_base
        return str(replace(self, labels=None if self.labels == "task" else self.labels))

    def label(self, regularised_base: str, vote_sharpness: float) -> str:
        """The model in words, for the report's tables."""
        if self.network in PIXELS:
            return f"{PIXELS[self.network]} (raw pixels)"
        if self.network in REGULARISED:
            return f"{model_spec(regularised_base).label}, {REGULARISED[self.network]}"
        label = model_spec(self.network).label
        if self.labels is not None:
            label += f", labels trick ({self.labels}'s classes)"
        if self.vote:
            label += f", label vote (s = {vote_sharpness:g})"
        return label


# --------------------------------------------------------------------------- the config


def _size(text: str) -> int | None:
    """A subset size on the command line: a number, or ``all`` (``None``)."""
    return None if text == "all" else int(text)


@dataclass(frozen=True)
class ContinualConfig(ExperimentConfig):
    """Settings of the class-incremental experiment (:mod:`rcdl.app.experiments.continual`;
    run times in docs/continual.md, "Time")."""

    QUICK = {"train_size": 300, "test_size": 300, "seeds": (0,), "orders": ("0",),
             "models": ("gws", "gauge", "rbf", "hybrid", "mlp-adam", "mlp-ewc", "mlp-lwf",
                        "knn-l2", "knn-cosine", "ncm", "slda")}

    models: tuple[str, ...] = setting(
        ("gws", "gauge", "rbf", "rbf+labels", "rbf+vote", "mlp-sgd", "mlp-adam", "mlp-ewc",
         "mlp-lwf", "pec", "knn-l2", "knn-cosine", "ncm", "slda"),
        "models: growing networks, networks of the zoo fine-tuned, either with the labels "
        "trick (NAME+labels: the task's classes, NAME+batch-labels: the batch's), a "
        "growing network read out by its entries' labels (NAME+vote, NAME+labels+vote), "
        "mlp-ewc / mlp-lwf, pec, and the raw-pixel knn-l2, knn-cosine, ncm, slda",
        metavar="NAME")
    orders: tuple[str, ...] = setting(
        ("0", "random-1", "random-2"), "class orders: 0 (natural), random-K (drawn from K) "
        "or ten digits", metavar="ORDER")
    classes_per_task: int = setting(2, "classes per task (divides 10)", metavar="C")
    seeds: tuple[int, ...] = setting((0, 1, 2), "seeds (initialisation, order of the "
                                     "images within each task)", minimum=0, metavar="K")
    train_size: int | None = setting(2000, "random subset of N training images (all: the "
                                     "whole split)", metavar="N", parse=_size)
    test_size: int | None = setting(1000, "random subset of N test images (all: the whole "
                                    "split)", metavar="N", parse=_size)
    batch_size: int = setting(16, "samples per step B", metavar="B")
    eval_batch_size: int = setting(500, "images per prediction batch", metavar="N")
    regularised_base: str = setting("mlp-adam", "the network and optimizer EWC and LwF train "
                                    "(a ResNet-MLP of the zoo)", metavar="NAME")
    ewc_lambda: float = setting(1e8, "EWC's penalty strength λ (1e8: the best final "
                                "accuracy of 1e2-1e9 at the default size; docs/continual.md)",
                                positive=True, metavar="λ")
    lwf_alpha: float = setting(100.0, "LwF's distillation weight λ_o (100: the best final "
                               "accuracy of 1-1000 at the default size; docs/continual.md)",
                               positive=True, metavar="λ_o")
    lwf_temperature: float = setting(2.0, "LwF's temperature T", positive=True, metavar="T")
    vote_sharpness: float = setting(4.0, "NAME+vote: the readout's temperature is divided "
                                    "by s for the label vote (4: chosen on seed 0, orders 0 "
                                    "and random-1; docs/continual.md)", positive=True,
                                    metavar="s")
    slda_shrinkage: float = setting(0.5, "streaming LDA's shrinkage ε towards the identity "
                                    "(0.5: chosen on held-out training images at the "
                                    "default size)", positive=True, metavar="ε")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        for order in self.orders:
            class_order(order)  # raises for an unknown one
        if CLASSES % self.classes_per_task or self.classes_per_task == CLASSES:
            raise ValueError(f"ContinualConfig: classes_per_task must divide {CLASSES} into "
                             f"two tasks or more, got {self.classes_per_task}")
        for name in self.models:
            ModelName.parse(name)  # raises for an unknown one
        if ModelName.parse(self.regularised_base).kind != "parametric" or (
                self.regularised_base in REGULARISED):
            raise ValueError(f"ContinualConfig: regularised_base must be a network trained "
                             f"by an optimizer (mlp-adam, mlp-sgd, ...), got "
                             f"{self.regularised_base!r}")
        if self.slda_shrinkage > 1:
            raise ValueError(f"ContinualConfig: slda_shrinkage must be at most 1, got "
                             f"{self.slda_shrinkage}")

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Any:
        """The config saved as ``config.json``: a :class:`ReadoutsConfig` where it names
        ``readouts`` (a run with ``--readouts``), else this class."""
        if cls is ContinualConfig and "readouts" in saved:
            return ReadoutsConfig.from_dict(saved)
        return super().from_dict(saved)


def reads_out(name: str) -> bool:
    """Whether ``--readouts`` reads model ``name``'s readout: a growing RBF network
    answering by its own output (``rbf``, ``rbf+labels``; not a label vote)."""
    parsed = ModelName.parse(name)
    return parsed.network == "rbf" and not parsed.vote


@dataclass(frozen=True)
class ReadoutsConfig(ContinualConfig):
    """The command's settings: :class:`ContinualConfig` and ``readouts``. A run saves this
    class only when ``readouts`` is given (:func:`saved_config`), so the ``config.json`` of
    a run without it is a :class:`ContinualConfig`'s, as before the setting existed."""

    readouts: tuple[str, ...] | None = setting(
        None, "after the last task, read the test images out of each rbf model's trained "
        "readout entries in other ways, nothing trained again (results/continual/LOG.md, "
        "\"What did not help\"): " + "; ".join(READOUTS.values()), choices=READOUTS,
        metavar="READOUT", default_text="none")

    def check(self) -> None:
        super().check()
        if self.readouts is not None and not any(reads_out(m) for m in self.models):
            raise ValueError(f"ContinualConfig: readouts are read from a growing RBF "
                             f"readout (rbf, rbf+labels, rbf+batch-labels), and no model of "
                             f"{list(self.models)} has one")


def saved_config(cfg: ContinualConfig) -> ContinualConfig:
    """What a run saves and trains with: ``cfg`` itself when it asks for readouts, else its
    :class:`ContinualConfig` (a ``config.json`` without ``readouts``)."""
    if getattr(cfg, "readouts", None) is not None:
        return cfg
    return ContinualConfig(**{f.name: getattr(cfg, f.name) for f in fields(ContinualConfig)})


load_data = partial(load_subsets, "cifar10")
