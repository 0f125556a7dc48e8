"""The half-precision Adam step (rcdl.optim.half_adam): the mode switch, the fallback when
torch.compile fails, and the compiled path against the eager one (marked long: compiling
takes about a minute on two cores)."""

import pytest
import torch

import rcdl.optim.half_adam as half_adam
from rcdl.optim.entry_adam import EntryMoments
from rcdl.optim.half_adam import adam_rows, set_half_adam, use_compiled


def _rows(n=40, w=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, w, generator=gen).to(torch.bfloat16)
    m = 1e-3 * torch.randn(n, w, generator=gen)
    v = 1e-6 * torch.rand(n, w, generator=gen)
    grad = (1e-3 * torch.randn(n, w, generator=gen)).to(torch.bfloat16)
    a, c = 1e3 * (1 + torch.rand(n, generator=gen)), 1e-5 * torch.rand(n, generator=gen)
    return param, m, v, grad, a, c


def _step(param, m, v, grad, a, c, compiled, fused=False):
    adam_rows(param, m, v, grad, a, c, ids=torch.arange(len(param)) + 100,
              seed=torch.tensor(7), step=torch.tensor(3), stream=1, b1=0.9, b2=0.999,
              compiled=compiled, fused=fused)
    return param


def test_modes_and_the_auto_threshold():
    with half_adam.half_adam("eager"):
        assert not use_compiled(1 << 40)
    with half_adam.half_adam("compiled"):
        assert use_compiled(1)
    with half_adam.half_adam("auto"):
        assert use_compiled(half_adam.AUTO_ELEMENTS)
        assert not use_compiled(half_adam.AUTO_ELEMENTS - 1)
    with pytest.raises(ValueError, match="must be one of auto, eager, compiled, fused"):
        set_half_adam("fast")


def test_a_failing_compiler_falls_back_to_the_eager_step_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(half_adam, "_compiled", None)
    monkeypatch.setattr(half_adam, "_compile_failed", False)
    monkeypatch.setattr(torch, "compile", broken)
    eager_in, tried_in = _rows(), _rows()
    expected = _step(*eager_in, compiled=False)
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        got = _step(*tried_in, compiled=True)
    assert torch.equal(got, expected)
    assert torch.equal(tried_in[1], eager_in[1]) and torch.equal(tried_in[2], eager_in[2])
    assert not use_compiled(1 << 40)  # not tried again


def test_the_eager_step_moves_rows_without_bias():
    param, m, v, grad, a, c = _rows(n=2000, w=64)
    param = param.clone()
    exact = param.float() - (0.9 * m + 0.1 * grad.float()) / (
        a[:, None] * (0.999 * v + 0.001 * grad.float() ** 2).sqrt() + c[:, None])
    moved = _step(param, m, v, grad, a, c, compiled=False)
    ulp = (exact.abs() * 2.0**-7).clamp_min(1e-30)
    bias = ((moved.float() - exact) / ulp).mean()
    assert abs(float(bias)) < 0.02  # nearest rounding would leave up to 0.5 ulp of bias


@pytest.mark.long
def test_the_compiled_step_equals_the_eager_one():
    eager_in, compiled_in = _rows(n=300, w=96), _rows(n=300, w=96)
    expected = _step(*eager_in, compiled=False)
    got = _step(*compiled_in, compiled=True)
    for got_moment, moment in zip(compiled_in[1:3], eager_in[1:3], strict=True):  # m, v
        # the same function: float32 rounding apart (lerp may be formed another way)
        torch.testing.assert_close(got_moment, moment, rtol=1e-6,
                                   atol=1e-6 * float(moment.abs().max()))
    ulps = ((got.float() - expected.float()).abs() / (expected.float().abs() * 2.0**-8))
    assert float(ulps.max()) <= 1.0 + 1e-6  # at most one bfloat16 ulp apart
    assert float((got != expected).float().mean()) < 0.01


