"""What a growing layer's training-mode forward passes leave for its learning rule: one
:class:`Record` per call, kept by the layer's :class:`Recorder` (docs/architecture.md).

A record holds the query ``q``, the output ``s`` computed from the pre-step store and,
once backward has reached it (through a hook on ``s``), the gradient ``∂(mean loss)/∂s``.
The recorder decides which records a step writes, so that the habits of an ordinary
PyTorch loop do not break it:

- a record is *ready* once backward has reached it; only ready records are written. A
  forward pass that never gets a backward (a test loss computed in training mode without
  ``torch.no_grad()``) writes nothing, and its record lives only as long as its autograd
  graph: the recorder keeps it through a weak reference.
- a training-mode forward that finds ready records of a backward that was never stepped
  (an exception between ``backward()`` and ``step()``, or a hybrid layer trained by Adam
  alone) discards them: each step writes the batch of its own forward and backward.
- :meth:`Recorder.discard` (``Grower.zero_grad()``) forgets every record; records made
  before it are never written, even if their backward comes later (each record carries
  the recorder's *generation* at its forward, and every discard starts a new one).
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Record", "Recorder", "UnsteppedBatchWarning"]


class UnsteppedBatchWarning(UserWarning):
    """A training forward pass began while an earlier batch's backward had run without a
    ``step()``: that batch is dropped (growing layers do not accumulate gradients)."""


# the packages whose frames a warning skips, to point at the user's line instead
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,  # rcdl
                  *(os.path.dirname(f) + os.sep for f in [torch.__file__] if f is not None))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first frame
    outside rcdl and torch: the user's line, through however many of their frames (a
    compiled model's included) the call went."""
    frame, level = sys._getframe(1), 1  # the caller: what stacklevel=1 names
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


@dataclass(eq=False)
class Record:
    """One training-mode call of a layer: what its rule needs after ``backward()``."""

    q: Tensor  # (B, d_in) the query, detached
    s: Tensor  # (B, d_out) the output from the pre-step store, detached
    n_samples: int  # samples the batch-mean loss averages over (leading dim of the input)
    generation: int  # the recorder's generation at the forward (see Recorder.discard)
    grad: Tensor | None = None  # (B, d_out) ∂(mean loss)/∂s, set by the hook
    # (m, den) (B,) each of the pre-step store, as the forward's attention folded them
    # (normalised kernels): log Σ_j w_j e^{z_j} = m + log den
    normaliser: tuple[Tensor, Tensor] | None = None
    samples: Tensor | None = None  # (B,) the training sample of each row (rcdl.memory.provenance)
    ready: list[Record] = field(default_factory=list, repr=False)  # the recorder's ready list

    def set_grad(self, grad: Tensor) -> None:
        """The backward hook on ``s``: a second backward through the same output adds."""
        if self.grad is None:
            self.grad = grad.detach()
            self.ready.append(self)  # from now on the recorder holds it, not just the graph
        else:
            self.grad = self.grad + grad.detach()

    @property
    def grad_mean(self) -> Tensor:
        """The gradient of a ready record (one that backward has reached)."""
        if self.grad is None:
            raise RuntimeError("the record's backward has not run: no gradient")
        return self.grad


