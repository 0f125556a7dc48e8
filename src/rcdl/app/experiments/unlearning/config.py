"""The unlearning experiment's settings: the forgetting comparison's, and the studies' on top.

:class:`ForgettingConfig` holds the settings of the forgetting comparison (the default
study, ``run.py``); :class:`UnlearningConfig` adds ``studies``, what a run measures, and the
few settings of its own each other study has. A run that measures the default study with
every added setting at its default saves a :class:`ForgettingConfig` as its ``config.json``
(:func:`saved_form`), so its run folder is the one it was before the studies existed, and
folders saved either way resume and combine alike (:func:`full`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from rcdl.app.cifar import load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import model_spec
from rcdl.app.recipes import check_unlearning_settings

__all__ = ["EXPERIMENT", "SCENARIOS", "STUDIES", "ForgettingConfig", "SavedConfig",
           "UnlearningConfig", "full", "load_data", "saved_form", "study_of",
           "study_runs"]  # fmt: skip

EXPERIMENT = "unlearning"  # also the run folders' `experiment` (the package's declaration)
SCENARIOS = {"random": "a random share of the training images",
             "class": "every training image of one class"}
STUDIES = {
    "forgetting": "forget, repair, exact, fine-tune against retraining: accuracies and the "
                  "attack's score (run.py)",
    "exact-cost": "exact forgetting's seconds against retraining's, over the earliest "
                  "forgotten sample's position, with the bit-for-bit check (exact_cost.py)",
    "forget-command": "`rcdl forget --mode exact` on a kept one-epoch run, in a new process, "
                      "against retraining in this one (forget_command.py)",
    "log-size": "a saved replay log's size on disk, and one exact forget from it "
                "(log_size.py)",
    "repair-budget": "the gap between fast forgetting and retraining against the share of "
                     "the readout's steps re-written (repair_budget.py)",
}  # fmt: skip


@dataclass(frozen=True)
class ForgettingConfig(ExperimentConfig):
    """Settings of the forgetting comparison (the package docstring). Most of a default
    run's time is the ResNet-MLP's three trainings (run times in results/attribution/LOG.md,
    "Measured: forgetting against retraining")."""

    QUICK = {"models": ("gws", "rbf"), "train_size": 1000, "test_size": 500, "seeds": (0,),
             "retain_eval_size": 500}

    models: tuple[str, ...] = setting(
        ("gws", "rbf", "mlp-adam"), "models: growing ones are forgotten by rcdl.forget, "
        "parametric ones fine-tuned on the retained images", metavar="NAME")
    scenarios: tuple[str, ...] = setting(tuple(SCENARIOS), "forget sets", choices=SCENARIOS)
    forget_fraction: float = setting(0.1, "share of the training images the random "
                                     "scenario forgets", positive=True)
    forget_class: int = setting(0, "the class the class scenario forgets (0: airplane)",
                                minimum=0)
    finetune_fraction: float = setting(0.2, "share of the retained images a parametric "
                                       "model is fine-tuned on (one pass)", positive=True)
    train_size: int | None = setting(5000, "random subset of N training images",
                                     metavar="N")
    test_size: int | None = setting(5000, "random subset of N test images", metavar="N")
    retain_eval_size: int = setting(5000, "retained images the accuracy on them is "
                                    "measured on (a random subset)", metavar="N")
    seeds: tuple[int, ...] = setting((0, 1, 2), "seeds (initialisation, order, random "
                                     "forget set)", minimum=0, metavar="K")
    batch_size: int = setting(16, "samples per step B", metavar="B")
    replay_every: int = setting(1, "exact forgetting: a snapshot of a growing model every K "
                                "training steps (replays up to K - 1 extra steps)", metavar="K")
    eval_batch_size: int = setting(500, "images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        check_unlearning_settings(type(self).__name__, self.models, self.forget_fraction,
                                  self.finetune_fraction)
        if self.forget_class >= 10:
            raise ValueError(f"{type(self).__name__}: forget_class must be a CIFAR-10 class, "
                             f"0-9, got {self.forget_class}")


@dataclass(frozen=True)
class UnlearningConfig(ForgettingConfig):
    """Settings of the unlearning experiment: the forgetting comparison's
    (:class:`ForgettingConfig`), which studies a run measures, and the studies' own."""

    studies: tuple[str, ...] = setting(
        ("forgetting",), "what the run measures: forgetting (forget, repair, exact and "
        "fine-tune against retraining), exact-cost (exact forgetting's cost against "
        "retraining's), forget-command (rcdl forget --mode exact in a new process against "
        "retraining), log-size (a saved replay log's bytes on disk), repair-budget (the "
        "repair's gap to retraining against its budget); docs/unlearning.md",
        choices=STUDIES, metavar="STUDY")
    exact_positions: int = setting(5, "exact-cost: single images forgotten at this many "
                                   "evenly spaced positions of the stream", metavar="P")
    log_size_every: tuple[int, ...] = setting(
        (1,), "log-size: a snapshot every K steps, one K for all models or one per model",
        unique=False, metavar="K")
    repair_fractions: tuple[float, ...] = setting(
        (0.0, 0.25, 0.5, 0.75, 0.9, 1.0), "repair-budget: shares f of the readout's steps "
        "from the earliest forgotten image's re-written (0: rcdl.forget alone, 1: the whole "
        "fast mode)", metavar="F")

    def check(self) -> None:
        super().check()
        if len(self.log_size_every) not in (1, len(self.models)):
            raise ValueError(f"UnlearningConfig: log_size_every takes one interval or one per "
                             f"model ({len(self.models)}), got {len(self.log_size_every)}")
        others = [s for s in self.studies if s != "forgetting"]
        if others and not any(model_spec(name).growing for name in self.models):
            raise ValueError(f"UnlearningConfig: the studies {others} measure growing models "
                             f"(gws, rbf, hybrid...), and models {list(self.models)} has none")
        if any(f > 1 for f in self.repair_fractions):
            raise ValueError(f"UnlearningConfig: repair_fractions are shares of the steps, "
                             f"0-1, got {list(self.repair_fractions)}")


