"""The hybrid's Adam step on rows of a half-precision store: eager, fused or compiled.

For a block of a store's rows kept in bfloat16 or float16, with moments ``m``, ``v`` in
float32, one Adam step is (docs/reference.md §4; :meth:`rcdl.optim.entry_adam.EntryMoments.step`
gives the per-entry scales ``a``, ``c``)::

    m ← β₁ m + (1 − β₁) g,   v ← β₂ v + (1 − β₂) g²,
    θ ← round_stochastically(θ − m / (a √v + c))

with the counter-based rounding noise of :mod:`rcdl.ops.rounding`. Eager PyTorch runs this as
about 25 element-wise passes over the block (the noise alone is ten), against eight for a
float32 store. ``torch.compile`` fuses the passes into one loop, at a one-time cost of
compiling it (docs/precision.md gives both times).

A third way, for bfloat16 rows on CPU where numba is installed (the ``fast-cpu`` extra), is
one numba loop (``"fused"``, :func:`adam_path`): the same function element by element in one
pass, compiled once on first use and cached on disk by numba (no compilation to repay), so
it pays at every store size.

Which to run: ``"eager"``, ``"compiled"``, ``"fused"`` (where it applies; elsewhere as
``"auto"``), or ``"auto"`` (the default): fused where it applies, else compiled for a layer
whose keys and values hold at least :data:`AUTO_ELEMENTS` numbers (a full-scale store, where
the compilation is repaid within a few hundred steps), eager below. It is an option of the
learner, ``EntryAdam(model, half_adam=...)`` (saved in its state dict); where the learner
has none, the process-wide default :data:`ADAM_MODE` (``RCDL_HALF_ADAM``, read at first use;
:func:`set_half_adam`; ``with half_adam(mode):``). Where compilation fails (no C++ compiler:
a fact of the process, not of a learner), the eager path runs for the rest of the process,
with one warning. The two paths compute the same function; the compiled one may round a float32
intermediate differently in the last bit, so a rounded entry can differ by one half ulp.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from rcdl.ops.rounding import round_stochastically, rounding_noise
from rcdl.options import ProcessDefault

__all__ = ["ADAM_MODE", "AUTO_ELEMENTS", "MODES", "adam_path", "adam_rows", "half_adam",
           "half_adam_mode", "path_description", "set_half_adam", "use_compiled"]

MODES = ("auto", "eager", "compiled", "fused")
AUTO_ELEMENTS = 1 << 26  # 67 M numbers: e.g. 10 900 entries of width 3 072 (keys + values)


ADAM_MODE = ProcessDefault("half-precision Adam mode", "RCDL_HALF_ADAM", MODES, "auto")
# set the default of how the Adam step moves half-precision rows: "auto", "eager", "compiled",
# "fused"
set_half_adam: Callable[[str], None] = ADAM_MODE.set
# the default now ("auto" unless changed)
half_adam_mode: Callable[[], str] = ADAM_MODE.get
# with half_adam("eager"): ... -- the default for a block, restored after
half_adam: Callable[[str], AbstractContextManager[None]] = ADAM_MODE.using

_compiled: Callable[..., None] | None = None
_compile_failed = False


def use_compiled(elements: int, mode: str | None = None) -> bool:
    """Whether a layer whose keys and values hold ``elements`` numbers takes the compiled
    path under ``mode`` (``None``: the process-wide default)."""
    if _compile_failed:
        return False
    mode = ADAM_MODE.resolve(mode)
    return mode == "compiled" or (mode == "auto" and elements >= AUTO_ELEMENTS)


@functools.cache
def _fused_kernel() -> Callable[..., None] | None:
    """The numba loop of the fused path, or ``None`` where numba is not installed."""
    from rcdl.ops import widen  # chooses the CPU numba compiles for, before numba loads

    if not widen.available():
        return None
    from rcdl.optim._fused_adam import adam_bf16

    return adam_bf16


def adam_path(elements: int, dtype: torch.dtype, device: torch.device | str = "cpu",
              mode: str | None = None) -> str:
    """How the Adam step moves a layer's half-precision rows (``dtype``, on ``device``) whose
    keys and values hold ``elements`` numbers, under ``mode`` (``None``: the process-wide
    default): ``"fused"`` (bfloat16 on CPU with numba, under ``"auto"`` or ``"fused"``),
    else ``"compiled"`` or ``"eager"`` (:func:`use_compiled`)."""
    mode = ADAM_MODE.resolve(mode)
    fusable = (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
               and _fused_kernel() is not None)
    if mode in ("auto", "fused") and fusable:
        return "fused"
    return "compiled" if use_compiled(elements, mode) else "eager"


def path_description(dtype: torch.dtype, device: torch.device | str = "cpu",
                     mode: str | None = None) -> str:
    """How the Adam step moves half-precision rows of ``dtype`` on ``device`` under ``mode``,
    in words, for any store size (what a run records in ``environment.json``)."""
    small, large = (adam_path(n, dtype, device, mode) for n in (1, AUTO_ELEMENTS))
    if small == large:
        return small
    return f"{large} from {AUTO_ELEMENTS:,} numbers (keys and values), {small} below"


def _adam_fused(param: Tensor, m: Tensor, v: Tensor, grad: Tensor, a: Tensor, c: Tensor,
                ids: Tensor, seed: Tensor, step: Tensor, stream: int, b1: float,
                b2: float) -> None:
    """:func:`_adam_rows` on bfloat16 CPU rows as one numba loop (:func:`adam_path`)."""
    kernel = _fused_kernel()
    assert kernel is not None and param.dtype == torch.bfloat16  # adam_path chose it
    from rcdl.ops.rounding import noise_keys
    from rcdl.ops.widen import as_bits
    row, col = noise_keys(seed=seed, step=step, ids=ids, width=param.shape[1], stream=stream)
    none = torch.empty(0, 0)  # (0, 0): the gradient is given in the other dtype
    if grad.dtype == torch.bfloat16:
        bits, grad32 = as_bits(grad.contiguous()), none.numpy()
    else:
        bits, grad32 = as_bits(none.bfloat16()), grad.to(m.dtype).contiguous().numpy()
    kernel(as_bits(param), m.numpy(), v.numpy(), bits, grad32,
           a.to(m.dtype).contiguous().numpy(), c.to(m.dtype).contiguous().numpy(),
           row.numpy().view("uint32"), col.numpy().view("uint32"), b1, b2)


def _adam_rows(param: Tensor, m: Tensor, v: Tensor, grad: Tensor, a: Tensor, c: Tensor,
               ids: Tensor, seed: Tensor, step: Tensor, stream: int, b1: float,
               b2: float) -> None:
    """One Adam step on ``param (n, w)`` (a half dtype), in place, with ``m``, ``v``
    (float32): the moved rows are rounded stochastically (see the module docstring; ``a``,
    ``c`` are ``(n,)``). In place, so the compiled loop writes the store's rows directly
    (no ``(n, w)`` output to allocate and copy back)."""
    g = grad.to(m.dtype)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = torch.sqrt(v).mul_(a[:, None]).add_(c[:, None])
    moved = torch.addcdiv(param.to(m.dtype), m, denom, value=-1.0)
    noise = rounding_noise(seed=seed, step=step, ids=ids, width=param.shape[1], stream=stream)
    param.copy_(round_stochastically(moved, param.dtype, noise))


def adam_rows(param: Tensor, m: Tensor, v: Tensor, grad: Tensor, a: Tensor, c: Tensor, *,
              ids: Tensor, seed: Tensor, step: Tensor, stream: int, b1: float, b2: float,
              compiled: bool = False, fused: bool = False) -> None:
    """:func:`_adam_rows` (in place), eager, through ``torch.compile`` (built once, on
    first use; where that fails, the eager path, with one warning), or ``fused`` (the numba
    loop: :func:`adam_path` says where it applies)."""
    global _compiled, _compile_failed
    if fused:
        _adam_fused(param, m, v, grad, a, c, ids, seed, step, stream, b1, b2)
        return
    if compiled and not _compile_failed:
        try:
            with warnings.catch_warnings():  # torch's own deprecations while it compiles
                warnings.simplefilter("ignore", DeprecationWarning)
                if _compiled is None:
                    _compiled = torch.compile(_adam_rows, dynamic=True)
                _compiled(param, m, v, grad, a, c, ids, seed, step, stream, b1, b2)
                return
        except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
            _compile_failed = True
            warnings.warn(f"rcdl.optim.half_adam: torch.compile failed ({type(error).__name__}: "
                          f"{str(error)[:200]}); the half-precision Adam step runs eagerly",
                          RuntimeWarning, stacklevel=2)
    _adam_rows(param, m, v, grad, a, c, ids, seed, step, stream, b1, b2)
