"""Optimizers from other dual forms (docs/reference.md §7): FOOF from the Mesa layer, DeltaNet
decay."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from rcdl import FOOF, DeltaNetDecay
from rcdl.app.baseline_optim import make_optimizer

BIAS = [pytest.param(True, id="bias"), pytest.param(False, id="no_bias")]
LOSSES = ["mse", "cross_entropy"]


def batch(n=24, d_in=5, d_out=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen, dtype=torch.float64) + 0.3
    y = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    return x, y


def batch_loss(out, y, name):
    """Batch-mean loss: ``½‖s − y‖²`` per sample (so the Newton step has lr 1) or CE."""
    if name == "mse":
        return 0.5 * (out - y).pow(2).sum(1).mean()
    return F.cross_entropy(out, y.argmax(1))


def augmented(x, bias):  # (B, D̃): the bias is the weight of a constant input 1
    return torch.cat([x, torch.ones_like(x[:, :1])], 1) if bias else x


def stacked(layer):  # [W b] (D_out, D̃)
    w = layer.weight.detach()
    if layer.bias is None:
        return w
    return torch.cat([w, layer.bias.detach()[:, None]], 1)


def per_sample_grads(layer, x, y, loss_name):
    """``g_i = B ∂L/∂s_i`` (B, D_out): per-sample gradients of the batch-mean loss."""
    out = layer(x).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(batch_loss(out, y, loss_name), out)
    return grad * x.shape[0]


# -- FOOF -------------------------------------------------------------------------------

@pytest.mark.parametrize("ema", [0.0, 0.9])
@pytest.mark.parametrize("bias", BIAS)
def test_foof_one_full_batch_step_is_the_newton_step(bias, ema):
    """Squared loss, λ → 0, lr 1, first step (the EMA starts at the batch moment)."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias).double()
    x, y = batch()
    opt = FOOF(layer, lr=1.0, damping=1e-12, ema=ema)
    batch_loss(layer(x), y, "mse").backward()
    opt.step()
    solution = torch.linalg.lstsq(augmented(x, bias), y).solution.T  # (D_out, D̃)
    assert_close(stacked(layer), solution, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("bias", BIAS)
def test_foof_step_equals_mesa_readout(bias, loss_name):
    """From W̃ = 0, one full-batch step gives W̃ q̃ = G (H + Λ)^{-1} q̃ with
    (k, v) = (x̃_i, −lr g_i), g_i per-sample, Λ = B λ I."""
    lr, damping = 0.3, 0.05
    layer = nn.Linear(5, 3, bias=bias).double()
    nn.init.zeros_(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    x, y = batch()
    keys = augmented(x, bias)  # (B, D̃)
    values = -lr * per_sample_grads(layer, x, y, loss_name)  # (B, D_out)
    opt = FOOF(layer, lr=lr, damping=damping)
    batch_loss(layer(x), y, loss_name).backward()
    opt.step()

    q = torch.randn(7, 5, dtype=torch.float64)
    big_g = values.T @ keys  # Σ v kᵀ (D_out, D̃)
    big_h = keys.T @ keys  # Σ k kᵀ (D̃, D̃)
    damped = big_h + x.shape[0] * damping * torch.eye(keys.shape[1], dtype=torch.float64)
    mesa = big_g @ torch.linalg.solve(damped, augmented(q, bias).T)  # (D_out, 7)
    with torch.no_grad():
        assert_close(layer(q), mesa.T, rtol=1e-10, atol=1e-12)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 2)).double()


def linear_inputs(model, x):
    """The input of every nn.Linear of a Sequential, in order."""
    inputs = []
    for module in model:
        if isinstance(module, nn.Linear):
            inputs.append(x)
        x = module(x)
    return inputs


