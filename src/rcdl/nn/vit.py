"""A small Vision Transformer whose feed-forward blocks may be RCDL layers (docs/reference.md §8).

The paper replaces the feed-forward block of every layer of a ViT by a weighted-softmax RCDL
layer trained the hybrid way (docs/reference.md §4) and reports 48.4 % → 54.4 % on CIFAR-10 after
one epoch. This module builds both networks from the same parts; only the FFN differs::

    x (B, 3072) HWC  →  patches (B, P, p·p·3)  →  tokens (B, P, d) + position embedding
    [class token]    →  (B, S, d),  S = P (+ 1)
    depth × { x ← x + MHSA(LN(x));  x ← x + FFN(LN(x)) }      (pre-norm blocks)
    logits = head(LN(pool(x)))       pool: the class token or the mean over tokens

- :class:`MLPFeedForward` — the usual FFN, ``Linear(d, r·d) → GELU → Linear(r·d, d)``.
- :class:`RCDLFeedForward` — ``γ · s(RMSNorm(u))`` with ``s`` a
  :class:`~rcdl.nn.hybrid.HybridSoftmax` ``d → d``: a store of entries, one written per token
  that its gate lets through, and every stored entry trained by Adam
  (:class:`~rcdl.optim.entry_adam.EntryAdam`, which also trains the attention, embeddings, norms and
  head as ordinary parameters).

The RCDL FFN normalises its query once more with a scale-free RMSNorm, after the block's
LayerNorm, so that every query has norm exactly ``√d``: the distance gate's τ and the
softmax temperature T then mean the same thing at any width (docs/vit.md). The layer's
input ``(B, S, d)`` keeps its sample dimension first, so the per-sample gradients the gws
rule needs are ``B · ∂(mean loss)/∂s`` per token (:class:`~rcdl.nn.layers.GrowingLayer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcdl.nn.gates import DistanceGate, GrowthTrigger
from rcdl.nn.hybrid import HybridSoftmax
from rcdl.nn.networks import rms_norm
from rcdl.nn.rules import ClippedSoftmaxRule

__all__ = [
    "MLPFeedForward", "PatchEmbedding", "RCDLFeedForward", "SelfAttention", "ViT",
    "ViTBlock", "mlp_vit", "rcdl_vit",
]  # fmt: skip

_POOLS = ("cls", "mean")


class PatchEmbedding(nn.Module):
    """Flattened HWC images ``(B, H·W·C)`` → patch tokens ``(B, P, d)``, ``P = (H/p)·(W/p)``.

    Each ``p × p × C`` patch, flattened in ``(row, column, channel)`` order, is mapped by one
    linear layer ``p·p·C → d`` (a convolution with stride ``p``, written as a matmul).
    """

    def __init__(self, image_size: int, channels: int, patch_size: int, width: int) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"PatchEmbedding: patch_size {patch_size} does not divide the "
                             f"image size {image_size}")
        self.image_size, self.channels, self.patch_size = image_size, channels, patch_size
        self.grid = image_size // patch_size
        self.proj = nn.Linear(patch_size * patch_size * channels, width)

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    def forward(self, x: Tensor) -> Tensor:  # (B, H·W·C) -> (B, P, d)
        n, g, p, c = x.shape[0], self.grid, self.patch_size, self.channels
        if x.dim() != 2 or x.shape[1] != self.image_size**2 * c:
            raise ValueError(f"PatchEmbedding: expected flattened HWC images (B, "
                             f"{self.image_size**2 * c}), got {tuple(x.shape)}")
        patches = x.view(n, g, p, g, p, c).permute(0, 1, 3, 2, 4, 5)  # (B, g, g, p, p, C)
        return self.proj(patches.reshape(n, g * g, p * p * c))  # (B, P, d)


class SelfAttention(nn.Module):
    """Multi-head softmax self-attention over the tokens, ``(B, S, d) → (B, S, d)``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"SelfAttention: {heads} heads do not divide the width {width}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:  # (B, S, d)
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (B, heads, S, d/heads)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class MLPFeedForward(nn.Sequential):
    """The usual ViT feed-forward block: ``Linear(d, r·d) → GELU → Linear(r·d, d)``."""

    def __init__(self, width: int, ratio: int = 4) -> None:
        super().__init__(nn.Linear(width, ratio * width), nn.GELU(), nn.Linear(ratio * width,
                                                                             width))


