"""The attribution experiment's settings, names and published anchors (the protocols are in
:mod:`rcdl.app.experiments.attribution`'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from rcdl.app.cifar import load_subsets
from rcdl.app.config import ExperimentConfig, data_dir_setting, device_setting, setting
from rcdl.app.models import model_spec

__all__ = [
    "CASCADE_VARIANTS", "CEILING", "CURVE", "EVAL_IMAGES", "FIRST_HALF_SEED", "FLIP_SEED",
    "FULL_SEED", "HALVES_SEED", "KRONFLUENCE_FOUND", "LDS_ANCHORS", "LDS_TARGETS",
    "MEASUREMENTS", "MISLABEL_TARGET", "OPTIONS", "RANKINGS", "SECOND_SEED", "TRAK_AUC",
    "VARIANTS", "VOTE_SHARPNESS", "AttributionConfig", "load_data", "score_text",
]  # fmt: skip

MEASUREMENTS = {"lds": "the linear datamodeling score against models retrained on halves",
                "mislabel": "mislabel detection by self-influence"}  # fmt: skip
VARIANTS = {"all layers": "summed over every growing layer",
            "readout": "the readout's exact shares alone",
            "readout deletion": "minus the exact change of the logit when the sample's "
            "readout entries alone are deleted (the softmax's normaliser shrinks too)"}  # fmt: skip
# with the option cascade, for a readout that does not normalise (rcdl.memory.cascade)
CASCADE_VARIANTS = {"readout, one-level": "the readout's shares with the first-order change "
                    "of one later readout write (rcdl.readout_cascade, truncated)",
                    "readout, cascade": "the readout's shares with the first-order change of "
                    "every later readout write (rcdl.readout_cascade)"}  # fmt: skip
# with the option seed_ceiling: each half retrained a second time, seed SECOND_SEED + m
CEILING = {"seed ceiling": "a second retraining of each half (another seed) in place of a "
           "score: what no score of the half alone can exceed"}
RANKINGS = {"self-influence": "its own entries' contribution to its own label's logit",
            "leave-one-out margin": "minus its label's margin when the model answers it "
            "with its own entries deleted from every layer (exact, rcdl.memory.leave_one_out)",
            "leave-one-out label vote": "minus its label's margin in the readout's label "
            "vote (the labels of the samples that wrote the readout's entries, weighed by "
            "the readout's kernel at a quarter of its temperature), its own entries left out",
            "leave-one-out, both": "the mean of its ranks by the two leave-one-out rankings",
            "training loss": "the trained model's cross-entropy on it",
            "random": "a random ranking"}  # fmt: skip
# published anchors, other models and data: (what, LDS) from the dattri benchmark
LDS_ANCHORS = (("TRAK-10, MNIST MLP", 0.33), ("TRAK-50, MNIST MLP", 0.45),
               ("TRAK-50, CIFAR-2 ResNet-9", 0.37))  # fmt: skip
# Kronfluence: share of flipped labels found per share inspected (full CIFAR-10, ResNet-9);
# dattri: TRAK's ROC-AUC on CIFAR-10 with a ResNet-9
KRONFLUENCE_FOUND = {0.1: 0.80, 0.2: 0.97}
TRAK_AUC = 0.67
# what rcdl aims at (docs/attribution.md, "Targets"): the LDS of a model's best score, and
# the best ranking's ROC-AUC with the share of the flipped labels in its top 10 %
LDS_TARGETS = {"gws": 0.30, "rbf": 0.45}
MISLABEL_TARGET = (0.80, 0.60)
FULL_SEED, HALVES_SEED, FIRST_HALF_SEED, FLIP_SEED = 0, 1, 100, 2
SECOND_SEED = 1000  # the seed ceiling retrains half m a second time from seed 1000 + m
VOTE_SHARPNESS = 4.0  # the label vote's default (continual.baselines.LabelVote), not tuned here
EVAL_IMAGES = 16  # test images the trainer scores before and after a pass (not reported)
CURVE = tuple(i / 50 for i in range(1, 51))  # shares inspected, for the detection curve


@dataclass(frozen=True)
class AttributionConfig(ExperimentConfig):
    """Settings of the attribution measurements (module docstring). The defaults: 5 000
    training / 500 test images, 50 halves, gws and RBF; ``quick()``: 500 / 50 images and 8
    halves (run times in docs/attribution.md)."""

    QUICK = {"train_size": 500, "test_size": 50, "halves": 8}

    models: tuple[str, ...] = setting(("gws", "rbf"), "growing models of the one-epoch "
                                      "comparison", metavar="NAME")
    measurements: tuple[str, ...] = setting(tuple(MEASUREMENTS), "measurements",
                                            choices=MEASUREMENTS, default_text="both")
    train_size: int = setting(5000, "random subset of N training images", metavar="N")
    test_size: int = setting(500, "random subset of N test images (those the LDS explains)",
                             metavar="N")
    halves: int = setting(50, "models retrained on random halves of the training images "
                          "(LDS)", minimum=2, metavar="M")
    halves_per_sub_run: int = setting(10, "retrained models per sub-run (a resumed run "
                                      "keeps the finished sub-runs)", metavar="K")
    flip: float = setting(0.1, "share of the training labels flipped (mislabel detection), "
                          "below 1", positive=True)
    shown: int = setting(6, "test images in explanations.png", minimum=0, metavar="N")
    top: int = setting(5, "training images beside each test image in explanations.png",
                       metavar="K")
    batch_size: int = setting(16, "samples per training step B", metavar="B")
    explain_batch_size: int = setting(50, "images per rcdl.explain call", metavar="N")
    data_dir: str | None = data_dir_setting()
    data_seed: int = setting(0, "seed of the subsets", minimum=0)
    device: str = device_setting()

    def check(self) -> None:
        for name in self.models:
            if not model_spec(name).growing:
                raise ValueError(f"AttributionConfig: model {name!r} has no growing layers "
                                 "to explain; use gws, gauge, rbf, laplacian or a hybrid")
        flipped = int(self.flip * self.train_size)
        if "mislabel" in self.measurements and not 0 < flipped < self.train_size:
            raise ValueError(f"AttributionConfig: flip {self.flip:g} of {self.train_size} "
                             f"training images flips {flipped}; mislabel detection needs "
                             "some flipped and some clean")
        if self.shown > self.test_size:
            raise ValueError(f"AttributionConfig: shown ({self.shown}) must be at most "
                             f"test_size ({self.test_size})")


load_data = partial(load_subsets, "cifar10")  # the subsets of cfg (rcdl.app.cifar)

# the experiment's options (not settings: a run's config.json is the same with or without
# them); each adds sub-runs, so a resumed run may take them or leave them
OPTIONS = {
    "cascade": "also score each half by the readout cascade, one level and whole "
    "(rcdl.readout_cascade), for the models whose readout does not normalise (rbf; gws is "
    "noted as refused); the full model is trained again for it (docs/attribution.md)",
    "seed_ceiling": "also retrain every half a second time, from seed 1000 + m, and report "
    "the LDS of those margins against the first retraining's: what any score can reach",
    "trak": "also measure the same-data peer, TRAK from dattri on the ResNet-MLP "
    "(blocks of width 192, ensembles of 1 and 10), on the same halves and flipped labels; "
    "needs dattri (pip install 'rcdl[peers]')",
}


def score_text(name: str) -> str:
    """What an LDS row's score ``name`` is, for the report."""
    known = VARIANTS | CASCADE_VARIANTS | CEILING
    if name in known:
        return known[name]
    if name.startswith("TRAK-"):  # the peer's (rcdl.app.experiments.attribution.peer_trak)
        count = int(name[5:])
        return ("TRAK (dattri), the seed-0 MLP" if count == 1
                else f"TRAK (dattri), an ensemble of {count} MLPs")
    raise KeyError(f"score_text: unknown LDS score {name!r}")

