"""The one-epoch CIFAR-10 comparison's settings and data (docs/reference.md §6): what every
model of ``rcdl reproduce cifar10-1epoch`` shares (the experiment is
:mod:`rcdl.app.experiments.cifar10`), and the command's diagnostic settings
(:class:`DiagnosticConfig`: the hybrid's bfloat16 variants, checked here, made by
:mod:`~rcdl.app.experiments.cifar10.bf16_effects`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from rcdl.app.cifar import load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import PAPER_MODELS, hybrid_tau, model_spec
from rcdl.train.loop import Metric, accuracy

__all__ = ["DTYPES", "EXPERIMENT", "HALF_STORE", "METRICS", "STORE_DTYPES", "VARIANTS",
           "Cifar10Config", "DiagnosticConfig", "check_variant", "load_data", "perturbation",
           "saved_config"]

EXPERIMENT = "cifar10-1epoch"
METRICS: dict[str, Metric] = {  # the first: the progress bar's
    "test_acc": accuracy, "test_loss": F.cross_entropy}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# the hybrid's bfloat16 diagnostics (--bf16-effect; what each does: cifar10.bf16_effects)
VARIANTS = ("rounded-at-eval", "bf16-gradients", "compensated", "sr-keys", "sr-values",
            "sr-entries", "sr-entries-bf16-gradients", "sr-entries-hash", "bfloat16-torch-noise",
            "nearest-forward", "nearest-forward-keys", "nearest-forward-values",
            "nearest-forward-readout", "nearest-forward-blocks", "jitter-forward",
            "jitter-forward-fine", "float32-chunks-1000", "float32-perturbed-once",
            "rounded-steps-exact-gate", "rounded-gate-only")
# the variants that act on a bfloat16 store; every other one acts on a float32 store
HALF_STORE = ("compensated", "bfloat16-torch-noise")
_PERTURBED = re.compile(r"float32-perturbed-once(?:-step([0-9]+))?(?:-seed([0-9]+))?")


# --------------------------------------------------------------------------- the variants


def perturbation(variant: str) -> tuple[int, int] | None:
    """``(Adam step, seed)`` of a ``float32-perturbed-once[-stepN][-seedK]`` variant (step 1
    and seed 0 unless named); ``None`` for any other variant."""
    match = _PERTURBED.fullmatch(variant)
    return None if match is None else (int(match.group(1) or 1), int(match.group(2) or 0))


def check_variant(variant: str, store_dtype: str | None) -> None:
    """Refuse an unknown ``variant`` and one that does not act on ``store_dtype`` (the
    store's dtype: ``None`` is float32).

    Raises:
        ValueError: naming the variants, or the store dtype the variant needs.
    """
    if variant not in VARIANTS and perturbation(variant) is None:
        raise ValueError(f"unknown bf16_effect {variant!r}; known: {', '.join(VARIANTS)} "
                         "(and float32-perturbed-once-stepN-seedK)")
    half = variant in HALF_STORE
    if half and store_dtype != "bfloat16":
        raise ValueError(f"bf16_effect {variant!r} acts on a bfloat16 store: give "
                         "--store-dtype bfloat16")
    if not half and store_dtype is not None:
        raise ValueError(f"bf16_effect {variant!r} acts on a float32 store: give no "
                         f"--store-dtype (got {store_dtype})")


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class Cifar10Config(ExperimentConfig):
    """Settings of the one-epoch comparison; the defaults are the paper's full protocol.

    ``models`` are names :func:`model_spec` knows. The subsets (``train_size``,
    ``test_size``) depend on ``data_seed`` only, so every model and seed sees the same
    images; a seed fixes a model's initialisation and the order of the training images.
    Each parametric baseline updates 75–770 M parameters per step, so on a CPU they take
    most of a ``--quick`` run's time (docs/cifar10.md).
    """

    QUICK = {"models": ("gws", "gauge", "rbf", "mlp-adam"), "train_size": 2000,
             "test_size": 1000, "eval_every": 50}  # fmt: skip

    models: tuple[str, ...] = setting(PAPER_MODELS, "models to train, in order",
                                      metavar="NAME", default_text="every model of the paper")
    train_size: int | None = setting(None, "random subset of N training images", metavar="N",
                                     default_text="all 50000")
    test_size: int | None = setting(None, "random subset of N test images", metavar="N",
                                    default_text="all 10000")
    seeds: tuple[int, ...] = setting((0,), "one run per seed, reported as mean ± sd",
                                     minimum=0, metavar="K")
    batch_size: int = setting(16, "samples per step B (docs/reference.md §6)", metavar="B")
    eval_every: int = setting(250, "steps between test evaluations", metavar="STEPS")
    eval_batch_size: int = setting(500, "test images per prediction batch", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()
    dtype: str = setting("float32", "the models' dtype", choices=DTYPES)
    store_dtype: str | None = setting(
        None, "keep the growing layers' keys and values in half precision: half the memory, "
        "and faster on CPUs with avx512_bf16 or AMX (measured speeds: docs/precision.md)",
        choices=STORE_DTYPES, default_text="the model's float32")
    incremental_eval: bool = setting(
        True, "the first layer folds only the entries written since the last evaluation "
        "into cached partials (exact up to rounding; docs/training.md)",
        flag_help="evaluate every layer over its whole store each time")
    checkpoint: bool = setting(
        True, "save each model's state under checkpoints/ while it trains",
        flag_help="write no checkpoints (an interrupted model then restarts from scratch); "
        "saves the disk writes of large stores and optimizer states")
    checkpoint_every: int | None = setting(None, "steps between checkpoints", metavar="STEPS",
                                           default_text="--eval-every")

    def check(self) -> None:
        for name in self.models:
            model_spec(name)  # an unknown name: an error listing the known ones

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_store_dtype(self) -> torch.dtype | None:
        return None if self.store_dtype is None else STORE_DTYPES[self.store_dtype]

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Any:
        """The config saved as ``config.json``: a :class:`DiagnosticConfig` where it holds
        a diagnostic setting (a run with ``--bf16-effect`` or ``--entry-grads``), else this
        class."""
        if cls is Cifar10Config and any(name in saved for name in _DIAGNOSTICS):
            return DiagnosticConfig.from_dict(saved)
        return super().from_dict(saved)


@dataclass(frozen=True)
class DiagnosticConfig(Cifar10Config):
    """The command's settings: :class:`Cifar10Config` and the hybrid's bfloat16 diagnostics
    (:mod:`~rcdl.app.experiments.cifar10.bf16_effects`; results/speed/LOG.md, "The hybrid's
    accuracy with a bfloat16 store"). A run saves this class only when a diagnostic is
    asked for (:func:`saved_config`), so the ``config.json`` of a run without one is a
    :class:`Cifar10Config`'s, as before these settings existed."""

    bf16_effect: str | None = setting(
        None, "train the hybrid with one bfloat16 effect switched on, a diagnostic change "
        "made for this run only (docs/cifar10.md, \"The hybrid's bfloat16 diagnostics\"): "
        + ", ".join(VARIANTS) + ", float32-perturbed-once-stepN-seedK", metavar="VARIANT",
        default_text="none")
    entry_grads: bool = setting(
        False, "write every hybrid layer's entry gradients' size at every Adam step to "
        "entry_grads/<model>-seed<k>.jsonl (two such files are compared by python -m "
        "rcdl.app.experiments.cifar10.bf16_effects A B)")

    def check(self) -> None:
        super().check()
        if self.bf16_effect is None:
            return
        check_variant(self.bf16_effect, self.store_dtype)
        if self.checkpoint:
            raise ValueError("DiagnosticConfig: a bf16_effect's own state (master copies, "
                             "compensation terms, random generators) is not checkpointed, so "
                             "a resumed model would not train as an uninterrupted one: give "
                             "--no-checkpoint")
        others = [name for name in self.models if not hybrid_tau(name)[0]]
        if others:
            raise ValueError(f"DiagnosticConfig: bf16_effect changes how the hybrid trains; "
                             f"train only hybrids (hybrid, hybrid-tau<τ>, hybrid-always) with "
                             f"it, not {', '.join(others)}")


_DIAGNOSTICS = tuple(f.name for f in fields(DiagnosticConfig)
                     if f.name not in {g.name for g in fields(Cifar10Config)})


def saved_config(cfg: Cifar10Config) -> Cifar10Config:
    """What a run saves and trains with: ``cfg`` itself when it asks for a diagnostic, else
    its :class:`Cifar10Config` (a ``config.json`` without the diagnostic settings)."""
    if any(getattr(cfg, name, False) not in (None, False) for name in _DIAGNOSTICS):
        return cfg
    return Cifar10Config(**{f.name: getattr(cfg, f.name) for f in fields(Cifar10Config)})


# --------------------------------------------------------------------------- the data


load_data = partial(load_subsets, "cifar10", whole_in_order=True)  # (see load_subsets)
