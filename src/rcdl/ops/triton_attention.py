"""A fused compute path of the attention op in Triton (docs/gpu.md): the
forward partial in one kernel launch, every gradient in two, and the entries' shares of the
output (:meth:`TritonAttention.shares`, for attribution) in one, for the linear, RBF,
Laplacian and softmax kernels. It does not resume a pass (the op's ``resume``): its splits
are merged as a whole, not folded in the streaming path's fixed order, so a resumed partial
would not be a full pass's bit for bit; the op's ``resume`` then makes a full pass on it
each call (the evaluation cache never hits).

**Chosen** for queries on a CUDA device when triton is installed (``pip install -e
'.[triton]'``): importing ``rcdl`` registers :data:`TRITON` for ``"cuda"``, float32
queries and float32, bfloat16 and float16 stores; never on CPU. Anywhere else (and for
float64 queries, or any other kernel) the streaming path computes. ``unregister_path(TRITON)``
(:func:`rcdl.ops.attention.unregister_path`) turns it off.

**Checked before it is trusted.** At its first call per CUDA device, queries' dtype, store's
dtype and kernel, the path runs one small call of its own (fixed-seed inputs, in those
dtypes) and compares its output and its four gradients with the streaming path's on the same
stored numbers in float64 (:func:`check_against_streaming`). Where they disagree beyond the
dtypes' rounding, or the call fails (a kernel that does not compile for this device, say), it
warns once (:class:`TritonPathWarning`, naming the kernel and the error) and declines those
calls, which the streaming path then computes. :func:`triton_paths` lists what each check
decided; a run records it in ``environment.json``.

**The maths** (``b`` a query, ``j`` an entry; ``τ = T √key_dim``; docs/reference.md §2), as
:mod:`rcdl.ops.streaming` computes it:

- kernel values ``φ_bj``: ``⟨q_b, k_j⟩`` (linear), ``exp(−‖q_b − k_j‖² / 2τ)`` (RBF),
  ``exp(−‖q_b − k_j‖ / τ)`` (Laplacian), with ``‖q − k‖² = ‖q‖² − 2⟨q, k⟩ + ‖k‖²``; the softmax
  has logits ``z_bj = ⟨q_b, k_j⟩ / τ``;
- forward, the :class:`~rcdl.ops.entries.Partial` over all entries: ``num_b = Σ_j w_j φ_bj v_j``
  (``m = den = mass = 0``), or for the softmax ``m_b = max_j z_bj``,
  ``num_b = Σ_j e^{z_bj − m_b} ṽ_j``, ``den_b = Σ_j w_j e^{z_bj − m_b}``,
  ``mass_b = Σ_j |w_j| e^{z_bj − m_b}``, folded block by block with the log-sum-exp rescaling.
  The entries are cut into ``S`` splits of consecutive rows, each folded by its own programs
  (so that a small batch still fills the device), and the ``S`` partials are merged as
  :func:`~rcdl.ops.entries.merge_partials` merges two;
- backward, with ``g_b = ∂L/∂s_b`` and ``gv_bj = ⟨g_b, v_j⟩``. The softmax, with
  ``a_bj = e^{z_bj − m_b} / D'_b`` (``D'`` the guarded denominator,
  :func:`~rcdl.ops.kernels.guard_denominator`) and ``u_bj = w_j`` where the guard did not
  act, ``eps·sign(D'_b)·|w_j|`` where it did:
  ``∂L/∂z_bj = a_bj (gv_bj − u_bj ⟨g_b, s_b⟩)``, ``∂L/∂ṽ_j = Σ_b a_bj g_b``,
  ``∂L/∂w_j = −Σ_b a_bj ∂u_bj/∂w_j ⟨g_b, s_b⟩``. The other kernels:
  ``∂L/∂φ_bj = w_j gv_bj``, ``∂L/∂v_j = Σ_b w_j φ_bj g_b``, ``∂L/∂w_j = Σ_b φ_bj gv_bj``.
  Then with ``c_bj = ∂L/∂(argument) / scale`` (``scale = kernel.scale(τ)``: ``1/τ``, or 1 for
  the linear kernel): ``∂L/∂q_b = scale Σ_j c_bj k_j`` and ``∂L/∂k_j = scale Σ_b c_bj q_b``,
  and for the distance kernels also ``− scale q_b Σ_j c_bj`` and ``− scale k_j Σ_b c_bj``.

**Precision.** Every product and sum runs in the queries' dtype: a tile of a bfloat16 or
float16 store is converted to it in registers as it is loaded (the store keeps its bytes), and
float32 products are exact float32 (no TF32). This is the streaming path's ``"float32"``
product mode (:mod:`rcdl.ops.half`) whatever ``half_products`` says; the results differ from
the streaming path's by rounding only.

**Blocks and traffic.** A program holds a ``(block_b, block_n)`` block of scores and reads
the key and value dimensions in chunks of ``block_d`` and ``block_v`` columns. The forward
runs on a grid of (query blocks, splits): a program computes the scores of its split's
entries once, over the full key width, keeping each block's in a ``(B, N)`` scratch (its own
columns; the split's ``m``, ``den`` and ``mass`` in registers), then forms the values product
chunk by chunk of value columns from the scratch, so it reads each row of the keys and of the
values once. With ``keep`` (a training call whose scores are small against the store) the
scratch is the backward's: its first launch, on the same grid, reads the values once for
``⟨g, v⟩``, writes the coefficients each asked-for gradient needs to ``(B, N)`` scratches,
and reads the keys once more for the query gradient's share of its split; the second, one
program per block of entries, sums the entries' gradients over the queries from the
scratches (the distance kernels' key gradient reads the keys once more). Each row of the
store is read once per block of queries in the forward, and in the backward the values once
and the keys at most three times (once where only the query gradient is asked for and the
scores are kept). :mod:`rcdl.ops.triton_traffic` models every launch's loads, stores and
FLOPs; tests/test_triton_traffic.py counts them under the interpreter. No program reads what
another writes within a launch, and no gradient is accumulated with atomics.

**Checking it** without a GPU: the kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is imported); tests/test_triton_attention.py registers a
:class:`TritonAttention` for ``"cpu"`` there and compares it with the streaming path and the
dense twin, outputs and every gradient, and compiles the kernels for an sm_90 GPU (Triton's
compiler runs without one). No GPU has run them yet; the first-use check is what vouches for
them on a device.
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from importlib.util import find_spec
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from rcdl.ops.attention import attend, register_path
from rcdl.ops.entries import Entries, Partial, empty_partial
from rcdl.ops.half import HALF_DTYPES
from rcdl.ops.kernels import check_kernel, guard_denominator
from rcdl.ops.streaming import STREAMING
from rcdl.ops.triton_traffic import cdiv, split_rows

__all__ = ["KERNEL_CODES", "TRITON", "TritonAttention", "TritonPathWarning",
           "check_against_streaming", "interpreting", "triton_available", "triton_paths"]

# the kernels the Triton path expresses, by name, and their codes in the kernels
KERNEL_CODES = {"linear": 0, "rbf": 1, "laplacian": 2, "softmax": 3}


def triton_available() -> bool:
    """Whether triton is installed (found, not imported)."""
    return find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set true): then
    they take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


_loaded: dict[str, ModuleType | str] = {}


def _kernels() -> ModuleType | None:
    """The module of Triton kernels, imported on first use (``None`` where triton does not
    import; :attr:`TritonAttention.unavailable` says why)."""
    if "module" not in _loaded:
        try:
            _loaded["module"] = importlib.import_module("rcdl.ops._triton_kernels")
        except ImportError as err:  # missing, or installed but broken
            _loaded["module"] = f"{type(err).__name__}: {err}"
    module = _loaded["module"]
    return module if isinstance(module, ModuleType) else None


class TritonPathWarning(RuntimeWarning):
    """The Triton path disagreed with the streaming path at its first-use check on a device
    (or failed to run there): the streaming path computes those calls instead."""


# The relative error (in norm) a result in each dtype may have against the streaming path in
# float64 on the same stored numbers: float32 sums of a few hundred products round near 1e-7;
# a half store's gradients are returned rounded to its dtype (2⁻⁹ relative for bfloat16, 2⁻¹²
# for float16). A wrong kernel is off by far more.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2.0**-6,
              torch.float16: 2.0**-9}
_RESULTS = ("output", "query gradient", "keys' gradient", "values' gradient",
            "weights' gradient")


def check_against_streaming(path: TritonAttention, device: torch.device | str,
                            dtype: torch.dtype, store_dtype: torch.dtype,
                            kernel: str) -> str | None:
    """Run one small call of ``path`` on ``device`` (``dtype`` queries and weights over a
    ``store_dtype`` store, the ``kernel``, a fixed seed; entries and columns spanning several
    of its blocks and splits, weights of both signs) and compare its output and the gradients
    w.r.t. queries, keys, values and weights with the streaming path's on the same numbers
    in float64. Returns ``None`` where each agrees within its dtype's rounding
    (:data:`_TOLERANCE`), else what did not: the first result off and by how much, or the
    error the call raised."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    b, n, d, d_out = 5, 2 * path.block_n + 5, path.block_d + 8, path.block_v + 4
    f64 = torch.float64
    q = (torch.randn(b, d, generator=gen, dtype=f64) / d**0.25).to(dtype)  # (B, d)
    keys = (torch.randn(n, d, generator=gen, dtype=f64) / d**0.25).to(store_dtype)  # (N, d)
    values = torch.randn(n, d_out, generator=gen, dtype=f64).to(store_dtype)  # (N, d_out)
    weights = torch.rand(n, generator=gen, dtype=f64) + 0.5  # (N,)
    weights[::7] = -0.1  # both signs, every denominator far from the guard
    weights = weights.to(dtype)
    grad = torch.randn(b, d_out, generator=gen, dtype=f64).to(dtype)  # (B, d_out)

    def outputs_and_grads(tensors: list[Tensor], compute: Any) -> list[Tensor]:
        q, keys, values, weights = (t.to(device).requires_grad_() for t in tensors)
        entries = Entries(keys, values, weights, check_kernel(kernel), temperature=0.9)
        out = attend(q, entries, path=compute)
        grads = torch.autograd.grad(out, [q, keys, values, weights], grad.to(device, out.dtype))
        return [out.detach(), *grads]

    tensors = [q, keys, values, weights]
    with (torch.inference_mode(False), torch.enable_grad(),
          torch.autocast(device.type, enabled=False)):
        want = outputs_and_grads([t.double() for t in tensors], STREAMING)
        try:
            got = outputs_and_grads(tensors, path)
            errors = [float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))
                      for a, ref in zip(got, want, strict=True)]  # an error raised late: here
        except Exception as err:  # a kernel that does not compile or run here
            return f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"
    for name, a, error in zip(_RESULTS, got, errors, strict=True):
        tol = _TOLERANCE[a.dtype]
        if not error <= tol:  # NaN included
            return (f"its {name} is off by {error:.1e} (relative to the streaming path in "
                    f"float64; {str(a.dtype).removeprefix('torch.')} allows {tol:.0e})")
    return None