def naive_foof(model, batches, lr, damping, ema, refresh_every, momentum):
    """Dense twin of FOOF with an explicit solve per step (refresh by caching the matrix)."""
    layers = [m for m in model if isinstance(m, nn.Linear)]
    moments, damped, buffers = [None] * 3, [None] * 3, [None] * 3
    for step, (x, y) in enumerate(batches):
        model.zero_grad()
        batch_loss(model(x), y, "mse").backward()
        with torch.no_grad():
            for i, (layer, a) in enumerate(zip(layers, linear_inputs(model, x), strict=True)):
                a = augmented(a, True)
                m = a.T @ a / a.shape[0]
                moments[i] = m if moments[i] is None else ema * moments[i] + (1 - ema) * m
                if step % refresh_every == 0:
                    damped[i] = moments[i] + damping * torch.eye(a.shape[1], dtype=a.dtype)
                grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
                d = torch.linalg.solve(damped[i], grad.T).T
                buffers[i] = d if buffers[i] is None else momentum * buffers[i] + d
                layer.weight -= lr * buffers[i][:, :-1]
                layer.bias -= lr * buffers[i][:, -1]


def toy_batches(steps, n=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.1, 0.5, 1.0, 3.0], dtype=torch.float64)
    for _ in range(steps):
        x = torch.randn(n, 4, generator=gen, dtype=torch.float64) * scales + 0.5
        yield x, torch.stack([torch.sin(x.sum(1)), x[:, 0] * x[:, 3]], 1)


def test_foof_matches_naive_twin_over_several_steps():
    kw = {"lr": 0.1, "damping": 1e-2, "ema": 0.8, "refresh_every": 3, "momentum": 0.7}
    model, reference = mlp(), mlp()
    naive_foof(reference, toy_batches(7), **kw)
    opt = FOOF(model, **kw)
    for x, y in toy_batches(7):
        opt.zero_grad()
        batch_loss(model(x), y, "mse").backward()
        opt.step()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(p, r, rtol=1e-10, atol=1e-12)


def test_foof_trains_an_mlp_faster_than_sgd():
    """Toy regression with badly scaled inputs: same lr, same steps, lower loss."""
    x = torch.cat([xb for xb, _ in toy_batches(8)])
    y = torch.cat([yb for _, yb in toy_batches(8)])

    def train(opt_fn):
        model = mlp()
        opt = opt_fn(model)
        for _ in range(60):
            opt.zero_grad()
            batch_loss(model(x), y, "mse").backward()
            opt.step()
        with torch.no_grad():
            return float(batch_loss(model(x), y, "mse"))

    foof = train(lambda m: FOOF(m, lr=0.02, damping=1e-3, ema=0.9, refresh_every=5))
    sgd = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.02))
    assert foof < 0.6 * sgd  # measured: 0.20 vs 0.46


def test_foof_accumulates_inputs_over_several_forward_passes():
    """Two half-batch forward/backward passes, then one step = one full-batch step;
    inputs with extra leading dims are flattened."""
    x, y = batch(n=24)
    full = nn.Linear(5, 3).double()
    halves = copy.deepcopy(full)
    opt_full = FOOF(full, lr=0.5, damping=1e-2)
    batch_loss(full(x.reshape(4, 6, 5)).reshape(24, 3), y, "mse").backward()
    opt_full.step()
    opt_halves = FOOF(halves, lr=0.5, damping=1e-2)
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        (batch_loss(halves(xs), ys, "mse") / 2).backward()
    opt_halves.step()
    assert_close(stacked(halves), stacked(full), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [FOOF, DeltaNetDecay])
def test_state_dict_round_trip_resumes_exactly(cls):
    kw = ({"lr": 0.1, "damping": 1e-2, "ema": 0.8, "refresh_every": 4, "momentum": 0.7}
          if cls is FOOF else {"lr": 0.1, "decay": 0.05, "momentum": 0.7})
    batches = list(toy_batches(6))

    def run(model, opt, bs):
        for x, y in bs:
            opt.zero_grad()
            batch_loss(model(x), y, "mse").backward()
            opt.step()

    model = mlp()
    opt = cls(model, **kw)
    run(model, opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    run(model, opt, batches[3:])

    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only: the state holds only plain types
    resumed = mlp(seed=5)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = cls(resumed, **{**kw, "lr": 123.0})  # hyperparameters come from the checkpoint
    opt2.load_state_dict(checkpoint["opt"])
    run(resumed, opt2, batches[3:])
    for p, r in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, r)


