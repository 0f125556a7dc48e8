"""rcdl.app.experiments.attribution.peer_trak (TRAK from dattri on the ResNet-MLP): the
flat-parameter MLP it hands dattri is the same function with the same gradients, and its
scores are oriented as the measurement reads them (self-influence is the diagonal of the
train-on-train scores).
Skipped without dattri (``pip install 'rcdl[peers]'``)."""

import pytest
import torch
from torch.testing import assert_close

from rcdl.nn.networks import ResNetMLP

pytest.importorskip("dattri", exc_type=ImportError)  # missing or broken: skip
# importing dattri.algorithm imports torch._inductor, whose torch.utils.mkldnn warns that
# torch.jit.script_method is deprecated (torch's own code, not this one)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

from rcdl.app.experiments.attribution import peer_trak as trak_peer  # noqa: E402


def mlp(seed, width=16):
    torch.manual_seed(seed)
    return ResNetMLP(3072, 10, 2, width=width).eval()


def test_flat_mlp_is_the_same_function_with_the_same_gradients():
    model = mlp(0).double()
    flat = trak_peer.FlatMLP(model)
    x = torch.randn(5, 3072, dtype=torch.float64)
    assert_close(flat(x), model(x), rtol=0, atol=0)
    flat(x)[:, 3].sum().backward()
    model(x)[:, 3].sum().backward()
    assert_close(flat.flat.grad, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize("ensemble", [1, 2], ids=["TRAK-1", "TRAK-2"])
def test_self_influence_is_the_diagonal_of_the_train_on_train_scores(ensemble):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3072, generator=gen), torch.randint(0, 10, (40,), generator=gen)
    models = [mlp(seed) for seed in range(ensemble)]
    cfg = trak_peer.PeerConfig(train_size=40, proj_dim=16, grad_batch=16)
    scores, _, _ = trak_peer.trak_scores(models, x, y, x, y, cfg)  # (T, n) = (40, 40)
    influence, _ = trak_peer.trak_self_influence(models, x, y, cfg)  # (40,)
    assert scores.shape == (40, 40) and influence.shape == (40,)
    assert_close(influence, scores.diagonal(), rtol=1e-3, atol=1e-6)


def test_proj_dim_must_be_below_the_training_images():
    with pytest.raises(ValueError, match="proj_dim .512. must be positive and below "
                                         "train_size .500."):
        trak_peer.PeerConfig(train_size=500)
