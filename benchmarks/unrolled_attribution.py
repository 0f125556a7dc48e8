"""Attribution that models training: do the readout's later writes, replayed to first
order, predict retraining better than the stored model's shares?

LDS (``rcdl reproduce attribution``, docs/attribution.md) compares a score with models
retrained on random halves of the training images. Removing a sample from training does more
than delete its entries: every later step sees a different model and writes different
entries. A growing model knows each entry's step, so part of that can be computed. For a
readout that does not normalise (RBF, linear, Laplacian) trained by per-sample functional SGD
on the cross-entropy, entry ``u`` (written at step ``t_u``) holds ``v_u = −η (p_u − y_u)``,
with ``p_u`` the softmax of the readout's answer to its own key ``k_u`` from the entries
written before it (so ``p_u = y_u − v_u / η`` is read off the store). Scale entry ``i``'s
value by ``1 − ε``: every later answer ``s_u`` moves, then its value, then the answers after
it. To first order in ``ε``, with ``J_u = diag(p_u) − p_u p_uᵀ`` (the softmax's Jacobian),
``a_j(x) = w_j φ(x, k_j)`` and ``Φ_uj = w_j φ(k_u, k_j)``, the derivative of ``⟨d, s(x)⟩`` is
``−⟨λ_i(x), v_i⟩`` with the adjoint

    λ_j(x) = a_j(x) d − η Σ_{u : t_u > t_j} Φ_uj J_u λ_u(x)            (C,)

solved backwards over the steps (``readout_cascade``). Its first term alone is the entry's
share (what ``rcdl.explain`` gives for the readout); the sum is the *cascade* through the
later writes; stopping after one later write is the *one-level* unroll. Keys are held fixed:
the layers below also change when a sample is removed, which this leaves out.

The script measures, on the committed LDS protocol at a chosen scale, the LDS of the readout's
shares, of the shares with the one-level unroll and with the whole cascade, and their cost
beside one training run. And it measures what any score can reach: the *seed ceiling*, the
Spearman correlation over the halves between the margins of models retrained on each half
with two different seeds (the retrained margin's part that the half alone determines; the
LDS protocol retrains each half with one seed, so no score of the subset alone predicts the
rest).

``--check`` first verifies the cascade in float64 against replaying a small readout's writes
with one entry's value scaled by ``1 ± ε`` (a central difference), and exits.

Run: ``python benchmarks/unrolled_attribution.py --data-dir DIR [--model rbf]
[--train-size 2000] [--test-size 200] [--halves 20]`` (``--check`` alone: a second).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from rcdl.app.cifar import load_subsets
from rcdl.app.experiments.attribution_exp import (
    FIRST_HALF_SEED,
    AttributionConfig,
    attribution_scores,
    half_masks,
    half_sums,
    margins,
    spearman,
)
from rcdl.app.recipes import train_model
from rcdl.app.rundir import describe_machine
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.layers import GrowingLayer, GrowingRBF, growing_layers
from rcdl.nn.networks import layer_input
from rcdl.nn.rules import FunctionalSGD
from rcdl.ops.attention import shares
from rcdl.optim.grower import Grower
from rcdl.train.loop import train_step

SECOND_SEED = 1000  # the seed-ceiling retrain of half m uses seed SECOND_SEED + m


def _kernel_values(layer: GrowingLayer, q: Tensor) -> Tensor:  # (B, N) float64
    """``w_j φ(q_b, k_j)`` for every query and entry, through the attention op's shares."""
    store = layer.store
    ones = layer.entries(values=torch.ones(len(store), 1, dtype=store.values.dtype))
    return shares(q.to(store.keys.dtype), ones,
                  torch.ones(len(q), 1, dtype=store.keys.dtype)).double()


def readout_cascade(layer: GrowingLayer, q: Tensor, d: Tensor) -> dict[str, Tensor]:
    """For queries ``q (B, d_in)`` (the readout's inputs) and directions ``d (B, C)``:
    ``share``, ``one_level`` and ``cascade`` ``(B, N)``, each entry's ``⟨λ_j, v_j⟩`` with
    ``λ`` the adjoint truncated to the direct term, to one later write and solved whole
    (module docstring); rows in the store's order."""
    rule = layer.rule
    if (layer.kernel.normalised or not isinstance(rule, FunctionalSGD) or not rule.per_sample
            or not rule.ages.trivial):
        raise ValueError("readout_cascade: needs a readout that does not normalise, trained by "
                         "per-sample FunctionalSGD without weight decay or momentum; got "
                         f"{type(layer).__name__} with {rule}")
    store = layer.store
    eta, values, steps = rule.lr, store.values.double(), store.written_at
    classes = values.shape[1]
    p = F.one_hot(values.argmax(1), classes).double() - values / eta  # (N, C): p_u
    a = _kernel_values(layer, q)  # (B, N)
    phi = _kernel_values(layer, store.keys) * (steps[:, None] > steps[None, :])  # (N_u, N_j)
    d = d.double()
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