# -- DeltaNet decay ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [pytest.param(1, id="B=1"), pytest.param(24, id="B=24")])
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("bias", BIAS)
def test_deltanet_step_is_a_delta_rule_step(bias, loss_name, n):
    """S ← S − (b/B) Σ (S k_i − v_i) k_iᵀ with (k, v) = (x̃_i, −η g_i), b = λ, η = lr/λ."""
    lr, decay = 0.2, 0.05
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias).double()
    x, y = batch(n=n)
    s0, keys = stacked(layer), augmented(x, bias)  # (D_out, D̃), (B, D̃)
    b, eta = decay, lr / decay
    values = -eta * per_sample_grads(layer, x, y, loss_name)  # (B, D_out)
    delta_rule = s0 - b / n * (keys @ s0.T - values).T @ keys

    opt = DeltaNetDecay(layer, lr=lr, decay=decay)
    batch_loss(layer(x), y, loss_name).backward()
    opt.step()
    assert_close(stacked(layer), delta_rule, rtol=1e-12, atol=1e-12)


def test_deltanet_decay_forgets_only_along_the_inputs():
    """Inputs with a zero last coordinate: that column of W is untouched by DeltaNet decay
    and shrinks under uniform weight decay; along the inputs the two differ by λ W C."""
    lr, decay = 0.1, 0.2
    x, y = batch()
    x[:, -1] = 0
    torch.manual_seed(0)
    delta_layer = nn.Linear(5, 3).double()
    wd_layer, sgd_layer = copy.deepcopy(delta_layer), copy.deepcopy(delta_layer)
    s0 = stacked(delta_layer).clone()  # W̃₀ (D_out, D̃)
    opts = [DeltaNetDecay(delta_layer, lr=lr, decay=decay),
            torch.optim.SGD(wd_layer.parameters(), lr=lr, weight_decay=decay / lr),
            torch.optim.SGD(sgd_layer.parameters(), lr=lr)]
    for layer, opt in zip([delta_layer, wd_layer, sgd_layer], opts, strict=True):
        batch_loss(layer(x), y, "mse").backward()
        opt.step()

    assert torch.equal(delta_layer.weight[:, -1], s0[:, 4])  # orthogonal: untouched
    assert_close(wd_layer.weight[:, -1], (1 - decay) * s0[:, 4])  # uniform: shrinks
    keys = augmented(x, True)  # (B, D̃)
    moment = keys.T @ keys / keys.shape[0]  # (D̃, D̃)
    assert_close(stacked(delta_layer), stacked(sgd_layer) - decay * s0 @ moment)
    assert_close(stacked(wd_layer), stacked(sgd_layer) - decay * s0)


def test_deltanet_without_decay_is_sgd():
    model, reference = mlp(), mlp()
    opt = DeltaNetDecay(model, lr=0.1, decay=0.0, momentum=0.8)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.8)
    for (x, y), _ in zip(toy_batches(4), range(4), strict=True):
        for m, o in [(model, opt), (reference, ref_opt)]:
            o.zero_grad()
            batch_loss(m(x), y, "mse").backward()
            o.step()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(p, r, rtol=1e-12, atol=1e-12)


# -- errors and wiring ------------------------------------------------------------------

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # (B, 6)
        return self.head(self.conv(x[:, None]).flatten(1))


@pytest.mark.parametrize("cls", [FOOF, DeltaNetDecay])
def test_non_linear_parameters_are_refused_by_name(cls):
    with pytest.raises(ValueError, match=r"'conv\.weight' \(Conv1d\), 'conv\.bias' \(Conv1d\)"):
        cls(ConvNet())
    emb = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0\.weight' \(Embedding\).*sgd_fallback=True"):
        cls(emb)
    with pytest.raises(ValueError, match="has no nn.Linear layer"):
        cls(nn.Conv1d(1, 2, 3))
    with pytest.raises(TypeError, match="takes the model"):
        cls(list(nn.Linear(2, 2).parameters()))


