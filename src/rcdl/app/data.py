"""Data sets. For now: a synthetic teacher–student regression task (docs/reference.md §8).

A randomly initialised teacher MLP maps Gaussian inputs ``x ~ N(0, I_{d_in})`` to targets
``y = teacher(x)``; the student (a growing network or an MLP) learns the map from samples.
The teacher has LeCun-normal weights, ``W ~ N(0, 1/fan_in)``, and its output is affinely
rescaled so that each output dimension has mean 0 and variance 1 over the input
distribution: predicting zero then scores a test MSE of about 1, a natural baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["TeacherConfig", "make_teacher", "make_teacher_data"]

_ACTS = {"tanh": nn.Tanh, "relu": nn.ReLU}
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_CALIBRATION_SAMPLES = 16_384
_BIAS_STD = 0.1


@dataclass(frozen=True)
class TeacherConfig:
    """A teacher–student regression task.

    Attributes:
        d_in: input dimension ``D_in``.
        hidden: teacher hidden width.
        d_out: output dimension ``D_out``.
        depth: number of hidden layers of the teacher (``depth + 1`` linear layers).
        act: teacher nonlinearity, ``"tanh"`` or ``"relu"``.
        n_train: number of training samples.
        n_test: number of test samples.
        noise: standard deviation of Gaussian noise added to the *training* targets only.
        seed: seeds the teacher, the training inputs, the test inputs and the noise
            (independent streams, so e.g. the test set does not depend on ``n_train``).
        dtype: ``"float32"`` or ``"float64"``.
    """

    d_in: int = 32
    hidden: int = 64
    d_out: int = 1
    depth: int = 2
    act: str = "tanh"
    n_train: int = 4000
    n_test: int = 1000
    noise: float = 0.0
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("d_in", "hidden", "d_out", "depth", "n_train", "n_test"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TeacherConfig.{name} must be a positive int, got {value!r}")
        if self.act not in _ACTS:
            raise ValueError(f"TeacherConfig.act must be one of {sorted(_ACTS)}, got {self.act!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"TeacherConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if not isinstance(self.noise, int | float) or not np.isfinite(self.noise) or self.noise < 0:
            raise ValueError(f"TeacherConfig.noise must be a finite float >= 0, got {self.noise!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"TeacherConfig.seed must be an int >= 0, got {self.seed!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def _generators(seed: int) -> tuple[torch.Generator, ...]:
    """Independent generators for (teacher, train inputs, test inputs, noise)."""
    seeds = np.random.SeedSequence(seed).generate_state(4, dtype=np.uint64)
    return tuple(torch.Generator().manual_seed(int(s) >> 1) for s in seeds)


@torch.no_grad()
def make_teacher(cfg: TeacherConfig) -> nn.Sequential:
    """The frozen teacher MLP of ``cfg``, ``(B, D_in) -> (B, D_out)``, unit-variance output."""
    gen = _generators(cfg.seed)[0]
    dtype = cfg.torch_dtype
    widths = [cfg.d_in] + [cfg.hidden] * cfg.depth + [cfg.d_out]
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        linear = nn.Linear(fan_in, fan_out, dtype=dtype)
        linear.weight.copy_(torch.randn(fan_out, fan_in, generator=gen, dtype=dtype))
        linear.weight.mul_(fan_in**-0.5)  # LeCun normal
        linear.bias.copy_(_BIAS_STD * torch.randn(fan_out, generator=gen, dtype=dtype))
        layers.append(linear)
        if i < cfg.depth:
            layers.append(_ACTS[cfg.act]())
    teacher = nn.Sequential(*layers).requires_grad_(False)

    # Rescale the last layer so every output has mean 0, variance 1 under x ~ N(0, I).
    x = torch.randn(_CALIBRATION_SAMPLES, cfg.d_in, generator=gen, dtype=dtype)  # (M, D_in)
    y = teacher(x)  # (M, D_out)
    mean, std = y.mean(0), y.std(0)  # (D_out,)
    if not torch.all(std > 0):
        raise RuntimeError(f"teacher output has zero variance in some dimension: std={std}")
    last = linear  # the readout: the loop's last layer
    last.weight.div_(std[:, None])
    last.bias.sub_(mean).div_(std)
    return teacher


@torch.no_grad()
def make_teacher_data(cfg: TeacherConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sample the task of ``cfg``; deterministic given ``cfg``.

    Returns:
        ``(x_train, y_train, x_test, y_test)`` with shapes ``(n_train, D_in)``,
        ``(n_train, D_out)``, ``(n_test, D_in)``, ``(n_test, D_out)`` on the CPU.
    """
    teacher = make_teacher(cfg)
    _, gen_train, gen_test, gen_noise = _generators(cfg.seed)
    dtype = cfg.torch_dtype
    x_train = torch.randn(cfg.n_train, cfg.d_in, generator=gen_train, dtype=dtype)
    x_test = torch.randn(cfg.n_test, cfg.d_in, generator=gen_test, dtype=dtype)
    y_train, y_test = teacher(x_train), teacher(x_test)
    if cfg.noise > 0:
        y_train = y_train + cfg.noise * torch.randn(y_train.shape, generator=gen_noise, dtype=dtype)
    return x_train, y_train, x_test, y_test
