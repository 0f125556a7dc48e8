"""Growing stores sharded over ``torch.distributed``: each rank holds a slice of every store.

A growing layer's store grows with every training sample, past one device's memory long
before its compute is the limit. :func:`shard` splits every store of a model by rows over
the ranks of a process group (gloo on CPU, NCCL on GPU, launched by ``torchrun``); nothing
else of the model is split, and every rank runs the whole batch through it. The stores never
move: the entries a step writes go to the ranks by row, sample ``i`` of step ``t`` to rank
``(t·B + i) mod W`` (a global sample counter for a constant batch size ``B``).

**Attention is a tree reduction of partials** (the pattern of Tree Attention and
Flash-Decoding: a few queries against very many keys). Every rank computes the partial
``(m, num, den, mass)`` of the queries over its own shard through the attention op
(:mod:`rcdl.ops.attention`, with the shard as its combiner), then one ``all_reduce(MAX)`` on
``m``, a rescale, and one ``all_reduce(SUM)`` on ``[num | den | mass]`` merge them exactly
(:meth:`Shard.merge`, the log-sum-exp merge of :func:`rcdl.ops.entries.merge_partials`). What
crosses the wire per layer and call is ``O(B · d_out)``, whatever the store size. The
partials are at least float32. An empty shard contributes ``m = −inf`` and zeros, which
the rescale maps to 0 (not ``−inf − (−inf)``).

**Backward.** Every rank holds the same replicated loss, so ``∂L/∂s`` is the same on every
rank. Each rank computes the gradients of its own entries (they stay local: a hybrid
layer's Adam step needs no communication) and its share of ``∂L/∂q`` over its shard; one
``all_reduce(SUM)`` adds the shares. The sum is over disjoint shards of one loss, so it is
not multiplied by the world size.

**Everything else that reads a store** reduces the same way: the hybrid's distance gate
(``all_reduce(MIN)`` of the nearest squared distance) and the log-normaliser of the
``normalize=True`` rule (the merged partial). Every rank computes the same proposals, so
the rules, gates and divergence checks agree without communication.

Memory budgets are per shard (each rank keeps at most ``capacity`` of its own entries).
Checkpoints are one ``state_dict`` per rank; resume with the same world size (another world
size is refused, not re-sharded).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rcdl.nn.backends import ShardCollectives, use_shard
from rcdl.nn.layers import growing_layers
from rcdl.ops.entries import Partial
from rcdl.ops.kernels import Kernel, check_kernel

__all__ = [
    "Shard", "init_from_env", "is_sharded", "model_shard", "rank_and_world", "shard",
    "world_bytes",
]  # fmt: skip

_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Shard:
    """This process's place in the group a layer's store is sharded over."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, t: Tensor) -> Tensor:  # (W, *t.shape)
        """Every rank's ``t`` (of the same shape and dtype on every rank), stacked in rank
        order."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def merge(self, part: Partial, kernel: Kernel) -> Partial:
        """The partial over every rank's shard from this rank's ``part`` (two collectives)."""
        wire = torch.promote_types(part.num.dtype, torch.float32)  # partials: >= float32
        m = part.m.to(wire)
        if check_kernel(kernel).normalised:
            m = self.all_reduce(m.clone(), dist.ReduceOp.MAX)  # (B,)
            local = part.m.to(wire)
            scale = torch.where(local == _NEG_INF, 0.0, torch.exp(local - m))  # empty: 0
        else:
            scale = torch.ones_like(m)
        columns = [part.num.to(wire), part.den.to(wire)[:, None], part.mass.to(wire)[:, None]]
        packed = torch.cat(columns, dim=1) * scale[:, None]  # (B, d_out + 2)
        self.all_reduce(packed)
        dtype = part.num.dtype
        return Partial(m.to(dtype), packed[:, :-2].to(dtype), packed[:, -2].to(dtype),
                       packed[:, -1].to(dtype))

    # ------------------------------------------------------------ what layers call
    @torch.no_grad()
    def nearest_sq_distance(self, local: Tensor) -> Tensor:  # (B,)
        """The minimum over ranks of each query's nearest squared distance on its shard."""
        return self.all_reduce(local.clone(), dist.ReduceOp.MIN)

    def owned(self, count: int, device: torch.device, offset: int = 0) -> Tensor:  # (count,)
        """Which of ``count`` new rows (in batch order) this rank stores:
        ``(i + offset) mod W == rank``. The layers pass ``step · B`` as ``offset`` (a global
        sample counter for a constant batch size), so the rows rotate over the ranks from
        step to step: every rank fills, even when the batch is smaller than the world or not
        a multiple of it."""
        return (torch.arange(count, device=device) + offset) % self.world_size == self.rank