class RCDLFeedForward(nn.Module):
    """A hybrid weighted-softmax RCDL layer as the feed-forward block
    (docs/reference.md §2, §4, §8).

    ``ffn(u) = γ · s(q)``, ``q = u / rms(u)`` (``‖q‖ = √d``), with ``s`` the weighted softmax
    ``s(q) = Σ_j e^{z_j} ṽ_j / Σ_j w_j e^{z_j}``, ``z_j = ⟨q, k_j⟩ / (T √d)``, over the
    entries of :attr:`layer`, a :class:`~rcdl.nn.hybrid.HybridSoftmax` ``d → d``. Every stored
    key, weighted value and weight is trained by Adam; after each step a token writes its gws
    entry (``k = q``, ``ṽ = −β g``, ``w = max(0, η clip(⟨s, g⟩, −B, B))``) when its query
    is farther than τ from every stored key (the ``trigger``).

    Args:
        width: ``d``.
        temperature: T. Logits of unit-norm directions range over ``±√d / T``.
        rule: the gws rule (default ``ClippedSoftmaxRule(eta=10, beta=0.3)``, chosen by the
            probes of docs/vit.md; docs/reference.md §6's hybrid MLP uses η = 1, β = 30).
        trigger: the growth trigger (default ``DistanceGate(√d)``: τ equal to the query
            norm; docs/reference.md §6's τ = 50 at d = 3072 is 0.90 √d).
        scale: γ, a fixed output scale (1: the layer's output enters the residual stream as
            it is, as in docs/reference.md §6's backbone).
        initial_entries: the starting store of docs/reference.md §6 (RMS-normalised random
            keys and weighted values, weight ``1/initial_entries`` each), seeded by ``seed``.
        seed: seeds the starting store.
    """

    def __init__(self, width: int, *, temperature: float, rule: ClippedSoftmaxRule | None = None,
                 trigger: GrowthTrigger | None = None, scale: float = 1.0,
                 initial_entries: int = 16, seed: int | None = None) -> None:
        super().__init__()
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"RCDLFeedForward: scale must be a finite number > 0, got {scale}")
        rule = ClippedSoftmaxRule(eta=10.0, beta=0.3) if rule is None else rule
        trigger = DistanceGate(math.sqrt(width)) if trigger is None else trigger
        self.norm = rms_norm(width)
        self.layer = HybridSoftmax(width, width, temperature=temperature, rule=rule,
                                   trigger=trigger, initial_entries=initial_entries, seed=seed)
        self.scale = scale

    def forward(self, u: Tensor) -> Tensor:  # (B, S, d) -> (B, S, d)
        s = self.layer(self.norm(u))
        return s if self.scale == 1.0 else self.scale * s

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class ViTBlock(nn.Module):
    """Pre-norm transformer block: ``x ← x + attn(LN(x))``, ``x ← x + ffn(LN(x))``."""

    def __init__(self, width: int, heads: int, ffn: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.ffn = ffn

    def forward(self, x: Tensor) -> Tensor:  # (B, S, d)
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class ViT(nn.Module):
    """A small Vision Transformer for flattened HWC images with a pluggable FFN.

    Args:
        make_ffn: ``make_ffn(i, width) -> nn.Module`` builds the feed-forward block of
            layer ``i``, a map ``(B, S, d) → (B, S, d)``.
        image_size: the data's image side (CIFAR-10: 32).
        channels: the data's channels (CIFAR-10: 3).
        classes: the data's classes (CIFAR-10: 10).
        patch_size: ``p``; ``P = (image_size / p)²`` tokens per image.
        width: ``d``.
        depth: blocks.
        heads: attention heads.
        pool: ``"cls"`` (a learned class token, its final state is read out) or ``"mean"``
            (the mean of the final tokens).

    The learned position embedding starts as ``N(0, 0.02²)``, the class token at zero, the
    linear layers at PyTorch's defaults. Every FFN is built *after* all shared parts, so two
    ViTs that differ only in ``make_ffn`` start from the same attention, embeddings and head
    when torch's global generator is seeded alike.
    """

    def __init__(self, make_ffn: Callable[[int, int], nn.Module], *, image_size: int = 32,
                 channels: int = 3, classes: int = 10, patch_size: int = 4, width: int = 64,
                 depth: int = 4, heads: int = 4, pool: str = "cls") -> None:
        super().__init__()
        if pool not in _POOLS:
            raise ValueError(f"ViT: pool must be one of {list(_POOLS)}, got {pool!r}")
        if depth < 1 or width < 1:
            raise ValueError(f"ViT: depth and width must be >= 1, got {depth} and {width}")
        self.pool = pool
        self.embed = PatchEmbedding(image_size, channels, patch_size, width)
        tokens = self.embed.num_patches + (pool == "cls")
        self.pos = nn.Parameter(torch.randn(1, tokens, width) * 0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, width)) if pool == "cls" else None
        self.blocks = nn.ModuleList(ViTBlock(width, heads, nn.Identity()) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)
        for i, block in enumerate(self.blocks):  # FFNs last: see the class docstring
            block.ffn = make_ffn(i, width)

    def forward(self, x: Tensor) -> Tensor:  # (B, H·W·C) -> (B, classes)
        t = self.embed(x)  # (B, P, d)
        if self.cls is not None:
            t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1)  # (B, P + 1, d)
        t = t + self.pos
        for block in self.blocks:
            t = block(t)
        pooled = t[:, 0] if self.pool == "cls" else t.mean(dim=1)  # (B, d)
        return self.head(self.norm(pooled))


def mlp_vit(*, mlp_ratio: int = 4, **vit_kw) -> ViT:
    """The standard ViT: every FFN an :class:`MLPFeedForward` of hidden width ``r·d``."""
    return ViT(lambda i, width: MLPFeedForward(width, mlp_ratio), **vit_kw)


def rcdl_vit(*, temperature: float, rule: ClippedSoftmaxRule | None = None,
             tau: float | None = None, trigger: GrowthTrigger | None = None,
             scale: float = 1.0, initial_entries: int = 16, seed: int = 0, **vit_kw) -> ViT:
    """The RCDL-FFN ViT: every FFN an :class:`RCDLFeedForward` (docs/reference.md §8).

    Args:
        tau: the distance gate's threshold τ (absolute, in the units of ``‖q‖ = √d``); give
            ``tau`` or ``trigger`` or neither (default: ``DistanceGate(√d)``).
        seed: layer ``i``'s initial entries are seeded by ``seed + i``.

    Others: as :class:`RCDLFeedForward` and :class:`ViT`.
    """
    if tau is not None and trigger is not None:
        raise ValueError("rcdl_vit: give tau or trigger, not both")
    if tau is not None:
        trigger = DistanceGate(tau)

    def make(i: int, width: int) -> RCDLFeedForward:
        return RCDLFeedForward(width, temperature=temperature, rule=rule, trigger=trigger,
                               scale=scale, initial_entries=initial_entries, seed=seed + i)

    return ViT(make, **vit_kw)
