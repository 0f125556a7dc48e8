"""`explain` correct wherever a model runs (docs/attribution.md): an in-place activation
after a growing layer, ordinary parameters beside the growing layers, and a growing layer
called twice in one forward pass. Each case failed before its fix."""

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from rcdl import GrowingLayer
from rcdl.memory.attribution import explain
from rcdl.nn.rules import FunctionalSGD
from rcdl.optim._step import commit


def _filled(d_in: int, d_out: int, seed: int, n: int = 40) -> GrowingLayer:
    gen = torch.Generator().manual_seed(seed)
    layer = GrowingLayer(d_in, d_out, kernel="rbf", temperature=0.5, dtype=torch.float64,
                         rule=FunctionalSGD(0.1))
    commit(layer, (torch.randn(n, d_in, generator=gen, dtype=torch.float64),
                  torch.randn(n, d_out, generator=gen, dtype=torch.float64),
                  torch.ones(n, dtype=torch.float64)))
    return layer


def _two_layers(inplace: bool) -> nn.Module:
    return nn.Sequential(_filled(5, 6, 0), nn.LeakyReLU(0.1, inplace=inplace),
                         _filled(6, 3, 1))


def test_an_inplace_activation_after_a_growing_layer_changes_nothing():
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    plain, inplace = explain(_two_layers(False), x, k=5), explain(_two_layers(True), x, k=5)
    assert torch.equal(plain.target, inplace.target)
    for name in plain.layers:
        assert_close(inplace.layers[name][0], plain.layers[name][0])
        assert torch.equal(inplace.layers[name][1], plain.layers[name][1])


def test_explain_leaves_no_gradient_on_the_models_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5).double(), _filled(5, 3, 0))
    x = torch.randn(4, 5, dtype=torch.float64)
    explain(model, x)
    assert all(p.grad is None for p in model.parameters())
    model[0].weight.grad = torch.ones_like(model[0].weight)  # a gradient already there
    explain(model, x)
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.readout = _filled(5, 5, 0), _filled(5, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.block(self.block(x)))


def test_a_growing_layer_called_twice_in_one_forward_is_refused():
    with pytest.raises(ValueError, match="block.*called 2 times"):
        explain(_Tied(), torch.randn(4, 5, dtype=torch.float64))


def test_explain_sums_each_inputs_token_rows_in_the_rcdl_vit():
    """A growing layer inside the ViT sees ``(B, S, d)`` tokens: an entry's contribution
    to an image's output is the sum over the image's tokens, ``Σ_t ⟨u_t, share_j(q_t)⟩``."""
    import torch.nn.functional as F

    from rcdl import Grower
    from rcdl.memory.attribution import entry_contributions
    from rcdl.memory.provenance import samples
    from rcdl.nn.layers import growing_layers
    from rcdl.nn.vit import rcdl_vit
    from rcdl.optim.entry_adam import EntryAdam

    torch.manual_seed(0)
    model = rcdl_vit(temperature=1.0, tau=0.0, initial_entries=4, patch_size=8, width=16,
                     depth=2, heads=2)
    optimizer, grower = EntryAdam(model, lr=1e-3), Grower(model)
    x, y = torch.randn(3, 3072), torch.tensor([0, 1, 2])
    with samples(model, torch.tensor([10, 11, 12])):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        grower.step()
    probe = torch.randn(2, 3072)
    got = explain(model, probe, k=3)
    assert set(got.samples[1].flatten().tolist()) <= {10, 11, 12}
    name, layer = growing_layers(model)[-1]
    kept: dict[str, torch.Tensor] = {}
    h_in = layer.register_forward_pre_hook(lambda m, a: kept.__setitem__("q", a[0].detach()))
    h_out = layer.register_forward_hook(lambda m, a, out: kept.__setitem__("s", out))
    model.eval()
    logits = model(probe)
    h_in.remove()
    h_out.remove()
    f = logits.gather(1, got.target[:, None]).sum()
    (u,) = torch.autograd.grad(f, kept["s"])
    q = kept["q"]  # (2, S, d)
    contrib = entry_contributions(layer, q.reshape(-1, 16), u.reshape(-1, 16))  # (2·S, N)
    per_image = contrib.view(2, q.shape[1], -1).sum(1)  # (2, N)
    top = per_image.topk(3, dim=1)
    assert_close(got.layers[name][0], top.values, rtol=1e-4, atol=1e-6)
    assert torch.equal(got.layers[name][1], layer.store.ids[top.indices])


def test_explain_refuses_a_model_that_answers_by_top_k_retrieval():
    """In top-k mode the output rests on each query's k retrieved rows (and, for the
    softmax, their own denominator); shares over every entry would not sum to it."""
    from rcdl.retrieval.topk import use_exact, use_topk

    model = _two_layers(False)
    x = torch.randn(4, 5, dtype=torch.float64)
    exact = explain(model, x, k=3)
    use_topk(model, 5, backend="exact")
    with pytest.raises(ValueError, match="top-k retrieval.*use_exact"):
        explain(model, x, k=3)
    use_exact(model)
    again = explain(model, x, k=3)
    assert_close(again.layers["2"][0], exact.layers["2"][0])
