"""The one-epoch CIFAR-10 comparison's settings and data (docs/reference.md §6): what every
model of ``rcdl reproduce cifar10-1epoch`` shares (the experiment is
:mod:`rcdl.app.experiments.cifar10`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from rcdl.app.cifar import load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import PAPER_MODELS, model_spec
from rcdl.train.loop import Metric, accuracy

__all__ = ["DTYPES", "EXPERIMENT", "METRICS", "STORE_DTYPES", "Cifar10Config", "load_data"]

EXPERIMENT = "cifar10-1epoch"
METRICS: dict[str, Metric] = {  # the first: the progress bar's
    "test_acc": accuracy, "test_loss": F.cross_entropy}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


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


# --------------------------------------------------------------------------- the data


load_data = partial(load_subsets, "cifar10", whole_in_order=True)  # (see load_subsets)
