"""The Triton path checks itself before it is trusted (rcdl.ops.triton_attention,
docs/precision.md "The Triton kernel"): at its first call per device, dtypes and kernel it
compares one small call with the streaming path, outputs and every gradient; on a mismatch or
an error it warns once, naming the kernel and the error, and the streaming path computes those
calls. The checks' outcome is recorded in a run's ``environment.json``.

On CPU through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported, as in
tests/test_triton_attention.py), with the check asked for (on CUDA it is the default) and
blocks of 16 so that the check's small call spans several blocks and splits. A failure is
injected by patching the path's backward (a wrong query gradient, the forward right) or its
forward (an error, as a kernel that does not compile for the device raises).
"""

import json
import os
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see the module docstring)

import pytest  # noqa: E402
import torch  # noqa: E402

from rcdl.app.rundir import RunDir  # noqa: E402
from rcdl.ops import triton_attention  # noqa: E402
from rcdl.ops.attention import attend, path_for, register_path, unregister_path  # noqa: E402
from rcdl.ops.entries import Entries  # noqa: E402
from rcdl.ops.streaming import STREAMING  # noqa: E402
from rcdl.ops.triton_attention import (  # noqa: E402
    KERNEL_CODES,
    TritonAttention,
    TritonPathWarning,
    check_against_streaming,
    triton_paths,
)

pytestmark = pytest.mark.extra("triton")

SMALL = {"block_b": 16, "block_n": 16, "block_d": 16, "block_v": 16}


@pytest.fixture
def checked_path(monkeypatch):
    """A Triton path that checks itself, registered for CPU tensors; no check made yet."""
    monkeypatch.setattr(triton_attention, "_CHECKS", {})
    path = register_path(TritonAttention(**SMALL, check=True), device="cpu",
                         dtypes=[torch.float32, torch.bfloat16], kernels=list(KERNEL_CODES))
    yield path
    unregister_path(path)


def call(kernel="softmax", store=torch.bfloat16, path=None):
    """A training call's output and gradients w.r.t. the queries, keys, values and weights
    (float32 queries over a ``store`` store), on ``path`` or the one the op picks."""
    gen = torch.Generator().manual_seed(1)
    leaves = [torch.randn(6, 20, generator=gen), torch.randn(40, 20, generator=gen).to(store),
              torch.randn(40, 3, generator=gen).to(store), torch.rand(40, generator=gen) + 0.1]
    leaves = [t.requires_grad_() for t in leaves]
    out = attend(leaves[0], Entries(*leaves[1:], kernel), path=path)
    return [out.detach(), *torch.autograd.grad(out.square().sum(), leaves)]


@pytest.mark.parametrize("kernel", list(KERNEL_CODES))
def test_the_check_passes_a_correct_path_in_float32_over_a_bfloat16_store(kernel):
    path = TritonAttention(**SMALL)
    assert check_against_streaming(path, "cpu", torch.float32, torch.bfloat16, kernel) is None


def wrong_query_gradient(monkeypatch):
    backward = TritonAttention.backward

    def off(self, *args, **kw):
        grad_q, *rest = backward(self, *args, **kw)
        return (None if grad_q is None else grad_q * 1.01, *rest)

    monkeypatch.setattr(TritonAttention, "backward", off)
    return r"its query gradient is off by 1\.0e-02"


def compile_error(monkeypatch):
    def fails(self, *args, **kw):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120")

    monkeypatch.setattr(TritonAttention, "forward", fails)
    return r"RuntimeError: PTX \.version 8\.7 does not support \.target sm_120"


@pytest.mark.parametrize("inject", [wrong_query_gradient, compile_error],
                         ids=["wrong-gradient", "compile-error"])
def test_a_failed_check_warns_once_and_the_streaming_path_computes(checked_path, monkeypatch,
                                                                   inject):
    problem = inject(monkeypatch)
    with pytest.warns(TritonPathWarning, match=r"first-use check for the softmax kernel on cpu "
                      rf"\(float32 queries over a bfloat16 store\): {problem}"):
        got = call()
    want = call(path=STREAMING)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # the streaming path's results, bit for bit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second call neither checks nor warns
        again = call()
    assert all(torch.equal(a, b) for a, b in zip(again, want, strict=True))
    assert path_for(*call_args()) is STREAMING
    where = "softmax on cpu, float32 queries over a bfloat16 store"
    assert triton_paths()[where].startswith("streaming (the check failed: ")


def call_args():
    q, keys = torch.randn(6, 20), torch.randn(40, 20).bfloat16()
    return q, Entries(keys, torch.randn(40, 3).bfloat16(), torch.rand(40), "softmax")


def test_a_passed_check_is_taken_and_a_run_records_every_check(checked_path, tmp_path):
    run = RunDir.create("tiny", path=tmp_path / "run")
    env = json.loads(run.file("environment.json").read_text())
    assert env["triton_paths"] == {}  # nothing checked yet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(kernel="rbf", store=torch.float32)
    assert path_for(torch.randn(2, 4), Entries(torch.randn(5, 4), torch.randn(5, 2),
                                               torch.rand(5), "rbf")) is checked_path
    run.record_paths()
    env = json.loads(run.file("environment.json").read_text())
    assert env["triton_paths"] == {"rbf on cpu, float32 queries over a float32 store": "triton"}


def test_by_default_the_check_runs_on_cuda_devices_only(monkeypatch):
    """Under the interpreter the kernels run as Python on CPU tensors, which the tests compare
    with the streaming path themselves; a CUDA device compiles them for itself."""
    monkeypatch.setattr(triton_attention, "_CHECKS", {})
    assert TritonAttention().supports(*call_args())
    assert triton_attention._CHECKS == {}