@pytest.mark.parametrize("cls", [FOOF, DeltaNetDecay])
def test_sgd_fallback_trains_other_parameters_with_plain_sgd(cls):
    model = ConvNet().double()
    conv0 = copy.deepcopy(model.conv)
    opt = cls(model, lr=0.1, sgd_fallback=True)
    x = torch.randn(4, 6, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    expected = [p - 0.1 * p.grad for p in model.conv.parameters()]
    opt.step()
    assert [g["kind"] for g in opt.param_groups] == ["linear", "sgd"]
    for p, e, p0 in zip(model.conv.parameters(), expected, conv0.parameters(), strict=True):
        assert_close(p, e)
        assert not torch.equal(p, p0)


@pytest.mark.parametrize(("kw", "match"), [
    ({"damping": 0.0}, r"damping must be > 0, got 0\.0"),
    ({"ema": 1.0}, r"ema must be in \[0, 1\), got 1\.0"),
    ({"refresh_every": 0}, "refresh_every must be an int >= 1, got 0"),
    ({"refresh_every": 2.5}, "refresh_every must be an int >= 1, got 2.5"),
    ({"lr": -1.0}, "lr must be >= 0"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
])
def test_foof_rejects_bad_hyperparameters(kw, match):
    with pytest.raises(ValueError, match=match):
        FOOF(nn.Linear(2, 2), **kw)


def test_deltanet_rejects_negative_decay():
    with pytest.raises(ValueError, match="decay must be >= 0, got -0.1"):
        DeltaNetDecay(nn.Linear(2, 2), decay=-0.1)


def test_tied_linear_weights_are_refused():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    with pytest.raises(ValueError, match="shared by the nn.Linear layers '0' and '1'"):
        FOOF(nn.Sequential(a, b))


@pytest.mark.parametrize("cls", [FOOF, DeltaNetDecay])
def test_step_without_captured_inputs_names_the_layer(cls):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    opt = cls(model, decay=0.1) if cls is DeltaNetDecay else cls(model)
    with torch.no_grad():
        out = model(torch.randn(5, 3, dtype=torch.float64))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="layer '0' has a gradient but no input was captured"):
        opt.step()
    for k, v in model.state_dict().items():  # nothing was updated
        assert torch.equal(v, before[k])
    assert out.shape == (5, 2)


def test_foof_refuses_non_finite_inputs():
    layer = nn.Linear(3, 2).double()
    opt = FOOF(layer)
    x = torch.randn(4, 3, dtype=torch.float64)
    x[0, 1] = float("nan")
    layer(x).sum().backward()
    with pytest.raises(RuntimeError, match="input moment of layer '<model>' is not finite"):
        opt.step()


@pytest.mark.parametrize(("name", "cls"), [("foof", FOOF), ("deltanet", DeltaNetDecay)])
def test_make_optimizer_builds_the_dual_optimizers(name, cls):
    model = mlp()
    opt = make_optimizer(name, model, lr=0.01)
    assert isinstance(opt, cls)
    assert opt.param_groups[0]["lr"] == 0.01
    x, y = next(toy_batches(1))
    batch_loss(model(x), y, "mse").backward()
    opt.step()


def test_adamw_at_the_tuned_settings_equals_adam_in_float32():
    """lr·wd = 1e−8 is below float32's resolution at 1: the decoupled decay is a no-op
    there (the full-scale mlp-adam and mlp-adamw runs ended identical), not in float64."""
    for dtype, identical in ((torch.float32, True), (torch.float64, False)):
        torch.manual_seed(0)
        nets = [nn.Linear(8, 4).to(dtype) for _ in range(2)]
        nets[1].load_state_dict(nets[0].state_dict())
        opts = [make_optimizer("adam", nets[0]), make_optimizer("adamw", nets[1])]
        x = torch.randn(16, 8, dtype=dtype)
        for _ in range(20):
            for net, opt in zip(nets, opts, strict=True):
                opt.zero_grad()
                net(x).square().mean().backward()
                opt.step()
        pairs = zip(nets[0].parameters(), nets[1].parameters(), strict=True)
        same = all(torch.equal(a, b) for a, b in pairs)
        assert same is identical
