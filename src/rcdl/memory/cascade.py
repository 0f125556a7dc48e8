"""An entry's share plus the first-order change of every later write it caused: the readout
cascade (docs/attribution.md, "What each score means").

An entry's share (:func:`rcdl.memory.attribution.entry_contributions`) is exact for the model
that stores it, but removing a sample from training does more than delete its entries:
every later step sees another model and writes other entries. A growing layer knows the
step that wrote each entry, so for a layer that does not normalise (linear, RBF, Laplacian)
trained by per-sample :class:`~rcdl.nn.rules.FunctionalSGD` on the cross-entropy, part of
that can be computed. Entry ``u``, written at step ``t_u``, holds

    v_u = −η (p_u − y_u),        p_u = softmax(s_u),        s_u = Σ_{j : t_j < t_u} Φ_uj v_j

with ``s_u`` the layer's answer to its own key ``k_u`` from the entries written before it
and ``Φ_uj = w_j φ(k_u, k_j)``; so ``p_u = y_u − v_u / η`` is read off the store (``y_u``
the one-hot label, the class of ``v_u``'s largest coordinate). Scale entry ``i``'s value by
``1 − ε``: every later answer ``s_u`` moves, then its value, then the answers after it. To
first order in ``ε``, with ``J_u = diag(p_u) − p_u p_uᵀ`` (the softmax's Jacobian) and
``a_j(x) = w_j φ(x, k_j)``, the derivative of ``⟨d, s(x)⟩`` is ``−⟨λ_i(x), v_i⟩`` with the
adjoint

    λ_j(x) = a_j(x) d − η Σ_{u : t_u > t_j} Φ_uj J_u λ_u(x)            (C,)

solved backwards over the steps. Its first term alone gives the entry's share ``a_j(x)
⟨d, v_j⟩``; the whole sum is the *cascade* through the later writes; stopping after one
later write (``λ_u ≈ a_u(x) d`` inside the sum) is the *one-level* unroll. Keys are held
fixed: the layers below also change when a sample is removed, which this leaves out.

:func:`replay_values` is the naive twin: the layer's values written again in step order with
some entries' values scaled, from which :func:`cascade_error` takes a central difference and
compares it with the cascade (float64; ``tests/test_cascade.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rcdl.nn.layers import GrowingLayer
from rcdl.nn.rules import FunctionalSGD
from rcdl.ops.attention import shares

__all__ = ["cascade_error", "readout_cascade", "replay_values"]


def _kernel_values(layer: GrowingLayer, q: Tensor) -> Tensor:  # (B, N) float64
    """``w_j φ(q_b, k_j)`` for every query and entry, through the attention op's shares."""
    store = layer.store
    ones = layer.entries(values=torch.ones(len(store), 1, dtype=store.values.dtype,
                                           device=store.values.device))
    return shares(q.to(store.keys.dtype), ones,
                  torch.ones(len(q), 1, dtype=store.keys.dtype, device=q.device)).double()


def _check_layer(where: str, layer: GrowingLayer) -> FunctionalSGD:
    """The layer's rule, where the cascade models how the layer was written."""
    rule = layer.rule
    if (layer.kernel.normalised or not isinstance(rule, FunctionalSGD) or not rule.per_sample
            or not rule.ages.trivial):
        raise ValueError(f"{where}: needs a readout that does not normalise, trained by "
                         "per-sample FunctionalSGD without weight decay or momentum; got "
                         f"{type(layer).__name__} with {rule}")
    return rule


