"""The numbers behind the seam and fault fixes of 2026-12-01, in one run (docs/composition.md,
docs/faults.md, docs/precision.md):

1. stochastic rounding of one Adam block (85 × 3072 float32 to bfloat16): counter-based noise
   (rcdl.ops.rounding.rounding_noise) against torch's generator, median of 300 calls;
2. a gws training step (3072 → 10, depth 2, B = 16, about 3 000–5 000 entries per layer)
   with the look-ahead divergence check on and off, median of 100 steps;
3. a small bfloat16 hybrid (d = 5, AlwaysGrow, Adam 0.05, six steps): how far the outputs
   move when only the chunk size changes, against how far a float64 store moves them;
4. the divergence check on a 32 → 16 → 1 teacher task, two-block RBF net: steps accepted and
   the largest loss seen at lr 1e3 and 1e6.

    python benchmarks/bench_seams.py

Prints the CPU model and flags first; times compare only within one run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness import case, machine_line, timeit
from rcdl import (
    AlwaysGrow,
    ClippedSoftmaxRule,
    FunctionalSGD,
    Grower,
    GrowingRBFNet,
    GrowingSoftmaxNet,
    HybridGrower,
    HybridSoftmaxNet,
    growing_layers,
)
from rcdl.app.data import TeacherConfig, make_teacher_data
from rcdl.ops.rounding import round_stochastically, rounding_noise


@case("rounding", quick={"calls": 10}, rows=85, width=3072, calls=300)
def rounding_case(rows: int, width: int, calls: int) -> dict[str, float]:
    """Stochastic rounding of a ``(rows, width)`` float32 block to bfloat16 with
    counter-based noise and with torch's generator: median seconds of ``calls`` calls after
    20 untimed ones."""
    x, ids = torch.randn(rows, width), torch.arange(1000, 1000 + rows)
    step = torch.tensor(5)
    return {"generator": timeit(lambda: round_stochastically(x, torch.bfloat16), calls,
                                warmup=20).median,
            "counter": timeit(lambda: round_stochastically(
                x, torch.bfloat16, rounding_noise(seed=3, step=step, ids=ids, width=width)),
                calls, warmup=20).median}


def rounding() -> None:
    ms = {k: 1e3 * v for k, v in rounding_case(85, 3072, 300).items()}
    print(f"1. rounding an 85x3072 block: counter-based {ms['counter']:.3f} ms, torch's "
          f"generator {ms['generator']:.3f} ms (median of 300)")


def look_ahead() -> None:
    x, y = torch.randn(16 * 300, 3072), torch.randint(0, 10, (16 * 300,))
    result = {}
    for check in (True, False, True, False):
        torch.manual_seed(0)
        net = GrowingSoftmaxNet(3072, 10, 2, temperature=6.0,
                                rule=ClippedSoftmaxRule(0.003, 3.0))
        grower = Grower(net)
        for _, layer in growing_layers(net):
            layer.max_output_growth = 1e4 if check else None
        batches = iter(range(300))

        def step(net=net, grower=grower, batches=batches) -> None:  # noqa: ANN001
            i = next(batches)
            F.cross_entropy(net(x[16 * i : 16 * i + 16]), y[16 * i : 16 * i + 16]).backward()
            grower.step()

        result.setdefault(check, []).append(1e3 * timeit(step, 100, warmup=200).median)
    on, off = (", ".join(f"{t:.1f}" for t in result[k]) for k in (True, False))
    print(f"2. gws step (median, steps 200-300, two runs each): look-ahead on {on} ms, "
          f"off {off} ms")


def half_layouts() -> None:
    def run(store, chunk):
        torch.manual_seed(0)
        net = HybridSoftmaxNet(5, 3, 1, temperature=1.0, initial_entries=4,
                               rule=ClippedSoftmaxRule(1.0, 2.0), trigger=AlwaysGrow(),
                               store_dtype=store).double()
        for _, layer in growing_layers(net):
            layer.chunk_size = chunk
        opt = HybridGrower(net, lr=0.05)
        for step, n in enumerate((1, 7, 7, 5, 7, 6)):
            gen = torch.Generator().manual_seed(100 + step)
            xb = torch.randn(n, 5, generator=gen, dtype=torch.float64)
            F.mse_loss(net.train()(xb), torch.tanh(2 * xb[:, :3])).backward()
            opt.step()
            opt.zero_grad()
        q = torch.randn(9, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        with torch.no_grad():
            return net.eval()(q)

    ref = run(torch.bfloat16, None)
    moves = [float((run(torch.bfloat16, c) - ref).abs().max()) for c in (1, 3)]
    gap = float((run(None, None) - ref).abs().max())
    print(f"3. bfloat16 hybrid: chunk 1 / 3 instead of the default move the outputs by "
          f"{moves[0]:.3f} / {moves[1]:.3f}; a float64 store by {gap:.3f} (outputs up to "
          f"{float(ref.abs().max()):.2f})")


def divergence() -> None:
    x, y, _, _ = make_teacher_data(TeacherConfig(d_in=32, hidden=16, d_out=1, n_train=512,
                                                 n_test=64))
    for lr in (1e3, 1e6):
        torch.manual_seed(0)
        net = GrowingRBFNet(32, 1, 2, temperature=1.0, rule=FunctionalSGD(lr))
        grower, accepted, losses = Grower(net), 0, []
        for i in range(0, 512, 16):
            loss = F.mse_loss(net(x[i : i + 16]), y[i : i + 16])
            losses.append(loss.item())
            loss.backward()
            try:
                grower.step()
            except ValueError:
                break
            accepted += 1
        print(f"4. RBF lr {lr:g}: {accepted} step(s) written before a refusal, largest loss "
              f"{max(losses):.3g}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(machine_line())
    rounding()
    look_ahead()
    half_layouts()
    divergence()
