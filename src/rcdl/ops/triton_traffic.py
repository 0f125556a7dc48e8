"""The memory traffic and arithmetic of every launch of the Triton attention path
(:mod:`rcdl.ops.triton_attention`), as functions of the shapes, dtypes and blocks, and the time
floor they set on a GPU of a given bandwidth and FLOP rate.

**What is counted.** For each launch: the elements it loads and stores, by tensor (the
queries ``q (B, d)``, ``keys (N, d)``, ``values (N, d_out)``, ``weights (N,)``, the gradient
``g (B, d_out)``, the ``(B, N)`` scratch of scores or coefficients, the per-split partials),
counted where a load's or store's mask holds (what a kernel touches, not what it pads), and
its FLOPs: the products of its ``tl.dot`` tiles as executed, padding included
(``2·BLOCK_B·BLOCK_N·BLOCK_D`` per tile product), plus the key norms of the distance kernels;
the per-pair elementwise work (an exponential, a few products) is left out. The torch
operations around the kernels (the merge of the splits' partials, the sum of the query
gradient's shares; before, a half store's gradients rounded to its dtype) are launches too.
tests/test_triton_traffic.py runs the kernels under Triton's interpreter, counts every element
they load and store by tensor, and checks these counts exactly.

With ``qb = ⌈B / BLOCK_B⌉`` blocks of queries, ``nb = ⌈N / BLOCK_N⌉`` blocks of entries,
``S`` splits, ``kt = ⌈d / BLOCK_D⌉`` and ``vt = ⌈d_out / BLOCK_V⌉`` column chunks, the path
reads each row of the store, per block of queries:

- forward (:func:`forward_launches`): the keys once and the values once; the scratch of
  scores is written once and read ``vt`` times;
- backward (:func:`backward_launches`): the values once; the keys once for the scores unless
  the forward kept them (``saved``: a training call, :func:`keeps`), once for the query
  gradient and once for the distance kernels' key gradient; the coefficients' scratch is
  written once and read ``kt`` (queries, keys) or ``vt`` (values) times. A training call of
  a layer whose store is written by a learning rule (the query gradient only) reads the store
  once forward and once backward.

The path before these kernels (:func:`old_forward_launches`, :func:`old_backward_launches`)
recomputed the scores in every program of a ``(column blocks, splits, query blocks)`` grid:
``vt`` reads of the keys per forward, ``kt`` reads of keys and values for the query gradient
and ``max(kt, vt)`` for the entries' gradients.

**The floor.** A launch takes at least ``max(HBM bytes / bandwidth, FLOPs / FLOP rate)``;
the path's floor is the sum over its launches (:func:`seconds`). The HBM bytes count every
store and every load, except that a tensor small enough to stay in L2 (at most a quarter of
it: the queries, ``g``, the statistics, and at a training call's batch the ``(B, N)``
scratches, which each program reads back moments after writing them) is charged once per
launch (:meth:`Launch.hbm_bytes`); :attr:`Launch.bytes` counts every load, which is what the
test checks. The FLOP rate is the GPU's float32 rate on its CUDA cores: the kernels multiply
in IEEE float32 (a half store's tiles are converted as they are loaded), so no tensor core
rate applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["GPU", "GPUS", "H100_SXM", "H200", "Launch", "Problem", "Tensors", "backward_launches",
           "cdiv", "forward_launches", "keeps", "old_backward_launches", "old_forward_launches",
           "seconds", "split_rows", "store_bytes"]


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` for positive integers (a launch's grid, a loop's trip count)."""
    return -(-a // b)


@dataclass(frozen=True)
class GPU:
    """A GPU's rates: ``bandwidth`` in bytes/s (HBM), ``flops`` its float32 rate on CUDA cores
    in FLOP/s (an FMA is two), ``multiprocessors`` its SM count (the default splits),
    ``l2_bytes`` its L2 cache."""

    name: str
    bandwidth: float
    flops: float
    multiprocessors: int
    l2_bytes: int


# NVIDIA's datasheets (H100 Tensor Core GPU, SXM5; H200 Tensor Core GPU, SXM) and the Hopper
# architecture whitepaper: HBM bandwidth 3.35 TB/s and 4.8 TB/s; FP32 67 TFLOPS on both (the
# H200 keeps the H100's GH100 die and clocks); 132 SMs and 50 MB of L2 on both.
H100_SXM = GPU("H100 SXM", 3.35e12, 67e12, 132, 50 * 2**20)
H200 = GPU("H200 SXM", 4.8e12, 67e12, 132, 50 * 2**20)
GPUS = {"h100": H100_SXM, "h200": H200}


@dataclass(frozen=True)
class Problem:
    """One attention call: ``b`` queries over ``n`` entries of ``d`` key and ``d_out`` value
    columns, with the ``kernel``; queries, weights and every accumulator in ``query_bytes``
    per number (float32: 4), keys and values in ``store_bytes`` (float32 4, bfloat16 2); the
    path's blocks, and ``splits`` as :class:`~rcdl.ops.triton_attention.TritonAttention`
    takes it (``None``: its default for ``multiprocessors``)."""

    b: int
    n: int
    d: int
    d_out: int
    kernel: str = "softmax"
    query_bytes: int = 4
    store_bytes: int = 4
    block_b: int = 16
    block_n: int = 64
    block_d: int = 128
    block_v: int = 128
    splits: int | None = None
    multiprocessors: int = 132

    @property
    def distance(self) -> bool:
        return self.kernel in ("rbf", "laplacian")


def split_rows(b: int, n: int, block_b: int, block_n: int, splits: int | None,
               multiprocessors: int | None, programs_per_multiprocessor: int = 1) -> int:
    """Entries per split, a whole number of blocks of entries: ``splits`` of them where given,
    else enough splits for ``programs_per_multiprocessor`` programs (each a split and a block
    of queries) per multiprocessor, else (no device: ``multiprocessors=None``) 4 splits. At
    most one split per block of entries."""
    blocks = cdiv(n, block_n)
    if splits is None:
        splits = (4 if multiprocessors is None else
                  cdiv(programs_per_multiprocessor * multiprocessors, cdiv(b, block_b)))
    return cdiv(blocks, max(1, min(splits, blocks))) * block_n


@dataclass(frozen=True)
class Tensors:
    """The bytes per element (``itemsize``) of each tensor a launch touches, and the elements
    of those a launch may read more than once (``sizes``)."""

    itemsize: dict[str, int]
    sizes: dict[str, int]


@dataclass(frozen=True)
class Launch:
    """One launch: its ``grid``, the elements it ``loads`` and ``stores`` by tensor, its
    ``tensors``' sizes, and its ``flops``."""

    name: str
    grid: tuple[int, ...]
    loads: dict[str, int]
    stores: dict[str, int]
    tensors: Tensors = field(repr=False)
    flops: int = 0

    @property
    def bytes_read(self) -> int:
        """What the launch loads from device memory, each load counted."""
        return sum(count * self.tensors.itemsize[name] for name, count in self.loads.items())

    @property
    def bytes_written(self) -> int:
        return sum(count * self.tensors.itemsize[name] for name, count in self.stores.items())

    @property
    def bytes(self) -> int:
        """Every load and store of the launch."""
        return self.bytes_read + self.bytes_written

    def hbm_bytes(self, cached: float) -> int:
        """The bytes that reach HBM where every tensor of at most ``cached`` bytes stays in
        the L2 cache for the launch once read (the queries, ``g``, the statistics and, at a
        training call's batch, the ``(B, N)`` scratches): such a tensor's loads are counted
        up to its size, the others' all; every store is counted."""
        read = 0
        for name, count in self.loads.items():
            itemsize, size = self.tensors.itemsize[name], self.tensors.sizes.get(name)
            if size is not None and size * itemsize <= cached:
                count = min(count, size)
            read += count * itemsize
        return read + self.bytes_written


def _tensors(p: Problem) -> Tensors:
    itemsize = dict.fromkeys(("q", "weights", "g", "stats", "scores", "num", "out", "c", "p",
                              "dw", "shares", "grad_q", "grad_k_acc", "grad_v_acc", "grad_w"),
                             p.query_bytes)
    itemsize |= dict.fromkeys(("keys", "values", "grad_k", "grad_v"), p.store_bytes)
    scratch = p.b * p.n
    sizes = {"q": p.b * p.d, "g": p.b * p.d_out, "stats": 4 * p.b, "weights": p.n,
             "keys": p.n * p.d, "values": p.n * p.d_out, "scores": scratch, "c": scratch,
             "p": scratch, "dw": scratch}
    return Tensors(itemsize, sizes)


def _counts(**counts: int) -> dict[str, int]:
    return {name: count for name, count in counts.items() if count}


def _blocks(p: Problem, splits: int) -> tuple[int, int, int, int, int]:
    """``qb, nb, S, kt, vt``."""
    rows = split_rows(p.b, p.n, p.block_b, p.block_n, p.splits if splits == 0 else splits,
                      p.multiprocessors)
    return (cdiv(p.b, p.block_b), cdiv(p.n, p.block_n), cdiv(p.n, rows),
            cdiv(p.d, p.block_d), max(1, cdiv(p.d_out, p.block_v)))


def _dots(p: Problem, qb: int, nb: int, kt: int, vt: int) -> tuple[int, int, int]:
    """FLOPs, over every (query block, entry block) pair: of the scores over the key width
    (with the distance kernels' key norms), of a product of the scores with every value
    column, and of a product of the scores with every key column."""
    key_norms = 2 * p.block_n * p.block_d * kt * qb * nb if p.distance else 0
    keys = 2 * p.block_b * p.block_n * p.block_d * kt * qb * nb
    return keys + key_norms, 2 * p.block_b * p.block_n * p.block_v * vt * qb * nb, keys


def _merge(p: Problem, splits: int, normalised: bool, temporary: bool) -> Launch:
    """The sum of the splits' partials in torch (``temporary``: the softmax's, through an
    ``(S, B, d_out)`` product written and read back: an elementwise product, never a matmul,
    which TF32 could round)."""
    partials = splits * p.b * p.d_out
    extra = partials if temporary and normalised else 0
    return Launch("merge (torch)", (), _counts(num=partials + extra, stats=3 * splits * p.b),
                  _counts(out=p.b * p.d_out + extra), _tensors(p), 2 * partials)


def forward_launches(p: Problem) -> list[Launch]:
    """The forward's launches: ``attention_forward`` on a ``(qb, S)`` grid, then the merge
    of the partials."""
    qb, nb, s, kt, _ = _blocks(p, 0)
    vt = cdiv(p.d_out, p.block_v)  # no chunk of value columns where there are none
    scores, values, _ = _dots(p, qb, nb, kt, vt)
    kernel = Launch(
        "attention_forward", (qb, s),
        _counts(q=(nb + (s if p.distance else 0)) * p.b * p.d, keys=qb * p.n * p.d,
                weights=(1 if p.kernel == "softmax" else vt) * qb * p.n,
                scores=vt * p.b * p.n, values=qb * p.n * p.d_out),
        _counts(scores=p.b * p.n, num=s * p.b * p.d_out, stats=3 * s * p.b),
        _tensors(p), scores + values)
    return [kernel, _merge(p, s, p.kernel == "softmax", temporary=True)]


def _to_store(p: Problem, need_k: bool, need_v: bool) -> list[Launch]:
    """A half store's gradients, written in the queries' dtype and rounded to the store's in
    torch (the path before)."""
    if p.store_bytes == p.query_bytes or not (need_k or need_v):
        return []
    return [Launch("round to the store's dtype (torch)", (),
                   _counts(grad_k_acc=need_k * p.n * p.d, grad_v_acc=need_v * p.n * p.d_out),
                   _counts(grad_k=need_k * p.n * p.d, grad_v=need_v * p.n * p.d_out),
                   _tensors(p))]


def keeps(p: Problem, save_fraction: float = 0.05) -> bool:
    """Whether a training call keeps the forward's ``(B, N)`` scores for the backward (the
    attention op's rule, :func:`rcdl.ops.attention.attend`'s ``save_fraction``)."""
    return p.b * p.n * p.query_bytes <= save_fraction * p.n * (p.d + p.d_out) * p.store_bytes


def backward_launches(p: Problem, needs: tuple[bool, bool, bool, bool] = (True, True, True, True),
                      saved: bool = False) -> list[Launch]:
    """The backward's launches for the gradients w.r.t. ``(q, keys, values, weights)`` that
    ``needs`` asks for, from the forward's scores where ``saved``: ``attention_grad_queries``
    on a ``(qb, S)`` grid (the coefficients and the query gradient's shares), the sum of the
    shares, and ``attention_grad_entries`` on an ``(nb,)`` grid, which writes the entries'
    gradients in the store's dtype."""
    need_q, need_k, need_v, need_w = needs
    qb, nb, s, kt, _ = _blocks(p, 0)
    vt = cdiv(p.d_out, p.block_v)
    scores, values, keys = _dots(p, qb, nb, kt, vt)
    dist = p.distance
    softmax = p.kernel == "softmax"
    bn = p.b * p.n
    fresh = not saved  # the scores computed again
    queries = Launch(
        "attention_grad_queries", (qb, s),
        _counts(q=(fresh * ((s if dist else 0) + nb) + (s if dist and need_q else 0))
                * p.b * p.d,
                keys=(fresh + need_q) * qb * p.n * p.d, values=qb * p.n * p.d_out,
                g=nb * p.b * p.d_out, weights=qb * p.n, stats=4 * nb * p.b if softmax else 0,
                scores=saved * bn, c=need_q * kt * bn),
        _counts(c=(need_q or need_k) * bn, p=need_v * bn, dw=need_w * bn,
                shares=need_q * s * p.b * p.d),
        _tensors(p), fresh * scores + values + need_q * keys)
    launches = [queries]
    if need_q:
        launches.append(Launch("sum of the shares (torch)", (), {"shares": s * p.b * p.d},
                               {"grad_q": p.b * p.d}, _tensors(p), s * p.b * p.d))
    if need_k or need_v or need_w:
        launches.append(Launch(
            "attention_grad_entries", (nb,),
            _counts(c=need_k * kt * bn, q=need_k * nb * p.b * p.d,
                    keys=need_k * dist * p.n * p.d, p=need_v * vt * bn,
                    g=need_v * nb * p.b * p.d_out, dw=need_w * bn),
            _counts(grad_k=need_k * p.n * p.d, grad_v=need_v * p.n * p.d_out,
                    grad_w=need_w * p.n),
            _tensors(p), need_k * keys + need_v * values))
    return launches


def old_forward_launches(p: Problem) -> list[Launch]:
    """The forward of the path before these kernels: ``attention_forward`` on a
    ``(vt, S, qb)`` grid, each program recomputing the scores of its split for its ``BLOCK_V``
    value columns; splits for four programs per multiprocessor; the merge through an
    ``(S, B, d_out)`` temporary."""
    rows = split_rows(p.b, p.n, p.block_b, p.block_n, p.splits, p.multiprocessors, 4)
    qb, nb, s, kt, vt = _blocks(p, cdiv(p.n, rows))
    scores, values, _ = _dots(p, qb, nb, kt, vt)
    kernel = Launch(
        "attention_forward (before)", (vt, s, qb),
        _counts(q=vt * (nb + (s if p.distance else 0)) * p.b * p.d, keys=vt * qb * p.n * p.d,
                weights=vt * qb * p.n, values=qb * p.n * p.d_out),
        _counts(num=s * p.b * p.d_out, stats=3 * s * p.b), _tensors(p), vt * scores + values)
    return [kernel, _merge(p, s, p.kernel == "softmax", temporary=True)]


def old_backward_launches(p: Problem,
                          needs: tuple[bool, bool, bool, bool] = (True, True, True, True)
                          ) -> list[Launch]:
    """The backward of the path before these kernels: ``attention_grad_queries`` on a
    ``(kt, S, qb)`` grid and ``attention_grad_entries`` on a ``(max(kt, vt), nb)`` grid, each
    program recomputing its block's scores and ``⟨g, v⟩`` over the full widths."""
    need_q, need_k, need_v, need_w = needs
    rows = split_rows(p.b, p.n, p.block_b, p.block_n, p.splits, p.multiprocessors, 4)
    qb, nb, s, kt, vt = _blocks(p, cdiv(p.n, rows))
    scores, values, keys = _dots(p, qb, nb, kt, vt)
    dist, softmax = p.distance, p.kernel == "softmax"
    launches = []
    if need_q:
        launches.append(Launch(
            "attention_grad_queries (before)", (kt, s, qb),
            _counts(q=(kt * nb + (kt * s + s if dist else 0)) * p.b * p.d,
                    keys=(kt + 1) * qb * p.n * p.d, values=kt * qb * p.n * p.d_out,
                    g=kt * nb * p.b * p.d_out, weights=kt * qb * p.n,
                    stats=4 * kt * nb * p.b if softmax else 0),
            {"shares": s * p.b * p.d}, _tensors(p), kt * (scores + values) + keys))
        launches.append(Launch("sum of the shares (torch)", (), {"shares": s * p.b * p.d},
                               {"grad_q": p.b * p.d}, _tensors(p), s * p.b * p.d))
    if need_k or need_v or need_w:
        cols = max(kt, vt, 1)
        launches.append(Launch(
            "zeros (torch)", (), {},
            _counts(grad_k_acc=need_k * p.n * p.d, grad_v_acc=need_v * p.n * p.d_out,
                    grad_w=need_w * p.n), _tensors(p)))
        launches.append(Launch(
            "attention_grad_entries (before)", (cols, nb),
            _counts(q=(cols * nb * (1 + dist) + need_k * nb) * p.b * p.d,
                    keys=(cols * qb + need_k * dist) * p.n * p.d,
                    values=cols * qb * p.n * p.d_out,
                    g=(cols * nb + need_v * nb) * p.b * p.d_out, weights=cols * p.n,
                    stats=4 * cols * nb * p.b if softmax else 0),
            _counts(grad_k_acc=need_k * p.n * p.d, grad_v_acc=need_v * p.n * p.d_out,
                    grad_w=need_w * p.n),
            _tensors(p), cols * (scores + values + need_k * keys // kt + need_v * values // vt)))
    return launches + _to_store(p, need_k, need_v)


def store_bytes(p: Problem) -> int:
    """One read of the store: keys, values and weights."""
    return p.n * ((p.d + p.d_out) * p.store_bytes + p.query_bytes)


def seconds(launches: Iterable[Launch], gpu: GPU, bandwidth_share: float = 1.0) -> float:
    """The launches' time floor on ``gpu``: each at least its HBM bytes
    (:meth:`Launch.hbm_bytes`, a tensor of at most a quarter of the L2 cached) over
    ``bandwidth_share`` of the bandwidth and its FLOPs over the FLOP rate, summed."""
    return sum(max(launch.hbm_bytes(gpu.l2_bytes / 4) / (bandwidth_share * gpu.bandwidth),
                   launch.flops / gpu.flops) for launch in launches)
