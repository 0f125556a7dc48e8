"""The baselines of the class-incremental experiment (:mod:`rcdl.app.experiments.continual`):
EWC and LwF on a parametric network, and two order-independent classifiers on raw pixels,
the nearest class mean and streaming LDA.

Why written here rather than taken from Avalanche: ``avalanche-lib`` 0.6.0 (its newest
release) lists ``torchvision`` among its required dependencies (with ``wandb``,
``tensorboard``, ``pytorchcv`` and ``qpsolvers``), and this project runs torch 2.13 without
torchvision: installing it would pull a torchvision built for another torch, and with it
another torch. The methods are short, so they are written from their papers:

- :class:`EWC` — elastic weight consolidation (Kirkpatrick et al. 2017, PNAS 114(13)): after
  task ``t``, the diagonal Fisher information ``F_t`` at the task's parameters ``θ*_t``;
  while learning later tasks the loss adds ``λ/2 Σ_t Σ_i F_{t,i} (θ_i − θ*_{t,i})²``, one
  penalty per earlier task, as in the paper.
- :class:`LwF` — learning without forgetting (Li & Hoiem 2017, TPAMI 40(12)): while
  learning a task, the loss adds ``λ_o`` times the cross-entropy between the outputs over
  the classes seen before it of the network as it was at the end of the previous task
  (frozen) and of the network being trained, both softened by the temperature ``T = 2``;
  ``λ_o = 1`` as in the paper. With one head over every class (the class-incremental
  setting), "the old head's outputs" are the logits of the old classes.
- :class:`LabelsTrick` — the labels trick (Zeno et al. 2018, "Task agnostic continual
  learning using online variational Bayes"; the "LT" baseline of the PEC paper): the
  cross-entropy over the classes of the current task (or batch) only, so that the loss
  gradient of every other class's logit is zero. For a growing layer this is a
  restricted write: a new entry's value ``−η g`` touches only those classes' logits.
- :class:`LabelVote` — a readout of a growing network that answers by its readout entries'
  *labels* instead of their values: each class's kernel mass at the query, at a sharper
  temperature. Not a baseline but a method of this experiment (results/continual/LOG.md, "What
  recalls them").
- :class:`PEC` — prediction-error-based classification (Zając, Tuytelaars & van de Ven,
  ICLR 2024): one small student network per class, trained on that class's images alone
  to reproduce a frozen random teacher; a class's score is minus its student's squared
  error. Written from the paper and its public scripts (architecture and settings below).
- :class:`NearestClassMean` — each class's running mean; an image goes to the nearest.
- :class:`StreamingLDA` — streaming linear discriminant analysis (Hayes & Kanan 2020,
  CVPR-W, "Lifelong machine learning with deep streaming linear discriminant analysis"):
  running class means and one shared covariance, shrunk towards the identity, and the
  linear classifier they give.

Both classifiers sum what they see, so the order of the images changes nothing but float
rounding: their class-incremental accuracy is their i.i.d. one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.layers import GrowingLayer
from rcdl.nn.networks import eval_mode, layer_input
from rcdl.ops.kernels import softmax_scale

__all__ = ["EWC", "PEC", "LabelsTrick", "LwF", "NearestClassMean", "PlainLoss", "StreamingLDA",
           "class_scores", "fisher_diagonal", "fisher_diagonal_naive", "restricted_cross_entropy"]


# --------------------------------------------------------------------------- the losses


class PlainLoss:
    """Cross-entropy on the current task's batch, nothing else: plain fine-tuning (and how
    the growing models learn)."""

    def loss(self, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:  # noqa: ARG002
        return F.cross_entropy(logits, y)

    def start_task(self, classes: Iterable[int]) -> None:
        """Called before each task with its classes; plain fine-tuning needs nothing."""

    def after_task(self, model: nn.Module, x: Tensor, seen: Iterable[int]) -> None:
        """Called at the end of each task with its training images ``x (n, D_in)`` and the
        classes seen so far; plain fine-tuning keeps nothing."""


def restricted_cross_entropy(logits: Tensor, y: Tensor, classes: Tensor) -> Tensor:
    """The cross-entropy over the logits of ``classes (K,)`` only (every ``y`` among them):
    ``−log softmax(z_K)_y``, mean over the batch. Its gradient with respect to the logit of
    any class outside ``classes`` is exactly zero."""
    inside = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    inside[classes.to(logits.device)] = True
    if not bool(inside[y].all()):
        raise ValueError(f"restricted_cross_entropy: labels {sorted(set(y.tolist()))} are not "
                         f"all among the classes {sorted(classes.tolist())}")
    masked = logits.masked_fill(~inside, float("-inf"))  # (B, C): −inf outside, no gradient
    return F.cross_entropy(masked, y)


class LabelsTrick(PlainLoss):
    """The labels trick: :func:`restricted_cross_entropy` over the classes of the current
    task (``scope="task"``) or of the batch (``scope="batch"``).

    With ``scope="task"`` one task holding every class (i.i.d. training) is plain
    cross-entropy, so its i.i.d. run is the plain model's; ``scope="batch"`` needs no task
    boundaries and changes i.i.d. training too (a batch of 16 rarely holds all ten classes).
    """

    def __init__(self, scope: str = "task") -> None:
        if scope not in ("task", "batch"):
            raise ValueError(f"LabelsTrick: scope must be 'task' or 'batch', got {scope!r}")
        self.scope = scope
        self.classes: Tensor | None = None  # (K,) the current task's

    def start_task(self, classes: Iterable[int]) -> None:
        self.classes = torch.tensor(sorted(set(classes)), dtype=torch.long)

    def loss(self, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:  # noqa: ARG002
        if self.scope == "batch":
            return restricted_cross_entropy(logits, y, y.unique())
        if self.classes is None:
            raise RuntimeError("LabelsTrick(scope='task'): call start_task(classes) first")
        return restricted_cross_entropy(logits, y, self.classes)


class LabelVote(nn.Module):
    """A growing network read out by the labels of the samples that wrote its readout
    entries: for a query ``q`` (the readout's input),

    ``score_c(q) = log Σ_{j : y_j = c} φ(q, k_j; τ / s)``,

    the log of class ``c``'s kernel mass over the readout's stored keys ``k_j``, with the
    readout's own kernel ``φ`` (RBF, Laplacian or softmax logits) at its temperature
    ``τ = T √d`` divided by the sharpness ``s``; ``y_j = labels[sample of entry j]``
    (:func:`rcdl.memory.provenance.entry_samples`). Entries no sample wrote (the initial
    entries of a softmax store) do not vote; a class without entries scores ``−∞``.

    The values the entries learnt are not used, only their keys, which the layers before
    the readout shaped by learning. Restricting or forgetting entries restricts the vote
    (it reads the store at every call). The vote weighs every entry by its kernel alone,
    so which task wrote an entry does not change how loudly it answers: the cause of
    class-incremental forgetting in the learnt values (each task's entries pushing the
    earlier classes down) does not reach it. The model is not changed.

    Args:
        model: a network with a growing ``readout`` (:class:`rcdl.nn.networks.ResidualNet`).
        labels: ``(n,)`` the label of every training sample, by sample index.
        sharpness: ``s > 0``; 1 is the readout's own kernel.
    """

    labels: Tensor

    def __init__(self, model: nn.Module, labels: Tensor, sharpness: float = 4.0) -> None:
        super().__init__()
        readout = getattr(model, "readout", None)
        if not isinstance(readout, GrowingLayer):
            raise ValueError(f"LabelVote: {type(model).__name__} has no growing readout")
        if readout.kernel.index_metric is None:
            raise ValueError(f"LabelVote: the {readout.kernel} kernel is not a similarity "
                             "(it has no log-kernel to vote with)")
        if not sharpness > 0:
            raise ValueError(f"LabelVote: sharpness must be > 0, got {sharpness}")
        self.model, self.sharpness = model, sharpness
        self.register_buffer("labels", labels.long().clone(), persistent=False)
        self.classes = int(readout.d_out)

    @property
    def readout(self) -> GrowingLayer:
        return cast(GrowingLayer, self.model.readout)

    def log_kernel(self, q: Tensor) -> Tensor:  # (B, d) -> (B, N)
        """``log φ(q, k_j; τ / s)`` for every readout entry ``j``."""
        layer = self.readout
        keys = layer.store.keys.to(q.dtype)  # (N, d)
        q = layer.query_keys(q)
        tau = softmax_scale(layer.temperature, keys.shape[1]) / self.sharpness
        metric = layer.kernel.index_metric
        score = torch.cdist(q, keys).square() if metric == "l2" else q @ keys.T  # (B, N)
        return layer.kernel.log_kernel(score, tau)

    def forward(self, x: Tensor) -> Tensor:  # (B, d_in) -> (B, C)
        layer = self.readout
        ids = entry_samples(layer).to(self.labels.device)  # (N,)
        known = ids != UNKNOWN
        log_phi = self.log_kernel(layer_input(self.model, layer, x))[:, known]  # (B, N')
        label = self.labels[ids[known]].to(log_phi.device)  # (N',)
        return class_scores(log_phi, label, self.classes)


def class_scores(log_phi: Tensor, label: Tensor, classes: int) -> Tensor:  # (B, C)
    """``log Σ_{j : label_j = c} e^{log_phi[:, j]}`` for every class ``c`` of ``classes``
    (``−∞`` where no entry is left): a label vote from the log-kernel ``(B, N)`` of its
    voters and their labels ``(N,)``."""
    scores = log_phi.new_full((len(log_phi), classes), -torch.inf)  # (B, C)
    for c in label.unique().tolist():
        scores[:, c] = torch.logsumexp(log_phi[:, label == c], 1)
    return scores


def _sample_labels(logits: Tensor, generator: torch.Generator | None) -> Tensor:  # (B,)
    probs = logits.detach().float().softmax(1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's ``nn.Linear`` modules; every trainable parameter must be in one."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    covered = {id(p) for _, m in linears for p in m.parameters()}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if stray:
        raise ValueError(f"fisher_diagonal: parameters {stray} of {type(model).__name__} are "
                         "not in an nn.Linear; use fisher_diagonal_naive")
    return linears


def fisher_diagonal(model: nn.Module, x: Tensor, *, batch_size: int = 64,
                    generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """The diagonal of the Fisher information of ``model`` at its parameters, over the
    inputs ``x (n, D_in)``:

        F_i = (1/n) Σ_n (∂ log p(ŷ_n | x_n) / ∂θ_i)²,   ŷ_n ~ p(· | x_n)

    (Kirkpatrick et al. 2017: the expectation over the model's own predictive
    distribution, one label drawn per image from ``generator``). Exact and batched for a
    model whose trainable parameters all sit in ``nn.Linear`` layers with rows that do not
    interact (no batch norm): a linear layer's per-sample weight gradient is ``δ_n a_nᵀ``
    (``a_n`` its input, ``δ_n`` the gradient at its output), so ``Σ_n (δ_n a_nᵀ)²`` is
    ``(δ²)ᵀ (a²)`` over the batch, from one backward pass. :func:`fisher_diagonal_naive`
    is the per-sample twin.

    Returns:
        ``{parameter name: F (the parameter's shape)}`` for every trainable parameter.
    """
    linears = _linears(model)
    fisher = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    seen: dict[str, tuple[Tensor, Tensor | None]] = {}  # layer -> (input a, output grad δ)
    handles = []

    def hook(name: str):  # noqa: ANN202
        def forward(module: nn.Linear, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            a = inputs[0].detach()
            if a.dim() != 2:
                raise ValueError(f"fisher_diagonal: {name} takes {tuple(a.shape)} inputs; "
                                 "expected (B, d_in)")
            seen[name] = (a, None)
            out.register_hook(lambda g: seen.__setitem__(name, (a, g.detach())))
        return forward

    for name, module in linears:
        handles.append(module.register_forward_hook(hook(name)))
    try:
        with eval_mode(model):
            for xb in x.split(batch_size):
                logits = model(xb)  # (B, C)
                labels = _sample_labels(logits, generator)
                # the sum over the batch: each row's gradient is that sample's own
                F.cross_entropy(logits, labels, reduction="sum").backward()
                for name, module in linears:
                    a, g = seen[name]
                    assert g is not None, name  # every linear layer is on the loss's path
                    fisher[f"{name}.weight" if name else "weight"] += g.square().T @ a.square()
                    if module.bias is not None:
                        fisher[f"{name}.bias" if name else "bias"] += g.square().sum(0)
                model.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    return {n: f / len(x) for n, f in fisher.items()}


def fisher_diagonal_naive(model: nn.Module, x: Tensor, *,
                          generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """:func:`fisher_diagonal` one sample at a time (one backward pass each): the reference
    its batched form is tested against, for any model. The labels are drawn as there (one
    batch of ``len(x)`` rows, then one label per row in order), so the two agree exactly when
    ``fisher_diagonal``'s batch holds every image."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    with eval_mode(model):
        with torch.no_grad():
            labels = _sample_labels(model(x), generator)  # (n,)
        for xi, yi in zip(x, labels, strict=True):
            loss = F.cross_entropy(model(xi[None]), yi[None])
            grads = torch.autograd.grad(loss, list(params.values()))
            for n, g in zip(params, grads, strict=True):
                fisher[n] += g.square()
    return {n: f / len(x) for n, f in fisher.items()}


class EWC(PlainLoss):
    """Elastic weight consolidation (Kirkpatrick et al. 2017): the loss is the task's
    cross-entropy plus ``λ/2 Σ_t Σ_i F_{t,i} (θ_i − θ*_{t,i})²`` over the earlier tasks
    ``t``.

    The sum of the per-task quadratics is kept as one: with ``A = Σ_t F_t`` and ``m = Σ_t
    F_t θ*_t / A``, ``Σ_t F_t (θ − θ*_t)² = A (θ − m)² + const``, the same gradient at two
    tensors per parameter instead of two per parameter and task.

    Args:
        model: the network trained; its parameters are read after each task.
        lam: the penalty's strength ``λ``.
        generator: draws the labels of the Fisher (:func:`fisher_diagonal`).
    """

    def __init__(self, model: nn.Module, lam: float, *, batch_size: int = 64,
                 generator: torch.Generator | None = None) -> None:
        self.model, self.lam, self.batch_size, self.generator = model, lam, batch_size, generator
        self.precision: dict[str, Tensor] = {}  # A = Σ_t F_t
        self.anchor: dict[str, Tensor] = {}  # m = Σ_t F_t θ*_t / A

    def penalty(self) -> Tensor:
        """``λ/2 Σ_i A_i (θ_i − m_i)²`` (0 before the first task ends)."""
        params = dict(self.model.named_parameters())
        terms = [(self.precision[n] * (params[n] - self.anchor[n]).square()).sum()
                 for n in self.precision]
        if not terms:
            return torch.zeros((), device=next(self.model.parameters()).device)
        return self.lam / 2 * torch.stack(terms).sum()

    def loss(self, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
        return F.cross_entropy(logits, y) + self.penalty()

    def after_task(self, model: nn.Module, x: Tensor, seen: Iterable[int]) -> None:
        fisher = fisher_diagonal(model, x, batch_size=self.batch_size, generator=self.generator)
        for n, p in model.named_parameters():
            if n not in fisher:
                continue
            f, theta = fisher[n], p.detach()
            if n not in self.precision:
                self.precision[n], self.anchor[n] = f, theta.clone()
                continue
            total = self.precision[n] + f
            # m ← (A m + F θ*) / (A + F); where no task has any information, keep m
            mixed = (self.precision[n] * self.anchor[n] + f * theta) / total.clamp_min(1e-30)
            self.anchor[n] = torch.where(total > 0, mixed, self.anchor[n])
            self.precision[n] = total


class LwF(PlainLoss):
    """Learning without forgetting (Li & Hoiem 2017): the task's cross-entropy plus
    ``λ_o · CE(softmax(z_old / T), softmax(z / T))`` over the classes seen before the
    task, ``z_old`` the logits of the network frozen at the end of the previous task.

    Args:
        alpha: ``λ_o`` (1 in the paper).
        temperature: ``T`` (2 in the paper).
    """

    def __init__(self, alpha: float = 1.0, temperature: float = 2.0) -> None:
        self.alpha, self.temperature = alpha, temperature
        self.old: nn.Module | None = None
        self.old_classes: Tensor | None = None  # (C_old,) int64

    def loss(self, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if self.old is None or self.old_classes is None:
            return ce
        with torch.no_grad():
            target = (self.old(x)[:, self.old_classes] / self.temperature).softmax(1)
        log_p = (logits[:, self.old_classes] / self.temperature).log_softmax(1)  # (B, C_old)
        return ce + self.alpha * -(target * log_p).sum(1).mean()

    def after_task(self, model: nn.Module, x: Tensor, seen: Iterable[int]) -> None:
        self.old = copy.deepcopy(model).eval().requires_grad_(False)
        device = next(model.parameters()).device
        self.old_classes = torch.tensor(sorted(set(seen)), dtype=torch.long, device=device)


# --------------------------------------------------------------------------- on raw pixels


class NearestClassMean:
    """The nearest class mean: each class's running mean ``μ_c``; an image goes to the
    class whose mean is nearest in L2 (among the classes seen)."""

    def __init__(self, d: int, classes: int) -> None:
        self.sums = torch.zeros(classes, d, dtype=torch.float64)  # (C, D)
        self.counts = torch.zeros(classes, dtype=torch.float64)  # (C,)

    def update(self, x: Tensor, y: Tensor) -> None:
        """Add the images ``x (n, D)`` of classes ``y (n,)``."""
        self.sums.index_add_(0, y.cpu(), x.cpu().double())
        self.counts += torch.bincount(y.cpu(), minlength=len(self.counts)).double()

    def scores(self, x: Tensor) -> Tensor:  # (n, C): −‖x − μ_c‖², −inf for unseen classes
        seen = self.counts > 0
        means = self.sums[seen] / self.counts[seen, None]  # (C_seen, D)
        out = torch.full((len(x), len(self.counts)), -torch.inf, dtype=torch.float64)
        out[:, seen] = -torch.cdist(x.cpu().double(), means).square()
        return out


class StreamingLDA:
    """Streaming linear discriminant analysis (Hayes & Kanan 2020): running class means
    ``μ_c`` and the pooled within-class covariance ``Σ``; an image ``x`` gets the scores

        s_c(x) = μ_cᵀ Λ x − ½ μ_cᵀ Λ μ_c,   Λ = ((1 − ε) Σ + ε I)⁻¹

    over the classes seen (shrinkage ``ε``). The covariance is kept exactly, as the
    within-class scatter ``S`` with Chan et al.'s merge of a batch into a running class
    (``S += S_b + n_a n_b / (n_a + n_b) · (m_b − μ_a)(m_b − μ_a)ᵀ``) and ``Σ = S / n``, so it
    does not depend on the order of the images; Hayes & Kanan weight each sample's outer
    product by the total count rather than its class's, an approximation of the same
    matrix. Kept in float64.
    """

    def __init__(self, d: int, classes: int, shrinkage: float = 1e-4) -> None:
        if not 0 < shrinkage <= 1:
            raise ValueError(f"StreamingLDA: shrinkage must be in (0, 1], got {shrinkage}")
        self.shrinkage = shrinkage
        self.means = torch.zeros(classes, d, dtype=torch.float64)  # (C, D)
        self.counts = torch.zeros(classes, dtype=torch.float64)  # (C,)
        self.scatter = torch.zeros(d, d, dtype=torch.float64)  # (D, D)

    def update(self, x: Tensor, y: Tensor) -> None:
        """Add the images ``x (n, D)`` of classes ``y (n,)``."""
        x, y = x.cpu().double(), y.cpu()
        rows = []  # S grows by Σ rows rowsᵀ: one product, in place, for every class
        for c in y.unique().tolist():
            xc = x[y == c]  # (n_b, D)
            n_a, n_b = self.counts[c].item(), len(xc)
            m_b = xc.mean(0)
            delta = m_b - self.means[c]  # (D,)
            rows += [xc - m_b, (n_a * n_b / (n_a + n_b)) ** 0.5 * delta[None]]
            self.means[c] += delta * (n_b / (n_a + n_b))
            self.counts[c] = n_a + n_b
        if rows:
            stacked = torch.cat(rows)  # (n + classes, D)
            self.scatter.addmm_(stacked.T, stacked)

    def scores(self, x: Tensor) -> Tensor:  # (n, C), −inf for unseen classes
        seen = self.counts > 0
        n = self.counts.sum().item()
        shrunk = self.scatter * ((1 - self.shrinkage) / max(n, 1.0))  # (1 − ε) Σ
        shrunk.diagonal().add_(self.shrinkage)  # + ε I
        means = self.means[seen]  # (C_seen, D)
        factor = torch.linalg.cholesky(shrunk)  # positive definite: ε > 0
        weights = torch.cholesky_solve(means.T, factor).T  # (C_seen, D): Λ μ_c (Λ symmetric)
        bias = -0.5 * (weights * means).sum(1)  # (C_seen,)
        out = torch.full((len(x), len(self.counts)), -torch.inf, dtype=torch.float64)
        out[:, seen] = x.cpu().double() @ weights.T + bias
        return out


# --------------------------------------------------------------------------- PEC


def _pec_network(channels: int, out_dim: int, pool: int) -> nn.Sequential:
    """PEC's convolutional network: a 3×3 convolution (stride 1, padding 1) to
    ``channels``, instance normalisation with an affine map, ReLU, adaptive average pooling
    to ``pool × pool``, and a linear map to ``out_dim``."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, stride=1, padding=1), nn.InstanceNorm2d(channels, affine=True),
        nn.ReLU(), nn.AdaptiveAvgPool2d(pool), nn.Flatten(1),
        nn.Linear(channels * pool * pool, out_dim))


def pec_forward_blocked(net: nn.Sequential, images: Tensor, block: int = 250) -> Tensor:
    """:func:`_pec_network`'s output on ``images (n, 3, H, W)``, ``block`` of its
    channels at a time: every step before the linear map acts on each channel alone
    (the instance normalisation too: per image and channel), so
    ``h = b + Σ_blocks W[:, cols(block)] · pool(relu(norm(conv_block(x))))``. The same
    numbers as ``net(images)`` up to float summation order, without the ``(n, channels,
    H, W)`` activation of a 6 000-channel teacher (tested against it in float64)."""
    conv, norm = cast(nn.Conv2d, net[0]), cast(nn.InstanceNorm2d, net[1])
    pool, linear = cast(nn.AdaptiveAvgPool2d, net[3]), cast(nn.Linear, net[5])
    size = cast(int, pool.output_size)  # _pec_network pools to an int
    cells = size * size
    out = linear.bias.expand(len(images), -1).clone()  # (n, out_dim)
    for a in range(0, conv.out_channels, block):
        b = min(a + block, conv.out_channels)
        h = F.conv2d(images, conv.weight[a:b], cast(Tensor, conv.bias)[a:b], conv.stride,
                     cast(tuple[int, int], conv.padding))
        h = F.instance_norm(h, weight=norm.weight[a:b], bias=norm.bias[a:b], eps=norm.eps)
        h = F.adaptive_avg_pool2d(h.relu_(), size).flatten(1)  # (n, (b − a)·cells)
        out += h @ linear.weight[:, a * cells : b * cells].T
    return out


class PEC:
    """Prediction-error-based classification (Zając, Tuytelaars & van de Ven, ICLR 2024).

    A frozen, randomly initialised teacher ``h`` and, per class ``c``, a student ``g_c``
    (all students start from the same initialisation). Training on an image ``x`` of class
    ``c`` takes one Adam step on ``g_c`` alone for ``‖g_c(x) − h(x)‖² / out_dim``; the score
    of class ``c`` is ``−‖g_c(x) − h(x)‖² / out_dim`` (classes never trained: ``−inf``).
    Each class's module learns only from its own images, so nothing learnt is overwritten
    by a later class: the method is rehearsal-free by construction.

    The settings are the paper's CIFAR-10 ones (its public script
    ``scripts/table1/cifar10/pec.sh``): students of one convolution with 60 channels,
    pooled to 5 × 5, 743 outputs; the teacher 100 times wider (6 000 channels); Adam with
    learning rate 3·10⁻⁴ decayed linearly to 0 over each task's steps; batch size 1; the
    images standardised per channel, no augmentation.

    Args:
        classes: number of classes.
        seed: seeds the teacher's and the students' initialisation.
        channels, teacher_multiplier, out_dim, pool, lr: as above.
    """

    def __init__(self, classes: int, *, seed: int = 0, channels: int = 60,
                 teacher_multiplier: int = 100, out_dim: int = 743, pool: int = 5,
                 lr: float = 3e-4, device: torch.device | str = "cpu") -> None:  # fmt: skip
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.teacher = _pec_network(channels * teacher_multiplier, out_dim, pool)
            first = _pec_network(channels, out_dim, pool)
        finally:
            torch.random.set_rng_state(gen_state)
        self.teacher.requires_grad_(False).to(device).eval()
        self.students = nn.ModuleList(copy.deepcopy(first) for _ in range(classes)).to(device)
        self.optimizers = [torch.optim.Adam(s.parameters(), lr=lr) for s in self.students]
        self.lr = lr
        self.trained = torch.zeros(classes, dtype=torch.bool)
        self.device = torch.device(device)

    @staticmethod
    def images(x: Tensor) -> Tensor:  # (n, 3, 32, 32)
        """CIFAR rows ``(n, 3072)``, flattened in HWC order, as ``(n, 3, 32, 32)``."""
        return x.reshape(len(x), 32, 32, 3).permute(0, 3, 1, 2).contiguous()

    @torch.no_grad()
    def targets(self, x: Tensor, batch_size: int = 16) -> Tensor:  # (n, out_dim)
        """The teacher's outputs ``h(x)`` on CIFAR rows ``x (n, 3072)``, by
        :func:`pec_forward_blocked` (its dense twin is ``self.teacher(images)``)."""
        return torch.cat([pec_forward_blocked(self.teacher, self.images(b.to(self.device)))
                          for b in x.split(batch_size)]) if len(x) else torch.empty(0)

    def update(self, x: Tensor, y: Tensor, *, batch_size: int = 1,
               targets: Tensor | None = None) -> None:  # fmt: skip
        """One pass over one task's images ``x (n, 3072)`` with classes ``y (n,)``, in the
        given order, ``batch_size`` at a time; each class's learning rate decays linearly
        from ``lr`` to 0 over the task's steps. ``targets``: the teacher's outputs on ``x``
        when already known (:meth:`targets`; the teacher is frozen)."""
        steps = -(-len(x) // batch_size)
        targets = self.targets(x) if targets is None else targets  # (n, out_dim)
        for step, rows in enumerate(torch.arange(len(x)).split(batch_size)):
            xb, yb, tb = x[rows].to(self.device), y[rows], targets[rows]
            for c in yb.unique().tolist():
                mine = yb == c
                opt = self.optimizers[c]
                for group in opt.param_groups:
                    group["lr"] = self.lr * (1 - step / steps)
                error = (self.students[c](self.images(xb[mine.to(self.device)]))
                         - tb[mine.to(tb.device)]).square().mean(1)  # (b_c,)
                opt.zero_grad(set_to_none=True)
                error.mean().backward()
                opt.step()
                self.trained[c] = True

    @torch.no_grad()
    def scores(self, x: Tensor, *, targets: Tensor | None = None,
               batch_size: int = 256) -> Tensor:  # (n, C), −inf for classes never trained
        """``−‖g_c(x) − h(x)‖² / out_dim`` for every class; ``targets`` are the teacher's
        outputs on ``x`` when already known (:meth:`targets`)."""
        h = self.targets(x) if targets is None else targets
        out = torch.full((len(x), len(self.students)), -torch.inf)
        for rows in torch.arange(len(x)).split(batch_size):
            xb = self.images(x[rows].to(self.device))
            for c in self.trained.nonzero().squeeze(1).tolist():
                out[rows, c] = -(self.students[c](xb) - h[rows].to(self.device)).square().mean(
                    1).cpu()
        return out