def readout_cascade(layer: GrowingLayer, q: Tensor, d: Tensor) -> dict[str, Tensor]:
    """Each entry's first-order contribution ``⟨λ_j(q_b), v_j⟩`` to ``⟨d_b, s(q_b)⟩``, with
    the adjoint ``λ`` (module docstring) truncated to its direct term, to one later write,
    and solved whole, in float64.

    Args:
        layer: a growing layer that does not normalise, written by per-sample
            :class:`~rcdl.nn.rules.FunctionalSGD` without weight decay or momentum (a
            network's readout, trained on the cross-entropy).
        q: the layer's inputs ``(B, d_in)`` (what its forward pass receives).
        d: directions ``(B, C)``; a one-hot row explains that class's logit.

    Returns:
        ``{"share", "one_level", "cascade"}``, each ``(B, N)`` float64, columns in the
        store's row order. ``share`` is :func:`~rcdl.memory.attribution.entry_contributions`'s
        (in float64); the working memory is a few ``(N, C, B)`` float64 tensors and one
        ``(N, N)``.

    Raises:
        ValueError: the layer normalises (a softmax) or was not written as the cascade
            models it.
    """
    rule = _check_layer("readout_cascade", layer)
    store = layer.store
    eta, values, steps = rule.lr, store.values.double(), store.written_at
    classes = values.shape[1]
    p = F.one_hot(values.argmax(1), classes).double() - values / eta  # (N, C): p_u
    a = _kernel_values(layer, q)  # (B, N)
    phi = _kernel_values(layer, store.keys) * (steps[:, None] > steps[None, :])  # (N_u, N_j)
    d = d.to(a.device).double()
    share = a * (d @ values.T)  # (B, N)

    def jacobian_times(lam: Tensor, pr: Tensor) -> Tensor:  # (n, C, B), (n, C) -> (n, C, B)
        pr = pr[:, :, None]
        return pr * lam - pr * (pr * lam).sum(1, keepdim=True)

    # one level: λ_j = a_j d − η Σ_u Φ_uj J_u (a_u d)
    direct = a.T[:, None, :] * d.T[None]  # (N, C, B)
    first = direct - eta * torch.einsum("uj,ucb->jcb", phi, jacobian_times(direct, p))
    # whole cascade: backwards over the steps, the later rows a contiguous suffix
    order = steps.argsort(stable=True)
    sorted_steps = steps[order]
    phi_sorted = phi[order][:, order]
    lam = torch.zeros_like(direct)  # (N, C, B) in step order
    jl = torch.zeros_like(direct)
    bounds = torch.unique_consecutive(sorted_steps, return_counts=True)[1].cumsum(0).tolist()
    for end, begin in zip(reversed(bounds), reversed([0, *bounds[:-1]]), strict=True):
        rows = slice(begin, end)
        fb = (phi_sorted[end:, rows].T @ jl[end:].flatten(1)).view(end - begin, classes, -1)
        lam[rows] = direct[order[rows]] - eta * fb
        jl[rows] = jacobian_times(lam[rows], p[order[rows]])
    whole = torch.empty_like(lam)
    whole[order] = lam
    return {"share": share, "one_level": torch.einsum("jcb,jc->bj", first, values),
            "cascade": torch.einsum("jcb,jc->bj", whole, values)}


def replay_values(layer: GrowingLayer, scale: Tensor) -> Tensor:  # (N, C) float64
    """The layer's values written again in step order, with entry ``j``'s value scaled by
    ``scale[j]`` ``(N,)`` once written (keys fixed, labels from the stored values):
    ``v_u = −η (softmax(Σ_{t_j < t_u} Φ_uj scale_j v_j) − y_u)``, returned scaled. With
    every scale 1 it gives back the store's values, if the layer was written as
    :func:`readout_cascade` models it."""
    rule = _check_layer("replay_values", layer)
    store = layer.store
    eta, steps = rule.lr, store.written_at
    values = store.values.double()
    scale = scale.to(values)
    labels = F.one_hot(values.argmax(1), values.shape[1]).double()
    phi = _kernel_values(layer, store.keys)  # (N, N)
    new = torch.zeros_like(values)
    for step in steps.unique():
        rows = steps == step
        before = steps < step
        s = phi[rows][:, before] @ (new[before] * scale[before, None])  # (b, C)
        new[rows] = -eta * (s.softmax(1) - labels[rows])
    return new * scale[:, None]


def cascade_error(layer: GrowingLayer, q: Tensor, d: Tensor, *, eps: float = 1e-6) -> float:
    """The largest relative error of :func:`readout_cascade`'s ``cascade`` against a central
    difference of :func:`replay_values` (each entry's value scaled by ``1 ± eps`` in turn),
    in float64; ``N`` replays of ``N`` entries each, so for small layers (a test's).

    Raises:
        ValueError: replaying the layer's writes does not give back its stored values (it
            was not written one step per batch by its rule, as the cascade models it).
    """
    store = layer.store
    unit = torch.ones(len(store), dtype=torch.float64, device=store.values.device)
    if not torch.allclose(replay_values(layer, unit), store.values.double()):
        raise ValueError("cascade_error: replaying the layer's writes does not give back its "
                         "stored values; the cascade models a layer written one step per "
                         "batch by its per-sample FunctionalSGD, with nothing removed")
    a = _kernel_values(layer, q)  # (B, N)
    found = readout_cascade(layer, q, d)["cascade"]  # (B, N)
    d = d.to(a).double()
    worst = 0.0
    for j in range(len(store)):
        scale = unit.clone()
        outs = []
        for sign in (1, -1):
            scale[j] = 1 + sign * eps
            outs.append(((a @ replay_values(layer, scale)) * d).sum(1))
        numeric = (outs[0] - outs[1]) / (2 * eps)  # (B,): d⟨d, s⟩ / d(scale_j)
        worst = max(worst, float(((numeric - found[:, j]).abs()
                                  / numeric.abs().clamp_min(1e-8)).max()))
    return worst
