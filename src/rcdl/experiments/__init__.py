"""Experiments: one module per experiment, each with one frozen config dataclass.

- :mod:`rcdl.experiments.demo` — teacher–student regression: a growing RBF network against
  MLPs trained by SGD and by Adam, one pass over the data (``rcdl demo``).
- :mod:`rcdl.experiments.cifar10` — the paper's one-epoch CIFAR-10 comparison, Fig. 2
  (``rcdl reproduce cifar10-1epoch``).
"""
