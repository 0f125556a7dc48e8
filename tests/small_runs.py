"""Small float64 runs and bit-for-bit comparisons shared by the checkpoint, forgetting and
replay tests (not a test module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rcdl import FunctionalSGD, Grower, GrowingRBFNet
from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.memory.provenance import entry_samples
from rcdl.nn.layers import growing_layers

# a teacher-student regression and the RBF net the checkpoint tests train on it
TEACHER_DATA = make_teacher_data(TeacherConfig(d_in=5, hidden=8, d_out=2, n_train=64,
                                               n_test=16, dtype="float64"))
TEACHER_KW = {"batch_size": 8, "eval_every": 2, "progress": False, "seed": 1}


@dataclass(frozen=True)
class TinyConfig:
    """The smallest experiment config a run folder takes (``run_experiment`` saves and reads
    it back)."""

    device: str = "cpu"

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TinyConfig:
        return cls(**saved)


def teacher_net() -> tuple[nn.Module, Grower]:
    """A one-block growing RBF net for :data:`TEACHER_DATA`, from ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    net = GrowingRBFNet(5, 2, 1, temperature=1.0, rule=FunctionalSGD(0.3)).double()
    return net, Grower(net)


def classification_data(n: int, d: int, held_out: int = 16) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_test, y_test)``: ``n + held_out`` float64 points in ``d``
    dimensions, labelled 0–2 by the signs of their first two coordinates."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n + held_out, d, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:n], y[:n], x[n:], y[n:]


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested state (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b, strict=True))
    return a == b


def assert_same_stores(a: nn.Module, b: nn.Module) -> None:
    """Every growing layer of ``a`` and ``b`` holds the same rows (keys, values, weights,
    write steps, ids) and names the same sample for each, bit for bit."""
    for (name, la), (_, lb) in zip(growing_layers(a), growing_layers(b), strict=True):
        for field in ("keys", "values", "weights", "written_at", "ids"):
            assert torch.equal(getattr(la.store, field), getattr(lb.store, field)), (name, field)
        assert torch.equal(entry_samples(la), entry_samples(lb)), name