@pytest.mark.long
def test_a_hybrid_layer_steps_alike_on_the_compiled_and_the_eager_path():
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.nn.rules import ClippedSoftmaxRule
    from rcdl.optim.half_adam import half_adam

    stores = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        layer = HybridSoftmax(64, 48, temperature=1.0, rule=ClippedSoftmaxRule(0.5, 3.0),
                              initial_entries=96, store_dtype=torch.bfloat16, seed=3)
        gen = torch.Generator().manual_seed(1)
        moments = EntryMoments(layer)
        for _ in range(3):
            for leaf in layer.entry_leaves():
                leaf.grad = (1e-2 * torch.randn(leaf.shape, generator=gen)).to(leaf.dtype)
            with half_adam(mode):
                moments.step(1e-3, (0.9, 0.999), 1e-8)
        stores[mode] = (layer.store.keys.float(), layer.store.values.float(),
                        moments.m.keys, moments.v.values)
    for eager, compiled in zip(stores["eager"], stores["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=2.0**-7, atol=1e-6)
    assert float((stores["compiled"][0] != stores["eager"][0]).float().mean()) < 0.01


def test_rounding_to_float16_saturates_instead_of_overflowing_to_inf():
    """float16's largest finite number is 65 504; a finite number past it rounds to it (a cast
    would give inf), while inf and NaN stay what they are."""
    from rcdl.ops.rounding import round_stochastically, rounding_noise

    x = torch.tensor([65_519.0, 65_520.0, 7e4, -7e4, 65_000.0, float("inf"), float("nan")])
    noise = rounding_noise(seed=0, step=1, ids=torch.arange(1), width=len(x))[0]
    for bits in (None, noise):
        got = round_stochastically(x, torch.float16, bits).float()
        assert got[:4].tolist() == [65_504.0, 65_504.0, 65_504.0, -65_504.0]
        assert got[4].item() in (64_992.0, 65_024.0)  # its two neighbours
        assert got[5].item() == float("inf") and got[6].isnan()


def test_adam_past_the_float16_range_keeps_the_entry_finite_and_warns():
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.nn.rules import ClippedSoftmaxRule

    layer = HybridSoftmax(4, 3, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 30.0),
                          initial_entries=2, store_dtype=torch.float16, seed=0)
    layer.store.values[0, 0] = 65_504.0
    keys, values, weights = layer.entry_leaves()
    for leaf in (keys, values, weights):
        leaf.grad = torch.zeros_like(leaf)
    values.grad[0, 0] = -1.0  # Adam moves that value up by lr = 100, past 65 504
    with pytest.warns(RuntimeWarning, match=r"1 of its entries \(the first: id 0\) to ±65504, "
                                            r"the largest finite torch.float16.*bfloat16"):
        EntryMoments(layer).step(100.0, (0.9, 0.999), 1e-8)
    assert torch.isfinite(layer.store.values).all()
    assert layer.store.values[0, 0].item() == 65_504.0


@pytest.mark.long
def test_the_compiled_float16_step_saturates_as_the_eager_one():
    """A compiled kernel may keep a float16 cast in float32, so overflow is tested on the
    float32 value: both paths keep an entry moved past 65 504 at 65 504, not inf."""
    stepped = {}
    for compiled in (False, True):
        param = torch.full((8, 16), 65_500.0).to(torch.float16)
        m, v = torch.zeros(8, 16), torch.zeros(8, 16)
        grad = -torch.ones(8, 16)  # Adam's first step moves every number up by lr = 100
        a, c = torch.full((8,), 1e-2), torch.full((8,), 1e-8)
        stepped[compiled] = _step(param, m, v, grad, a, c, compiled=compiled)
    assert torch.equal(stepped[True], stepped[False])
    assert (stepped[True] == 65_504.0).all()


def test_the_mode_is_an_option_of_the_learner_saved_in_its_state(monkeypatch):
    """EntryAdam(half_adam=...) overrides the process-wide default for its layers, and its
    state dict carries the choice; None follows the default."""
    from rcdl import EntryAdam
    from rcdl.nn.gates import AlwaysGrow
    from rcdl.nn.hybrid import HybridSoftmax
    from rcdl.nn.rules import ClippedSoftmaxRule

    seen = []
    monkeypatch.setattr("rcdl.optim.entry_adam.adam_path",
                        lambda elements, dtype, device, mode=None: seen.append(mode) or "eager")
    layer = HybridSoftmax(8, 3, temperature=1.0, rule=ClippedSoftmaxRule(1.0, 3.0),
                          trigger=AlwaysGrow(), seed=0, store_dtype=torch.bfloat16)
    net = torch.nn.Sequential(layer)
    adam = EntryAdam(net, half_adam="eager")
    net(torch.randn(4, 8)).square().sum().backward()
    adam.step()
    assert seen and set(seen) == {"eager"}
    state = adam.state_dict()
    assert state["param_groups"][0]["half_adam"] == "eager"
    other = EntryAdam(net)
    assert other.param_groups[0]["half_adam"] is None  # the process-wide default
    other.load_state_dict(state)
    assert other.param_groups[0]["half_adam"] == "eager"
    with pytest.raises(ValueError, match="must be one of auto, eager, compiled, fused"):
        EntryAdam(net, half_adam="fast")
    bad = {**state, "param_groups": [{**state["param_groups"][0], "half_adam": "fast"}]}
    with pytest.raises(ValueError, match="half_adam 'fast'"):
        other.load_state_dict(bad)
    assert other.param_groups[0]["half_adam"] == "eager"  # nothing changed


def test_environment_variables_set_defaults_read_at_first_use(monkeypatch):
    from rcdl.options import ProcessDefault

    default = ProcessDefault("test mode", "RCDL_TEST_MODE", ("a", "b"), "a")
    monkeypatch.setenv("RCDL_TEST_MODE", "b")
    assert default.get() == "b" and default.resolve(None) == "b" and default.resolve("a") == "a"
    with default.using("a"):
        assert default.get() == "a"
    assert default.get() == "b"
    monkeypatch.setenv("RCDL_TEST_MODE", "c")
    with pytest.raises(ValueError, match="test mode must be one of a, b, got 'c'"):
        ProcessDefault("test mode", "RCDL_TEST_MODE", ("a", "b"), "a").get()


@pytest.mark.extra("fast-cpu")
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_the_fused_step_equals_the_eager_one(grad_dtype):
    """The numba loop is the eager step element by element (the moments' updates rounded as
    torch's fused multiply-adds round them; the same counter-based noise). Where torch
    rounds otherwise (no FMA) a moved entry may land one bfloat16 ulp apart, as the compiled
    step's may, so that is what is asserted."""
    eager_in, fused_in = _rows(n=37, w=70), _rows(n=37, w=70)
    for rows in (eager_in, fused_in):
        rows[3].data = rows[3].to(grad_dtype)
    expected = _step(*eager_in, compiled=False)
    got = _step(*fused_in, compiled=False, fused=True)
    for got_moment, moment in zip(fused_in[1:3], eager_in[1:3], strict=True):  # m, v
        torch.testing.assert_close(got_moment, moment, rtol=1e-6,
                                   atol=1e-6 * float(moment.abs().max()))
    ulps = ((got.float() - expected.float()).abs() / (expected.float().abs() * 2.0**-8))
    assert float(ulps.max()) <= 1.0 + 1e-6
    assert float((got != expected).float().mean()) < 0.01


@pytest.mark.extra("fast-cpu")
def test_auto_fuses_bfloat16_rows_on_cpu_at_every_size():
    from rcdl.optim.half_adam import adam_path

    with half_adam.half_adam("auto"):
        assert adam_path(1, torch.bfloat16, "cpu") == "fused"
        assert adam_path(1 << 40, torch.bfloat16, "cpu") == "fused"
        assert adam_path(1, torch.float16, "cpu") == "eager"  # numba has no float16 here
        assert adam_path(1 << 40, torch.float16, "cpu") == "compiled"
        assert adam_path(1, torch.bfloat16, "meta") == "eager"  # not a CPU
    with half_adam.half_adam("eager"):
        assert adam_path(1, torch.bfloat16, "cpu") == "eager"
    with half_adam.half_adam("fused"):
        assert adam_path(1, torch.float16, "cpu") == "eager"  # where it does not apply: auto
