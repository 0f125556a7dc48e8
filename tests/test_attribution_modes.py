"""Attribution under the layers' other modes: the shares sum to the output in every
half-precision product mode (rcdl.ops.half), and what holds for exact attention only is
refused for a model in top-k retrieval mode (rcdl.retrieval.topk), naming the layers."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rcdl import Grower, GrowingLayer, GrowingRBFNet, GrowingSoftmaxNet, use_exact, use_topk
from rcdl.memory.attribution import deletion_effects, entry_contributions, explain
from rcdl.memory.leave_one_out import leave_one_out, left_out_attention
from rcdl.nn.backends import use_retrieval
from rcdl.nn.layers import growing_layers
from rcdl.nn.rules import ClippedSoftmaxRule, FunctionalSGD
from rcdl.ops import widen
from rcdl.ops.half import half_products
from rcdl.optim._step import commit
from tiny_nets import tiny_net, train_with_samples

D_IN, D_OUT, N, B = 16, 4, 600, 6
MODES = ["native", "float32", pytest.param("widen", marks=pytest.mark.skipif(
    not widen.available(), reason="the widened products need numba")), "auto"]


def bfloat16_layer(kernel: str) -> GrowingLayer:
    """A float32 layer over a bfloat16 store of ``N`` entries."""
    gen = torch.Generator().manual_seed(0)
    layer = GrowingLayer(D_IN, D_OUT, kernel=kernel, temperature=1.0, rule=FunctionalSGD(0.1),
                         store_dtype=torch.bfloat16, chunk_size=128)
    commit(layer, (layer.query_keys(torch.randn(N, D_IN, generator=gen)),
                  torch.randn(N, D_OUT, generator=gen), torch.rand(N, generator=gen) + 0.1))
    return layer


@pytest.mark.parametrize("kernel", ["rbf", "softmax"])
@pytest.mark.parametrize("mode", MODES)
def test_a_half_stores_shares_sum_to_its_float32_products_output_in_every_mode(kernel, mode):
    """Native products round each chunk's sum over entries to bfloat16, which no split into
    entries reproduces: the shares are those of the output with float32 products, to
    float32's rounding, whatever mode the products of the forward pass run in."""
    layer = bfloat16_layer(kernel)
    x = torch.randn(B, D_IN, generator=torch.Generator().manual_seed(1))
    eye = torch.eye(D_OUT)
    with half_products(mode):
        total = torch.stack([entry_contributions(layer, x, eye[i].expand(B, D_OUT)).sum(1)
                             for i in range(D_OUT)], dim=1)  # (B, d_out)
    with half_products("float32"), torch.no_grad():
        out = layer.attend(layer.query_keys(x))  # (B, d_out)
    assert_close(total, out, rtol=1e-5, atol=1e-5 * float(out.abs().max()))


def _readout_input(model: torch.nn.Module, readout: GrowingLayer, x: torch.Tensor
                   ) -> torch.Tensor:
    seen = {}
    handle = readout.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model.eval()(x)
    handle.remove()
    return seen["x"]