# (path, device, queries' dtype, store's dtype, kernel) -> None where the check passed, else
# what failed
_CHECKS: dict[tuple[TritonAttention, str, torch.dtype, torch.dtype, str], str | None] = {}


def triton_paths() -> dict[str, str]:
    """What each first-use check of this process decided (what a run records in
    ``environment.json``): ``{"softmax on cuda:0, float32 queries over a bfloat16 store":
    "triton"}``, or ``"streaming (the check failed: ...)"`` where it declined."""
    paths = {}
    for (_, device, dtype, store, kernel), problem in _CHECKS.items():
        where = (f"{kernel} on {device}, {str(dtype).removeprefix('torch.')} queries over a "
                 f"{str(store).removeprefix('torch.')} store")
        paths[where] = "triton" if problem is None else f"streaming (the check failed: {problem})"
    return paths


@dataclass(frozen=True, eq=False)
class TritonAttention:
    """The Triton compute path (see the module docstring); its methods are the compute-path
    contract of :mod:`rcdl.ops.attention`.

    Args:
        block_b: queries per block of scores (a power of two, at least 16).
        block_n: entries per block of scores (a power of two, at least 16).
        block_d: key columns per chunk and per key-column block (a power of two, ≥ 16).
        block_v: value columns per chunk and per value-column block (a power of two, ≥ 16).
        splits: how many splits of consecutive entries are folded apart and merged (at most
            one per block of entries); ``None``: enough for one program (a split and a block
            of queries) per multiprocessor of the device (CUDA), 4 elsewhere. More splits
            write more partials: one per multiprocessor keeps them under 10 % of a store's
            read at ``B = 16`` (:mod:`rcdl.ops.triton_traffic`).
        check: compare one small call with the streaming path at the first call per device,
            dtypes and kernel, and decline those calls where they disagree (:meth:`checked`;
            the module docstring). ``None``: on CUDA devices, where the kernels are compiled
            for the device; under the interpreter they run as Python, which the tests
            compare with the streaming path themselves.
    """

    block_b: int = 16
    block_n: int = 64
    block_d: int = 128
    block_v: int = 128
    splits: int | None = None
    check: bool | None = None

    name = "triton"

    def __post_init__(self) -> None:
        for field in ("block_b", "block_n", "block_d", "block_v"):
            size = getattr(self, field)
            if size < 16 or size & (size - 1):
                raise ValueError(f"TritonAttention: {field} must be a power of two >= 16, "
                                 f"got {size}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"TritonAttention: splits must be >= 1, got {self.splits}")

    @property
    def unavailable(self) -> str | None:
        """Why the kernels cannot run here (triton does not import), else ``None``."""
        problem = _loaded.get("module") if _kernels() is None else None
        return problem if isinstance(problem, str) else None

    def supports(self, q: Tensor, entries: Entries) -> bool:
        """The kernels of :data:`KERNEL_CODES`, float32 queries over a store of their dtype
        or a half one, on a CUDA device, where triton imports; under the interpreter also CPU
        tensors and float64 queries (the tests')."""
        dtypes = (torch.float32,) if q.is_cuda else (torch.float32, torch.float64)
        return (entries.kernel.name in KERNEL_CODES and q.dtype in dtypes
                and entries.keys.dtype in (q.dtype, *HALF_DTYPES)
                and (q.is_cuda or interpreting()) and _kernels() is not None
                and (not (q.is_cuda if self.check is None else self.check)
                     or self.checked(q.device, q.dtype, entries.keys.dtype,
                                     entries.kernel.name) is None))

    def checked(self, device: torch.device | str, dtype: torch.dtype,
                store_dtype: torch.dtype, kernel: str) -> str | None:
        """This path's first-use check on ``device`` for ``dtype`` queries over a
        ``store_dtype`` store with the ``kernel`` (:func:`check_against_streaming`, run once
        per process and remembered): ``None`` where it passed, else what failed, after a
        :class:`TritonPathWarning` that says so (once)."""
        key = (self, str(torch.device(device)), dtype, store_dtype, kernel)
        if key not in _CHECKS:
            problem = check_against_streaming(self, device, dtype, store_dtype, kernel)
            _CHECKS[key] = problem
            if problem is not None:
                warnings.warn(
                    f"the Triton attention path failed its first-use check for the {kernel} "
                    f"kernel on {key[1]} ({str(dtype).removeprefix('torch.')} queries over a "
                    f"{str(store_dtype).removeprefix('torch.')} store): {problem}. The "
                    "streaming path computes these calls instead (docs/precision.md, \"The "
                    "Triton kernel\")", TritonPathWarning, stacklevel=2)
        return _CHECKS[key]

    def _rows_per_split(self, q: Tensor, n: int) -> int:
        """Entries per split: a whole number of blocks of entries
        (:func:`rcdl.ops.triton_traffic.split_rows`)."""
        multiprocessors = (torch.cuda.get_device_properties(q.device).multi_processor_count
                           if q.is_cuda else None)
        return split_rows(q.shape[0], n, self.block_b, self.block_n, self.splits,
                          multiprocessors)

    def _constants(self, entries: Entries) -> dict[str, int | bool]:
        """The kernels' compile-time arguments for these entries."""
        return {"KERNEL": KERNEL_CODES[entries.kernel.name], "DISTANCE": entries.kernel.distance,
                "BLOCK_B": self.block_b, "BLOCK_N": self.block_n, "BLOCK_D": self.block_d,
                "BLOCK_V": self.block_v}

    def forward(self, q: Tensor, entries: Entries, *, keep: bool) -> tuple[Partial, Any]:
        """The partial over all the entries (no autograd) and, with ``keep``, the scores the
        backward reads instead of recomputing them: ``(B, N)``, the kernel's argument per pair
        (``z``, ``⟨q, k⟩`` or ``‖q − k‖²``)."""
        kernel = entries.kernel
        (b, d), n, d_out = q.shape, len(entries), entries.values.shape[1]
        if n == 0 or b == 0:
            return empty_partial(q, d_out, kernel), None
        kernels = _kernels()
        assert kernels is not None  # supports() said so
        q = q.contiguous()
        rows = self._rows_per_split(q, n)
        splits = cdiv(n, rows)
        scores = q.new_empty(b, n)  # (B, N) scratch: each program's scores, written then read
        stats = q.new_empty(3, splits, b)  # m, den, mass of each split
        num = q.new_empty(splits, b, d_out)  # (S, B, d_out)
        kernels.attention_forward[(cdiv(b, self.block_b), splits)](
            q, entries.keys.contiguous(), entries.values.contiguous(),
            entries.weights.contiguous(), scores, stats, num, b, n, d, d_out, rows,
            entries.tau(d), **self._constants(entries))
        saved = scores if keep else None
        if not kernel.normalised:
            zero = q.new_zeros(b)
            return Partial(zero, num.sum(0), zero, zero.clone()), saved
        m_splits, den, mass = stats  # each (S, B)
        m = m_splits.amax(0)  # (B,)
        rescale = torch.exp(m_splits - m)  # (S, B); every split has entries: m finite
        return Partial(m, (num * rescale[:, :, None]).sum(0), (den * rescale).sum(0),
                       (mass * rescale).sum(0)), saved

    def backward(self, grad_out: Tensor, q: Tensor, entries: Entries, out: Tensor, m: Tensor,
                 den: Tensor | None, clamped: Tensor | None, *,
                 needs: tuple[bool, bool, bool, bool], saved: Any
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """Gradients w.r.t. ``(q, keys, values, weights)`` (those ``needs`` asks for), from
        the forward's scores where it kept them (``saved``), else recomputing them: one launch
        for the coefficients and the query gradient (its splits' shares summed here), one for
        the entries'. As :meth:`rcdl.ops.streaming.Streaming.backward`,
        ``out``, ``m``, ``den`` and ``clamped`` describe the attention over all entries (the
        entries given may be one part of them); no host read of a device value."""
        kernel = entries.kernel
        need_q, need_k, need_v, need_w = needs
        (b, d), n, d_out = q.shape, len(entries), entries.values.shape[1]
        q = q.contiguous()
        g = grad_out.to(q.dtype).contiguous()  # (B, d_out)
        stats = q.new_zeros(4, b)  # per query: m, 1/D', ⟨g,s⟩ unguarded, eps·sign(D')·⟨g,s⟩
        if kernel.normalised:
            assert den is not None and clamped is not None  # given for the softmax kernel
            g_dot_s = (g * out).sum(1)  # (B,)
            stats[0], stats[1] = m, 1.0 / den
            stats[2] = g_dot_s.masked_fill(clamped, 0.0)
            stats[3] = torch.where(clamped, entries.eps * torch.sign(den) * g_dot_s, 0.0)
        keys, values = entries.keys.contiguous(), entries.values.contiguous()
        weights = entries.weights.contiguous()
        tau = entries.tau(d)
        common = self._constants(entries)
        kernels = _kernels() if n and b else None
        if kernels is None:  # no entries (or no queries): every gradient is zero
            return (torch.zeros_like(q) if need_q else None,
                    torch.zeros_like(keys) if need_k else None,
                    torch.zeros_like(values) if need_v else None,
                    torch.zeros_like(weights) if need_w else None)
        rows = self._rows_per_split(q, n)
        splits = cdiv(n, rows)
        flags = {"NEED_Q": need_q, "NEED_K": need_k, "NEED_V": need_v, "NEED_W": need_w,
                 "SHARES": False}
        nothing = q.new_empty(0)
        # (B, N) scratch of the coefficients, each where a gradient needs it
        coef = q.new_empty(b, n) if need_q or need_k else nothing
        probs = q.new_empty(b, n) if need_v else nothing
        dws = q.new_empty(b, n) if need_w else nothing
        shares = q.new_empty(splits, b, d) if need_q else nothing  # (S, B, d_in)
        kernels.attention_grad_queries[(cdiv(b, self.block_b), splits)](
            q, keys, values, weights, g, stats, nothing if saved is None else saved, coef,
            probs, dws, shares, b, n, d, d_out, rows, tau, kernel.scale(tau),
            SAVED=saved is not None, **flags, **common)
        grad_q = shares.sum(0) if need_q else None
        if not (need_k or need_v or need_w):
            return grad_q, None, None, None
        # accumulated in the queries' dtype, written in the store's; float64 queries (the
        # interpreter's only) write float64, rounded here (the interpreter's own float64 to
        # bfloat16 conversion gives NaN)
        wide = q.dtype == torch.float64
        grad_k = keys.new_empty(n, d, dtype=q.dtype if wide else None) if need_k else nothing
        grad_v = (values.new_empty(n, d_out, dtype=q.dtype if wide else None) if need_v
                  else nothing)
        grad_w = weights.new_empty(n) if need_w else nothing
        del flags["NEED_Q"], flags["SHARES"], common["KERNEL"]
        kernels.attention_grad_entries[(cdiv(n, self.block_n),)](
            q, keys, g, coef, probs, dws, grad_k, grad_v, grad_w, b, n, d, d_out,
            kernel.scale(tau), **flags, **common)
        return (grad_q, grad_k.to(keys.dtype) if need_k else None,
                grad_v.to(values.dtype) if need_v else None, grad_w if need_w else None)

    def shares(self, q: Tensor, entries: Entries, direction: Tensor, whole: Partial | None
               ) -> Tensor:  # (B, N)
        """``⟨direction_b, share_j(q_b)⟩`` for every entry ``j``, as
        :meth:`rcdl.ops.streaming.Streaming.shares` defines them: ``w_j φ_bj ⟨u_b, v_j⟩``, or
        for the softmax ``e^{z_bj − m_b} ⟨u_b, ṽ_j⟩ / D'_b`` with ``m`` and the guarded
        ``D'`` of ``whole``, the partial over all entries. The backward's first launch with
        ``direction`` for ``g``: its coefficient ``p_bj`` (the factor of ``v_j`` in the
        output, in the queries' dtype) times ``⟨u_b, v_j⟩``, each row of the keys and the
        values read once per block of queries."""
        kernel = entries.kernel
        (b, d), n, d_out = q.shape, len(entries), entries.values.shape[1]
        kernels = _kernels() if n and b else None
        if kernels is None:
            return q.new_zeros(b, n)
        q = q.contiguous()
        stats = q.new_zeros(4, b)  # as the backward reads them: m, 1/D' (the softmax)
        if kernel.normalised:
            assert whole is not None  # given for the softmax kernel
            stats[0] = whole.m
            stats[1] = 1.0 / guard_denominator(whole.den, whole.mass, entries.eps)
        rows = self._rows_per_split(q, n)
        out = q.new_empty(b, n)  # (B, N)
        nothing = q.new_empty(0)
        tau = entries.tau(d)
        kernels.attention_grad_queries[(cdiv(b, self.block_b), cdiv(n, rows))](
            q, entries.keys.contiguous(), entries.values.contiguous(),
            entries.weights.contiguous(), direction.to(q.dtype).contiguous(), stats, nothing,
            nothing, out, nothing, nothing, b, n, d, d_out, rows, tau, kernel.scale(tau),
            SAVED=False, NEED_Q=False, NEED_K=False, NEED_V=True, NEED_W=False, SHARES=True,
            **self._constants(entries))
        return out


TRITON = TritonAttention()
"""The path ``rcdl`` registers on CUDA devices where triton is installed."""

if triton_available() and torch.cuda.is_available():
    register_path(TRITON, device="cuda", dtypes=[torch.float32, *HALF_DTYPES],
                  kernels=list(KERNEL_CODES))