class Recorder:
    """The records of one layer: made at its training-mode forward passes, ready once their
    backward ran, forgotten at every step (:meth:`discard`)."""

    def __init__(self) -> None:
        self._ready: list[Record] = []  # records that backward has reached
        self._pending: list[weakref.ref[Record]] = []  # records awaiting backward
        self._generation = 0  # bumped by discard: older records are never written
        self.stepped = False  # a step has committed (then dropped batches are warned of)
        self.expects_steps = False  # an optimizer steps this layer (warn from the start)
        self.deferred = False  # the learner reads the step's checks later (see follow)
        self._samples: Tensor | None = None  # the batch's sample indices (rcdl.memory.provenance)

    def follow(self, deferred: bool) -> None:
        """Say that a learner steps this layer (:class:`~rcdl.optim.grower.Grower`): from its
        first batch on, a backward without a ``step()`` before the next training forward is
        warned of (:class:`UnsteppedBatchWarning`). ``deferred``: the learner reads the
        step's checks at check points rather than in each step (its ``defer_checks``), so a
        training forward leaves its inputs' NaN/inf check to the divergence guard, on the
        device."""
        self.expects_steps, self.deferred = True, deferred

    def set_samples(self, indices: Tensor | None) -> None:
        """The training samples of the batch the next training forward passes see
        (``indices (n,)``, one per sample), or ``None``: unknown (:mod:`rcdl.memory.provenance`)."""
        if indices is not None:
            indices = torch.as_tensor(indices)
            if indices.dim() != 1 or indices.is_floating_point():
                raise ValueError(f"sample indices must be a 1-D integer tensor, got "
                                 f"{indices.dtype} {tuple(indices.shape)}")
        self._samples = indices

    def _row_samples(self, rows: int, n_samples: int) -> Tensor | None:
        """Each of ``rows`` query rows' sample: the rows of one sample are consecutive
        (an input ``(n, ..., d)`` flattened to ``(rows, d)``)."""
        if self._samples is None:
            return None
        if self._samples.shape[0] != n_samples or rows % n_samples:
            raise ValueError(f"{self._samples.shape[0]} sample indices were given for a batch "
                             f"of {n_samples} samples ({rows} rows)")
        return self._samples.repeat_interleave(rows // n_samples)

    def record(self, q: Tensor, s: Tensor, n_samples: int,
               normaliser: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Record one call whose output ``s (B, d_out)`` answered queries ``q (B, d_in)``;
        returns the tensor to hand out in place of ``s``: a copy, so that an in-place op
        after the layer (``nn.ReLU(inplace=True)``) changes neither the record nor a leaf,
        while the hook on ``s`` still sees ``∂L/∂s``."""
        if not s.requires_grad:  # nothing upstream is trainable: make s the leaf
            s = s.detach().requires_grad_()
        record = Record(q.detach(), s.detach(), n_samples, self._generation, ready=self._ready,
                        normaliser=normaliser,  # the normaliser is read at the step: no sync
                        samples=self._row_samples(q.shape[0], n_samples))
        s.register_hook(record.set_grad)  # the graph holds the record until backward
        self._pending = [r for r in self._pending if r() is not None]
        self._pending.append(weakref.ref(record))
        return s.clone()

    def ready(self) -> list[Record]:
        """The records of this step that backward has reached (what the step writes)."""
        return [r for r in self._ready if r.generation == self._generation]

    @property
    def has_pending(self) -> bool:
        """Whether a training-mode forward of this step still waits for its backward."""
        alive = (ref() for ref in self._pending)
        return any(r is not None and r.generation == self._generation for r in alive)

    def latest_pending(self) -> Record | None:
        """The newest record still alive (its graph not yet freed), ready or not."""
        for ref in reversed(self._pending):
            if (record := ref()) is not None:
                return record
        return None

    def drop_unstepped(self, where: str) -> bool:
        """Forget records whose backward ran but whose step never came: a new training
        forward pass starts a new step. Says so (:class:`UnsteppedBatchWarning`, naming the
        layer ``where``, pointing at the user's line) where the layer is stepped: once a
        :class:`~rcdl.optim.grower.Grower` drives it (:attr:`expects_steps`), from its first
        batch on, or once a step has committed here (a growing layer does not accumulate
        over batches as parameters' gradients do). A layer that nothing grows, e.g. a
        hybrid trained by Adam alone, drops them silently. Returns whether any went."""
        if not self._ready:
            return False
        if (self.stepped or self.expects_steps) and self.ready():
            warnings.warn(
                f"{where}: a batch's backward() ran but no step() followed before this "
                "training forward pass; that batch is dropped and writes no entries. Growing "
                "layers do not accumulate gradients over batches: call step() after every "
                "backward() (for a larger batch, concatenate the inputs into one forward; "
                "docs/faults.md, 'Gradient accumulation')",
                UnsteppedBatchWarning, stacklevel=user_stacklevel())
        self._ready.clear()
        self._generation += 1
        return True

    def discard(self, stepped: bool = False) -> None:
        """Forget this step's records: records made so far are never written, even if their
        backward runs later. ``stepped``: a step has just committed them (from then on a
        dropped batch is warned of)."""
        self.stepped = self.stepped or stepped
        self._ready.clear()
        self._pending.clear()
        self._generation += 1


class EvalModeOutput(torch.autograd.Function):
    """Identity whose backward raises: the output of a layer that ran in eval mode with
    grad enabled, so a backward through it names the layer instead of learning nothing."""

    @staticmethod
    def forward(ctx, s: Tensor, where: str) -> Tensor:  # noqa: ANN001
        ctx.where = where
        return s.clone()  # not a view of the leaf: in-place ops on it stay possible

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        raise RuntimeError(
            f"{ctx.where} ran its forward pass in eval mode, so it recorded nothing to learn "
            "from: call model.train() before a training step (model.eval() is for evaluation)")
