"""The Triton compute path against the streaming one, on a GPU's real shapes (docs/precision.md,
"The Triton kernel").

For each kernel and store dtype, at the training batch (16 queries, forward and backward with
the query gradient) and the evaluation batch (500 queries, forward), over ``--entries``
entries of width ``--width``: the largest relative error of the output and of the query
gradient of the Triton path against the streaming path with float32 products
(``half_products("float32")``: both multiply the stored numbers in float32, so they agree to
float32's rounding), and each path's median time per call, with the Triton path's floor on
this GPU by the traffic model (:mod:`rcdl.ops.triton_traffic`; an H200's rates on an H200,
an H100 SXM's on any other). Prints one line per case and exits non-zero when an error
exceeds ``--rtol``: the first step of ``benchmarks/gpu_speed.sh``.

    python benchmarks/check_triton.py [--entries 50000 --width 3072]

``--device cpu`` runs the same comparison on CPU through Triton's interpreter (small shapes
only: ``--entries 40 --width 16 --batches 16 20``), which is how the script itself is checked
without a GPU (``tests/test_triton_attention.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from harness import machine_line, timeit


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--entries", type=int, default=50_000)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--kernels", nargs="+", default=["softmax", "rbf", "linear"])
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--batches", type=int, nargs=2, default=[16, 500],
                        metavar=("TRAIN", "EVAL"), help="queries per training / evaluation call")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from rcdl.ops.attention import attention, register_path, unregister_path
    from rcdl.ops.half import half_products
    from rcdl.ops.triton_attention import TRITON, TritonAttention, triton_available, triton_paths
    from rcdl.ops.triton_traffic import (
        GPUS,
        Problem,
        backward_launches,
        forward_launches,
        keeps,
        seconds,
    )

    if not triton_available():
        print("triton is not installed: pip install -e '.[triton]'")
        return 1
    if device.type == "cpu":  # the interpreter: small blocks for small shapes
        path = register_path(TritonAttention(block_b=16, block_n=16, block_d=16, block_v=16),
                             device="cpu", dtypes=[torch.float32, torch.bfloat16],
                             kernels=args.kernels)
    else:
        path = TRITON  # registered for CUDA on import
    gen = torch.Generator().manual_seed(0)
    n, d = args.entries, args.width
    keys = torch.randn(n, d, generator=gen) / d**0.25
    values = 0.01 * torch.randn(n, d, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.1
    failed = False
    gpu = None
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        gpu = GPUS["h200" if "H200" in properties.name else "h100"]
    print(f"# {device}: {machine_line(device)}; {n} entries of width {d}; rtol {args.rtol}"
          + (f"; floors by the traffic model at {gpu.name} rates" if gpu else ""))
    for dtype in (torch.float32, torch.bfloat16):
        k, v, w = (t.to(device) for t in (keys.to(dtype), values.to(dtype), weights))
        for kernel in args.kernels:
            for batch, train in ((args.batches[0], True), (args.batches[1], False)):
                q = torch.randn(batch, d, generator=gen).to(device).requires_grad_(train)

                def call(q=q, k=k, v=v, w=w, kernel=kernel, train=train):  # noqa: ANN001, ANN202
                    q.grad = None
                    with torch.set_grad_enabled(train):
                        out = attention(q, k, v, w, kernel=kernel)
                        if train:
                            out.square().sum().backward()
                    return out.detach(), (q.grad if train else None)

                fast, fast_s = call(), timeit(call, 5).median
                unregister_path(path)
                try:
                    with half_products("float32"):
                        slow, slow_s = call(), timeit(call, 5).median
                finally:
                    register_path(path, device=device.type,
                                  dtypes=[torch.float32, torch.bfloat16], kernels=args.kernels)
                errors = [relative_error(fast[0], slow[0])]
                if train:
                    errors.append(relative_error(fast[1], slow[1]))
                bad = max(errors) > args.rtol
                failed |= bad
                floor = ""
                if gpu is not None:
                    problem = Problem(batch, n, d, d, kernel, store_bytes=k.element_size(),
                                      multiprocessors=gpu.multiprocessors)
                    launches = forward_launches(problem) + (
                        backward_launches(problem, (True, False, False, False), keeps(problem))
                        if train else [])
                    floor = f" (floor {seconds(launches, gpu) * 1e3:.2f} ms)"
                print(f"{str(dtype).removeprefix('torch.'):8} {kernel:8} B={batch:3} "
                      f"{'train' if train else 'eval '}: rel. error "
                      f"{' / '.join(f'{e:.1e}' for e in errors)}{'  FAILED' if bad else ''}; "
                      f"triton {fast_s * 1e3:.2f} ms{floor}, streaming {slow_s * 1e3:.2f} ms",
                      flush=True)
    # on a GPU the path checks itself at its first call and, where it disagrees, leaves the
    # calls to streaming: the rows above then compared streaming with itself
    for where, taken in triton_paths().items():
        declined = taken != "triton"
        failed |= declined
        print(f"first-use check, {where}: {taken}{'  FAILED' if declined else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
