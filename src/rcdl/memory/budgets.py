"""Bounded memory for growing layers: keep at most ``capacity`` entries per layer.

A growing layer writes one entry per training sample, so its memory and its inference cost
grow linearly with the data seen — the limit the paper names (docs/reference.md §8, "Known limits"),
pointing at KV-cache style pruning as the way out. A :class:`MemoryBudget` is that pruning:
after every growth step (:class:`rcdl.optim.grower.Grower` with ``budget=``), each layer whose
store holds ``N > C`` entries drops ``N − C`` of them (``N − C + slack`` to evict in blocks),
chosen by an eviction policy:

``"oldest"``
    A sliding window (the KV-cache policy of streaming transformers): keep the ``C``
    most recently written entries (largest ``written_at``; within one step, the later rows).
``"newest"``
    Keep the ``C`` oldest entries: once full, the store stops changing and each new entry
    is evicted as soon as it is written. The baseline "stop growing when full" — the model
    trained on the first samples only (with ``+merge``, new entries are folded into the
    stored ones instead: a fixed-size store that keeps learning).
``"contribution"``
    Keep the ``C`` entries that move the layer's output most: evict the smallest
    :func:`contribution_scores` (ties: the older entry goes first).
``"random"``
    Evict ``N − C`` entries drawn uniformly at random — the control that says whether the
    others choose better than chance. The draw is a pure function of ``(seed, layer
    name, layer step)``, so a run is reproducible and a resumed run draws the same.

With ``merge=True`` an evicted entry is not simply dropped: its weight and weighted value
are folded into the kept entry with the nearest key (:func:`merge_into_nearest`), so the
store keeps its total mass ``Σ w_j`` and ``Σ ṽ_j`` — the output at the query ``q = 0`` is
unchanged, and at any query the change is what moving the entry's key onto its neighbour's
makes. This is the "merging" the paper suggests beside sliding windows (docs/reference.md §8).

Entries are always removed through :meth:`rcdl.nn.layers.GrowingLayer.remove_entries`, so a
layer that keeps per-entry state beside its store (optimizer moments, say) drops it too.

Example::

    grower = Grower(model, budget=MemoryBudget(2000, evict="contribution", merge=True))
    ...                      # train as usual; every store holds ≤ 2000 entries between steps
    grower.evicted           # {layer name: entries evicted so far}
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from rcdl.nn.layers import GrowingLayer
from rcdl.ops.kernels import guard_denominator

__all__ = ["EVICTION_POLICIES", "MemoryBudget", "contribution_scores", "merge_into_nearest"]

EVICTION_POLICIES = ("oldest", "newest", "contribution", "random")


@torch.no_grad()
def contribution_scores(layer: GrowingLayer, *, eps: float = 1e-6,
                        chunk_rows: int = 4096) -> Tensor:  # (N,)
    """How much each entry of ``layer`` contributes to its output; larger is more.

    With ``w_j`` the weights the attention sees (:meth:`GrowingLayer.entry_weights`: the
    stored weights, times the age coefficients of docs/reference.md §3 where the rule has any):

    - **weighted softmax** (docs/reference.md §2): ``score_j = ‖ṽ_j − w_j s̄‖`` with
      ``s̄ = Σ_i ṽ_i / Σ_i w_i``. Removing entry j from
      ``s(q) = Σ_i e^{z_i} ṽ_i / Σ_i w_i e^{z_i}`` changes the output by exactly
      ``−a_j(q) (ṽ_j − w_j s(q)) / (1 − w_j a_j(q))``, ``a_j = e^{z_j}/Z``: to first order
      ``a_j (ṽ_j − w_j s)``, the ``∂s/∂z_j`` of docs/reference.md §2. An entry therefore acts
      through its weighted value *and* through its weight in the normaliser, and ranking by ``w_j``
      alone would evict every entry the clipped gws rule wrote with ``w = 0`` (a quarter
      to a half of them in our CIFAR-10 runs), though each still adds ``e^{z_j} ṽ_j`` to
      the numerator. The attention factor ``a_j(q)`` depends on the query, which the
      budget does not know; the score takes the query ``q = 0`` (all logits 0, uniform
      attention), where ``s(0) = s̄`` and the change is ``(ṽ_j − w_j s̄) / Σ_i w_i`` — the
      same factor for every entry. The score is
      gauge invariant: ``ṽ_i → ṽ_i + w_i b`` (docs/reference.md §2) shifts ``s̄`` by ``b`` and
      leaves ``ṽ_j − w_j s̄`` unchanged, so it does not depend on the frame the entries were
      written in, as ``‖ṽ_j‖`` would. (``Σ_i w_i`` near zero is floored at ``eps Σ_i |w_i|``
      with its sign, as the attention does.) The difference is formed directly, in float64,
      ``chunk_rows`` entries at a time: expanding ``‖ṽ_j‖² − 2w_j⟨ṽ_j, s̄⟩ + w_j²‖s̄‖²`` cancels
      catastrophically in float32 when the entries carry a common gauge offset.
    - **RBF, Laplacian** (any bounded kernel): ``score_j = |w_j| ‖v_j‖``. Removing entry j
      changes ``s(q)`` by
      ``w_j φ(q, k_j) v_j`` and ``0 < φ ≤ 1``: the score bounds that change at every query.
    - **linear (dual form)**: ``score_j = |w_j| ‖v_j‖ ‖k_j‖``, the Frobenius norm of the
      entry's rank-one term ``w_j v_j k_jᵀ`` of the weight matrix.

    Returns:
        ``scores (N,)`` on the store's device, ``≥ 0``.
    """
    store = layer.store
    weights = layer.entry_weights()  # (N,)
    values = store.values  # (N, d_out)
    if layer.kernel.normalised:
        return _softmax_scores(values, weights, eps, chunk_rows)
    scores = weights.abs() * torch.linalg.vector_norm(values, dim=1)  # (N,)
    if not layer.kernel.bounded:  # the linear kernel: ⟨q, k⟩ grows with ‖k‖
        scores = scores * torch.linalg.vector_norm(store.keys, dim=1)
    return scores


def _softmax_scores(values: Tensor, weights: Tensor, eps: float,
                    chunk_rows: int) -> Tensor:  # (N,)
    """``‖ṽ_j − w_j s̄‖`` with ``s̄ = Σ_i ṽ_i / Σ_i w_i``, in float64, rows in chunks."""
    w64 = weights.double()  # (N,)
    den = guard_denominator(w64.sum(), w64.abs().sum(), eps)
    s_bar = values.sum(0, dtype=torch.float64) / den  # (d_out,) = s(q = 0)
    scores = torch.empty_like(w64)  # (N,)
    for start in range(0, values.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        diff = values[rows].double() - w64[rows, None] * s_bar  # (c, d_out)
        scores[rows] = torch.linalg.vector_norm(diff, dim=1)
    return scores.to(values.dtype)


def _check_mergeable(layer: GrowingLayer) -> None:
    ages = layer.rule.ages
    where = f"{type(layer).__name__} {layer.name!r}"
    if not layer.kernel.bounded:
        raise ValueError(f"MemoryBudget(merge=True): {where} has a {layer.kernel} kernel; "
                         "merging is defined for softmax and RBF layers and other bounded "
                         "kernels (Laplacian) only")
    if ages is not None and not ages.trivial:
        raise ValueError(f"MemoryBudget(merge=True): {where} weights its entries by age "
                         "(weight decay or momentum); a merged entry would take its "
                         "neighbour's age, so merging is refused")


@torch.no_grad()
def merge_into_nearest(layer: GrowingLayer, mask: Tensor) -> Tensor:  # (E,) targets
    """Fold every entry where ``mask (N,)`` is True into the nearest entry where it is False.

    The target of entry j is ``i = argmin_{i kept} ‖k_j − k_i‖`` (for keys of equal norm —
    RMS-normalised queries — the kept key with the largest logit ``⟨k_j, k_i⟩``). Then:

    - weighted softmax: ``w_i += w_j``, ``ṽ_i += ṽ_j``. The sums ``Σ w`` and ``Σ ṽ`` are
      kept exactly, and so is the output at every query where ``z_i = z_j``; elsewhere the
      error is ``(e^{z_j} − e^{z_i})(ṽ_j − w_j s)/Z`` to first order.
    - RBF: ``v_i ← w_i v_i + Σ_j w_j v_j``, ``w_i ← 1``, keeping ``Σ w v`` exactly.

    Only the kept rows change, in place; the masked rows are left for the caller to remove
    (with ``layer.remove_entries(mask)``). Each kept entry keeps its id and sample, and its
    provenance counts the entries it absorbed (:meth:`rcdl.nn.sample_map.SampleMap.absorb`;
    :func:`rcdl.memory.provenance.merged_counts`). Merging is refused for linear layers and for
    layers whose rules weight entries by age.

    Returns:
        ``targets (E,)``: the row each of the ``E`` masked entries went into.
    """
    _check_mergeable(layer)
    store = layer.store
    if mask.all():
        raise ValueError(f"merge_into_nearest: {layer.name!r}: every entry is masked; "
                         "nothing to merge into")
    evicted = mask.nonzero().squeeze(1)  # (E,)
    if evicted.numel() == 0:
        return evicted
    keys = store.keys  # (N, d_in)
    ev_keys = keys.index_select(0, evicted)  # (E, d_in)
    # ‖k_j − k_i‖² up to the constant ‖k_j‖², without copying the kept rows
    sq_dist = torch.linalg.vector_norm(keys, dim=1).square()[:, None] - 2 * keys @ ev_keys.T
    sq_dist[mask] = float("inf")  # (N, E): only kept rows are candidates
    targets = sq_dist.argmin(0)  # (E,)
    values, weights = store.values, store.weights  # views: written in place
    ev_values, ev_weights = values.index_select(0, evicted), weights.index_select(0, evicted)
    if layer.kernel.normalised:
        values.index_add_(0, targets, ev_values)
        weights.index_add_(0, targets, ev_weights)
    else:  # rbf, laplacian: canonical weight 1, the weighted value in v
        hit = torch.zeros_like(mask)
        hit[targets] = True
        values[hit] *= weights[hit][:, None]
        weights[hit] = 1.0
        # in the weights' dtype, rounded once to a half-precision store's
        values.index_add_(0, targets, (ev_weights[:, None] * ev_values).to(values.dtype))
    store.touch()
    layer.provenance.absorb(store.ids[targets], store.ids[evicted])  # (E,) ids each
    return targets


@dataclass(frozen=True)
class MemoryBudget:
    """At most ``capacity`` entries per growing layer, enforced by evicting with ``evict``.

    Args:
        capacity: entries a layer may hold between growth steps (``C ≥ 1``). It counts every
            entry, including a softmax layer's initial ones (docs/reference.md §6). During a step a
            store briefly holds its ``C`` entries plus that step's ``B`` new ones.
        evict: the policy, one of :data:`EVICTION_POLICIES` (see the module docstring).
        merge: fold each evicted entry into its nearest kept one (:func:`merge_into_nearest`)
            instead of dropping it; softmax and RBF layers only.
        seed: seed of the ``"random"`` policy (unused by the others).
        slack: once a store exceeds ``capacity``, evict down to ``capacity − slack``
            (``0 ≤ slack < capacity``). With ``0`` every step evicts its ``B`` entries once
            the store is full; with more, an eviction happens every ``≈ slack / B`` steps
            and the store holds between ``capacity − slack`` and ``capacity`` entries. Each
            eviction compacts the store, an ``O(N)`` copy as costly as a forward pass, so a
            slack of a few steps' entries or more amortises it (evicting in blocks, as paged
            KV caches do).

    Raises:
        ValueError: for a capacity that is not an int ``≥ 1`` or an unknown policy;
            :meth:`check` for a layer the budget cannot apply to.
    """

    capacity: int
    evict: str = "oldest"
    merge: bool = False
    seed: int = 0
    slack: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) \
                or self.capacity < 1:
            raise ValueError(f"MemoryBudget: capacity must be an int >= 1 (entries per layer), "
                             f"got {self.capacity!r}")
        if self.evict not in EVICTION_POLICIES:
            raise ValueError(f"MemoryBudget: unknown eviction policy {self.evict!r}; known: "
                             f"{', '.join(EVICTION_POLICIES)}")
        if not isinstance(self.merge, bool):
            raise ValueError(f"MemoryBudget: merge must be True or False, got {self.merge!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"MemoryBudget: seed must be an int >= 0, got {self.seed!r}")
        if isinstance(self.slack, bool) or not isinstance(self.slack, int) \
                or not 0 <= self.slack < self.capacity:
            raise ValueError(f"MemoryBudget: slack must be an int with 0 <= slack < capacity "
                             f"= {self.capacity}, got {self.slack!r}")

    def check(self, layer: GrowingLayer) -> None:
        """Raise ``ValueError`` if this budget cannot apply to ``layer`` (merging into a
        linear or age-weighted layer); :class:`rcdl.optim.grower.Grower` calls it up front."""
        if self.merge:
            _check_mergeable(layer)

    @torch.no_grad()
    def evict_mask(self, layer: GrowingLayer) -> Tensor:  # (N,) bool
        """Which entries of ``layer`` to evict (True) to bring it within the budget.

        All False when the layer holds ``N ≤ capacity`` entries; otherwise exactly
        ``N − (capacity − slack)`` are True. Nothing is changed.
        """
        store = layer.store
        n = len(store)
        mask = torch.zeros(n, dtype=torch.bool, device=store.device)  # (N,)
        if n <= self.capacity:
            return mask
        excess = n - (self.capacity - self.slack)
        if self.evict == "oldest":
            # stable: rows of one step keep their order, so the earlier rows go first
            order = torch.argsort(store.written_at, stable=True)  # (N,) oldest first
        elif self.evict == "newest":
            # the later rows of one step go first, as if written one after the other
            order = torch.argsort(store.written_at.flip(0), stable=True, descending=True)
            order = n - 1 - order  # (N,) newest first
        elif self.evict == "contribution":
            order = torch.sort(contribution_scores(layer), stable=True).indices  # smallest first
        else:  # random
            gen = torch.Generator().manual_seed(self._random_seed(layer))
            order = torch.randperm(n, generator=gen).to(store.device)
        mask[order[:excess]] = True
        return mask

    def apply(self, layer: GrowingLayer, mask: Tensor) -> int:
        """Evict the entries where ``mask (N,)`` is True (from :meth:`evict_mask`), merging
        them first if ``merge``; returns how many were evicted."""
        if not bool(mask.any()):
            return 0
        if self.merge:
            merge_into_nearest(layer, mask)
        return layer.remove_entries(mask)

    def enforce(self, layer: GrowingLayer) -> int:
        """Evict from ``layer`` down to ``capacity``; returns how many entries were evicted."""
        return self.apply(layer, self.evict_mask(layer))

    def _random_seed(self, layer: GrowingLayer) -> int:
        name = zlib.crc32(layer.name.encode("utf-8"))  # stable across processes, unlike hash()
        return (self.seed * 1_000_003 + name * 7919 + int(layer.steps)) % (1 << 63)

    @classmethod
    def from_policy(cls, capacity: int, policy: str, *, seed: int = 0,
                    slack: int = 0) -> MemoryBudget:
        """The budget named by ``policy``: an eviction policy, optionally with ``+merge``
        (e.g. ``"oldest"``, ``"contribution+merge"``); the inverse of :attr:`policy`."""
        evict, plus, suffix = policy.partition("+")
        if plus and suffix != "merge":
            raise ValueError(f"MemoryBudget: unknown policy {policy!r}; write an eviction "
                             f"policy ({', '.join(EVICTION_POLICIES)}), optionally with "
                             f"'+merge'")
        return cls(capacity, evict, merge=bool(plus), seed=seed, slack=slack)

    @property
    def policy(self) -> str:
        """The policy's name, e.g. ``"contribution+merge"`` (see :meth:`from_policy`)."""
        return f"{self.evict}+merge" if self.merge else self.evict

    def describe(self) -> str:
        """E.g. ``2000 entries per layer, evict oldest`` (``..., merged`` with ``merge``,
        ``..., down to 1750`` with a slack)."""
        merged = ", merged" if self.merge else ""
        down = f", down to {self.capacity - self.slack}" if self.slack else ""
        return f"{self.capacity} entries per layer, evict {self.evict}{merged}{down}"