_BASE = {f.name for f in dataclasses.fields(ForgettingConfig)}
# the settings UnlearningConfig adds to ForgettingConfig
_ADDED = tuple(f for f in dataclasses.fields(UnlearningConfig) if f.name not in _BASE)


def saved_form(cfg: UnlearningConfig) -> ForgettingConfig:
    """What a run with ``cfg`` saves as its ``config.json`` and runs with: ``cfg`` itself,
    or, where every setting :class:`UnlearningConfig` adds is at its default (the
    forgetting comparison alone), the :class:`ForgettingConfig` of its other settings."""
    if any(getattr(cfg, f.name) != f.default for f in _ADDED):
        return cfg
    return ForgettingConfig(**{name: getattr(cfg, name) for name in sorted(_BASE)})


class SavedConfig:
    """How a run folder's ``config.json`` reads back (:func:`rcdl.app.rundir.read_config`,
    for ``--resume`` and ``--combine``): a :class:`ForgettingConfig` where it holds exactly
    that class's settings (:func:`saved_form`), else an :class:`UnlearningConfig`, which
    must have every setting."""

    @staticmethod
    def from_dict(saved: dict[str, Any]) -> ForgettingConfig:
        cls = ForgettingConfig if set(saved) <= _BASE else UnlearningConfig
        missing = sorted({f.name for f in dataclasses.fields(cls)} - set(saved))
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)} of {cls.__name__}; a resume "
                             "continues a run with every setting it was started with (is "
                             "this the folder of another experiment?)")
        return cls.from_dict(saved)


def full(cfg: ForgettingConfig) -> UnlearningConfig:
    """``cfg`` as an :class:`UnlearningConfig` (a saved :class:`ForgettingConfig` measures
    the forgetting comparison alone)."""
    if isinstance(cfg, UnlearningConfig):
        return cfg
    return UnlearningConfig(**dataclasses.asdict(cfg))


def study_runs(study: str, cfg: UnlearningConfig, models: Iterable[str] | None = None
               ) -> Iterator[tuple[str, str, int]]:
    """A study's sub-runs, seeds outer: ``(<study>-<model>-seed<k>, model, seed)`` for each of
    ``models`` (default: the config's growing ones) in the config's order."""
    wanted = set(models) if models is not None else {
        name for name in cfg.models if model_spec(name).growing}
    for seed in cfg.seeds:
        for name in cfg.models:
            if name in wanted:
                yield f"{study}-{name}-seed{seed}", name, seed


def study_of(result: dict[str, Any]) -> str:
    """The study a finished sub-run belongs to: its ``study``; the forgetting comparison's
    results carry none (they are as they were before the studies existed)."""
    return result.get("study", "forgetting")


load_data = partial(load_subsets, "cifar10")