def _replay(layer: GrowingLayer, scale: Tensor) -> Tensor:  # (N, C)
    """The readout's values written again in step order, with entry ``j``'s value scaled
    by ``scale[j]`` (keys fixed, labels from the stored values)."""
    store = layer.store
    eta, steps = layer.rule.lr, store.written_at
    values = store.values.double()
    labels = F.one_hot(values.argmax(1), values.shape[1]).double()
    phi = _kernel_values(layer, store.keys)
    new = torch.zeros_like(values)
    for step in steps.unique():
        rows = steps == step
        before = steps < step
        s = phi[rows][:, before] @ (new[before] * scale[before, None])  # (b, C)
        new[rows] = -eta * (s.softmax(1) - labels[rows])
    return new * scale[:, None]


def check(eps: float = 1e-6) -> float:
    """The cascade against a central difference of the replayed readout, float64; returns
    the largest relative error."""
    torch.manual_seed(0)
    layer = GrowingRBF(6, 4, temperature=1.0, rule=FunctionalSGD(2.0)).double()
    x, y = torch.randn(24, 6, dtype=torch.float64), torch.randint(0, 4, (24,))
    grower = Grower(layer)
    for begin in range(0, 24, 3):  # batches of 3: entries of one step do not see each other
        train_step(layer, x[begin:begin + 3], y[begin:begin + 3], F.cross_entropy,
                   grower=grower)
    store = layer.store
    assert torch.allclose(_replay(layer, torch.ones(len(store), dtype=torch.float64)),
                          store.values.double()), "the replay does not rewrite the store"
    q, d = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    a = _kernel_values(layer, q)  # (B, N)
    found = readout_cascade(layer, q, d)["cascade"]
    worst = 0.0
    for j in range(len(store)):
        scale = torch.ones(len(store), dtype=torch.float64)
        outs = []
        for sign in (1, -1):
            scale[j] = 1 + sign * eps
            outs.append(((a @ _replay(layer, scale)) * d).sum(1))
        numeric = (outs[0] - outs[1]) / (2 * eps)  # (B,): d⟨d, s⟩ / d(scale_j)
        worst = max(worst, float(((numeric - found[:, j]).abs()
                                  / numeric.abs().clamp_min(1e-8)).max()))
    return worst


def _per_sample(effect: Tensor, owners: Tensor, n: int) -> Tensor:  # (T, n)
    known = owners != UNKNOWN
    out = torch.zeros(effect.shape[0], n, dtype=torch.float64)
    return out.index_add_(1, owners[known], effect[:, known])


def _mean_finite(r: Tensor) -> float:
    return float(r[torch.isfinite(r)].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify the cascade, then exit")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--model", default="rbf")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--halves", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.check:
        print(f"cascade against the replayed readout: largest relative error {check():.2e}")
        return
    torch.set_num_threads(args.threads)
    cfg = AttributionConfig(models=(args.model,), train_size=args.train_size,
                            test_size=args.test_size, halves=args.halves,
                            data_dir=args.data_dir)
    data = load_subsets("cifar10", cfg)
    x, y, xt, yt = data.x_train, data.y_train, data.x_test, data.y_test
    n = len(x)
    evaluation = (xt[:16], yt[:16])
    start = time.perf_counter()
    model, _ = train_model(args.model, 0, x, y, evaluation)
    seconds = {"train": time.perf_counter() - start}
    start = time.perf_counter()
    scores = attribution_scores(model, xt, yt, n)
    seconds["shares (every layer, explain)"] = time.perf_counter() - start
    readout = growing_layers(model)[-1][1]
    owners = entry_samples(readout)
    cascade_ok = True
    try:
        start = time.perf_counter()
        q = layer_input(model, readout, xt)
        found = readout_cascade(readout, q, F.one_hot(yt, readout.d_out))
        seconds["readout cascade (all three)"] = time.perf_counter() - start
        for key in ("one_level", "cascade"):
            scores[f"readout, {key.replace('_', '-')}"] = _per_sample(found[key], owners, n)
    except ValueError as err:
        cascade_ok = False
        print(f"no cascade for {args.model}: {err}")
    masks = half_masks(n, args.halves)
    retrained, again = [], []
    start = time.perf_counter()
    for m, mask in enumerate(masks):
        for seed, out in ((FIRST_HALF_SEED + m, retrained), (SECOND_SEED + m, again)):
            half, _ = train_model(args.model, seed, x[mask], y[mask], evaluation)
            out.append(margins(half, xt, yt))
        print(f"half {m + 1}/{args.halves} retrained twice", flush=True)
    seconds["retraining, per model"] = (time.perf_counter() - start) / (2 * args.halves)
    retrained_t, again_t = torch.stack(retrained), torch.stack(again)
    predicted = half_sums(scores, masks)  # (M, V, T)
    ceiling = spearman(again_t, retrained_t)
    result = {
        "model": args.model, "train_size": n, "test_size": len(xt), "halves": args.halves,
        "lds": {k: _mean_finite(spearman(predicted[:, v], retrained_t))
                for v, k in enumerate(scores)},
        "seed_ceiling": _mean_finite(ceiling),
        "seconds": seconds, "cascade": cascade_ok,
        "machine": describe_machine("cpu"),  # the CPU's model and speed flags, torch, threads
    }  # fmt: skip
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