def _describe(model: nn.Module) -> dict[str, str]:
    """What must agree between ranks before their stores are split, as readable settings:
    the module tree, each growing layer's settings, and a hash of the contents (not only the
    shapes) of every parameter, buffer and store, read in place (no copy of the stores)."""
    described = {"modules": "; ".join(f"{name or '(model)'}: {type(module).__name__}"
                                      for name, module in model.named_modules())}
    digest = hashlib.sha256()
    for name, layer in growing_layers(model):
        described[name] = (f"{layer.d_in} -> {layer.d_out}, kernel={layer.kernel}, "
                           f"T={layer.temperature}, rule={layer.rule!r}, "
                           f"trigger={getattr(layer, 'trigger', None)!r}")
        for t in (layer.store.keys, layer.store.values, layer.store.weights,
                  layer.store.written_at):
            _update(digest, t)
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        _update(digest, t)
    described["entries and parameters (hash)"] = digest.hexdigest()[:16]
    return described


def _differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    return [f"{key}: {theirs.get(key)!r} (rank 0: {mine.get(key)!r})"
            for key in dict.fromkeys([*mine, *theirs]) if mine.get(key) != theirs.get(key)]


def _update(digest: hashlib._Hash, t: Tensor) -> None:
    data = t.detach().contiguous().cpu()
    digest.update(data.reshape(-1).view(torch.uint8).numpy().data if data.numel() else b"")


def shard(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard every growing layer's store of ``model`` over ``group`` (default: the world).

    Call after ``torch.distributed.init_process_group`` on every rank, with the same model
    (same seeds: the initial entries must agree). Rows already stored are split
    ``row i → rank i mod W``; from then on sample ``i`` of step ``t`` goes to rank
    ``(t·B + i) mod W`` (:meth:`Shard.owned`).
    Returns ``model`` (changed in place). Raises if the ranks' models differ (naming the
    ranks) or if the model has no growing layers.
    """
    if not dist.is_initialized():
        raise RuntimeError("rcdl.distributed.shard: call torch.distributed.init_process_group "
                           "first (torchrun sets up its environment)")
    layers = growing_layers(model)
    if not layers:
        raise ValueError(f"shard: {type(model).__name__} has no growing layers")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    described: list[Any] = [None] * world  # filled by all_gather_object
    dist.all_gather_object(described, _describe(model), group=group)
    differing = {r: _differences(described[0], d) for r, d in enumerate(described)}
    differing = {r: diff for r, diff in differing.items() if diff}
    if differing:
        detail = "; ".join(f"rank {r}: {', '.join(diff)}" for r, diff in differing.items())
        raise ValueError(f"shard: the models of ranks {sorted(differing)} differ from rank 0's "
                         f"({detail}); every rank must build the same model with the same "
                         "settings and seeds")
    info = Shard(group, rank, world)
    for _, layer in layers:
        n = len(layer.store)
        if n:
            keep = info.owned(n, layer.store.device)
            layer.remove_entries(~keep)
            layer.store.compact()  # release the other ranks' rows
        use_shard(layer, info)
    return model


def world_bytes(batch: int, d_out: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one rank sends into the collectives of one sharded softmax attention call:
    ``m (B,)`` and ``[num | den | mass] (B, d_out + 2)``, independent of the store size."""
    size = torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8
    return batch * (1 + d_out + 2) * size


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_sharded(model: nn.Module) -> bool:
    """Whether any growing layer of ``model`` has its store sharded over ranks."""
    return any(getattr(layer, "shard", None) is not None for _, layer in growing_layers(model))


def model_shard(model: nn.Module, where: str = "model_shard") -> ShardCollectives | None:
    """The shard (a :class:`Shard`) that every growing layer of ``model`` is sharded by (as
    :func:`shard` leaves them), or ``None`` when none is sharded. A model with some layers
    sharded and others not, or sharded over different groups, is refused (``where`` names
    the caller in the error): a total over the ranks would count its unsharded layers once
    per rank."""
    layers = growing_layers(model)
    shards = [layer.shard for _, layer in layers]
    first = next((s for s in shards if s is not None), None)
    if first is None:
        return None
    same = [s is not None and (s.group, s.rank, s.world_size)
            == (first.group, first.rank, first.world_size) for s in shards]
    if not all(same):
        other = [name or "(model)" for (name, _), ok in zip(layers, same, strict=True) if not ok]
        raise ValueError(f"{where}: the growing layers {other} of {type(model).__name__} are "
                         f"not sharded as the others are (rank {first.rank} of "
                         f"{first.world_size}); rcdl.distributed.shard(model) shards every "
                         "growing layer over one group")
    return first


def init_from_env(device: torch.device, timeout: timedelta = timedelta(minutes=10)) -> bool:
    """Join the process group that ``torchrun`` describes in the environment, if any.

    With ``WORLD_SIZE > 1`` in the environment, initialise the default group (NCCL on CUDA,
    one device per local rank; gloo on CPU) with ``timeout`` on every collective, so a
    dead rank ends the run with an error instead of a hang. Returns whether the run is
    distributed. What each rank prints is the application's choice (``rcdl reproduce``
    prints on rank 0 alone).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    return True
