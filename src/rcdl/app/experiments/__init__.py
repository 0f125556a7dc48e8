"""Experiments: one module per experiment, each declaring its config and its
``EXPERIMENT_SPEC`` (:class:`rcdl.app.runner.Experiment`); docs/adding_an_experiment.md.

- :mod:`rcdl.app.experiments.demo` — teacher–student regression: a growing RBF network against
  MLPs trained by SGD and by Adam, one pass over the data (``rcdl demo``).
- :mod:`rcdl.app.experiments.cifar10` — the paper's one-epoch CIFAR-10 comparison, Fig. 2
  (``rcdl reproduce cifar10-1epoch``).
- :mod:`rcdl.app.experiments.tau_sweep` — the hybrid network over distance thresholds τ, Fig. 5
  (``rcdl reproduce hybrid-tau-sweep``).
- :mod:`rcdl.app.experiments.generalisation` — parametric vs growing softmax networks over
  several epochs (``rcdl reproduce generalisation``).
- :mod:`rcdl.app.experiments.memory_budget` — the growing ``gws`` model under a bounded memory:
  test accuracy against entries per layer for several eviction policies (docs/reference.md §8;
  ``rcdl reproduce memory-budget``).
- :mod:`rcdl.app.experiments.optimizers` — MLP optimizers (incl. Muon and FOOF) against the
  growing networks over several epochs (docs/reference.md §7, §8; ``rcdl reproduce optimizers``).
- :mod:`rcdl.app.experiments.deltanet_decay` — DeltaNet decay against weight decay and none
  (docs/reference.md §7, §8; ``rcdl reproduce deltanet-decay``).
- :mod:`rcdl.app.experiments.teacher_student` — growing vs size-matched parametric softmax
  students of a random teacher (docs/reference.md §8; ``rcdl reproduce teacher-student``).
- :mod:`rcdl.app.experiments.vit` — a small ViT with MLP against hybrid RCDL feed-forward
  blocks, one epoch (docs/reference.md §8; ``rcdl reproduce vit``).
- :mod:`rcdl.app.experiments.attention_bench` — the streaming attention's speed against the
  matrix products it is made of (``rcdl reproduce attention-bench``).
- :mod:`rcdl.app.experiments.attribution_exp` — rcdl's native attribution measured: the linear
  datamodeling score against retrained models, mislabel detection by self-influence, and
  test images beside the training images they rest on (``rcdl reproduce attribution``).
- :mod:`rcdl.app.experiments.unlearning` — forgetting training samples (``rcdl.forget``)
  against retraining without them, with a membership-inference score
  (``rcdl reproduce unlearning``).
- :mod:`rcdl.app.experiments.continual` — class-incremental Split CIFAR-10 without replay:
  growing models against fine-tuned, EWC and LwF MLPs and raw-pixel baselines, and whether
  an earlier task's entries still classify its images (``rcdl reproduce continual``).
"""

# The experiments, in the order `rcdl reproduce --help` lists them: command -> module. This is
# the package's index: adding an experiment is its module and one line here
# (docs/adding_an_experiment.md). The modules are imported only when a command needs them.
COMMANDS = {
    "cifar10-1epoch": "cifar10",
    "hybrid-tau-sweep": "tau_sweep",
    "generalisation": "generalisation",
    "memory-budget": "memory_budget",
    "optimizers": "optimizers",
    "deltanet-decay": "deltanet_decay",
    "teacher-student": "teacher_student",
    "vit": "vit",
    "attention-bench": "attention_bench",
    "attribution": "attribution_exp",
    "unlearning": "unlearning",
    "continual": "continual",
}
