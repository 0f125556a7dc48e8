"""The networks' RMS norm is torch's ``nn.RMSNorm`` without its affine weight; it equals the
formula of docs/reference.md §6, ``x / sqrt(mean(x²) + 1e−6)``, in outputs and gradients,
and bit for bit in float32 (so runs made with the earlier hand-written norm reproduce)."""

import pytest
import torch

from rcdl.nn.networks import rms_norm


def _formula(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("width", [1, 7, 64, 3072])
def test_rms_norm_is_the_formula_in_float64(width):
    x = (3 * torch.randn(5, 4, width, dtype=torch.float64)).requires_grad_()
    y = x.detach().clone().requires_grad_()
    out, ref = rms_norm(width)(x), _formula(y)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(ref)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)


def test_rms_norm_gradcheck_and_no_parameters():
    norm = rms_norm(6)
    assert list(norm.parameters()) == [] and norm.state_dict() == {}
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


def test_rms_norm_is_bit_identical_to_the_formula_in_float32():
    x = 3 * torch.randn(500, 3072, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rms_norm(3072)(x), _formula(x))