@pytest.mark.parametrize("net", ["rbf", "gws"])
@pytest.mark.parametrize("mode", MODES)
def test_explain_reports_the_output_its_readout_shares_sum_to_in_every_mode(net, mode):
    torch.manual_seed(0)
    d, classes = 8, 3
    if net == "rbf":
        model = GrowingRBFNet(d, classes, 2, temperature=1.0, rule=FunctionalSGD(1.0),
                              store_dtype=torch.bfloat16)
    else:
        model = GrowingSoftmaxNet(d, classes, 2, temperature=1.0,
                                  rule=ClippedSoftmaxRule(0.1, 3.0), store_dtype=torch.bfloat16)
    grower = Grower(model)
    x = torch.randn(160, d)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    for i in range(0, 160, 32):
        F.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
        grower.step()
        grower.zero_grad()
    x_test = torch.randn(5, d)
    readout_name, readout = growing_layers(model)[-1]
    with half_products(mode):
        exp = explain(model, x_test, k=len(readout.store))
    with half_products("float32"), torch.no_grad():
        logits = model.eval()(x_test)
        initial = logits - readout.attend(readout.query_keys(
            _readout_input(model, readout, x_test)))  # the part no entry holds (if any)
    # the readout's shares sum to the explained output, to float32's rounding
    expected = exp.output - initial.gather(1, exp.target[:, None]).squeeze(1)
    values, _ = exp.layers[readout_name]
    assert_close(values.sum(1), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # and that output is the model's with float32 products of its stored numbers
    assert_close(exp.output, logits.gather(1, exp.target[:, None]).squeeze(1),
                 rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module", params=["gws", "rbf"])
def topk_net(request):
    """A small trained net of each kind, every growing layer in top-k mode (k = 4, exact
    index)."""
    net = tiny_net(request.param, 6, 3, depth=2, gws_rule=(0.5, 2.0))
    x = torch.randn(24, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    train_with_samples(net, x, torch.arange(24) % 3, 4)
    use_topk(net, 4, backend="exact")
    return net, x


def test_leave_one_out_refuses_a_model_in_topk_mode_and_says_how_to_proceed(topk_net):
    """Deleting one of a query's retrieved rows lets its k+1-th row in: the corrections over
    the whole store would add exact attention's terms to a top-k output."""
    net, x = topk_net
    with pytest.raises(ValueError, match=r"leave_one_out: growing layers \['blocks\.0', "
                       r"'blocks\.1', 'readout'\] answer by top-k retrieval.*\(k\+1\)-th row"
                       r".*use_exact\(model\).*layer\.retrieval = None"):
        leave_one_out(net, x[:3], torch.arange(3))
    readout = dict(growing_layers(net))["readout"]
    with pytest.raises(ValueError, match=r"left_out_attention: growing layers \['readout'\]"):
        left_out_attention(readout, x[:3], torch.arange(3))
    assert all(layer.retrieval is not None for _, layer in growing_layers(net))  # unchanged


def test_the_layer_functions_refuse_a_layer_in_topk_mode(topk_net):
    net, x = topk_net
    readout = dict(growing_layers(net))["readout"]
    q, u = torch.randn(3, readout.d_in, dtype=torch.float64), torch.ones(3, 3,
                                                                          dtype=torch.float64)
    with pytest.raises(ValueError, match=r"entry_contributions: growing layers \['readout'\] "
                       r"answer by top-k retrieval.*use_exact"):
        entry_contributions(readout, q, u)
    with pytest.raises(ValueError, match=r"deletion_effects: growing layers \['readout'\] "
                       r"answer by top-k retrieval.*\(k\+1\)-th row.*use_exact"):
        deletion_effects(readout, q, u)
    with pytest.raises(ValueError, match=r"explain: growing layers \['blocks\.0', 'blocks\.1', "
                       r"'readout'\] answer by top-k retrieval.*use_exact"):
        explain(net, x[:3])


def test_the_refusals_way_out_switches_the_layers_to_exact_attention_for_the_call(topk_net):
    """The message's per-layer recipe: exact attention for the call, the same top-k modes
    (with their indices) after; the answer is exact attention's."""
    net, x = topk_net
    modes = {name: layer.retrieval for name, layer in growing_layers(net)}
    for _, layer in growing_layers(net):
        use_retrieval(layer, None)
    try:
        got = leave_one_out(net, x[:3], torch.arange(3))
    finally:
        for name, layer in growing_layers(net):
            use_retrieval(layer, modes[name])
    exact = use_exact(copy.deepcopy(net))
    assert_close(got, leave_one_out(exact, x[:3], torch.arange(3)), rtol=0, atol=0)
    assert all(layer.retrieval is modes[name] for name, layer in growing_layers(net))
