"""`rcdl forget --mode exact` on a kept CIFAR-10 gws run, in a new process, against retraining.

    python benchmarks/forget_command_check.py --data-dir DIR [--out runs/forget-check]

Trains gws one pass on a random 5 000-image subset (data seed 0) with `--keep-models
--replay-every 1`, forgets three samples exactly with `rcdl forget` in a new process, retrains
on the stream without them in this process, and prints whether the test predictions agree bit
for bit, the receipt's file scan and the times (docs/unlearning.md, "A deletion request").
"""
import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rcdl.app.experiments.cifar10.config import Cifar10Config, load_data
from rcdl.app.models import build_model
from rcdl.app.rundir import describe_machine, read_config
from rcdl.ops.half import products_as
from rcdl.train.checkpoint import load_checkpoint, load_model_state
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import stream_without

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data-dir", required=True)
parser.add_argument("--out", default="runs/forget-check", help="run folder (replaced)")
parser.add_argument("--images", type=int, default=5000)
args = parser.parse_args()
DATA, RUN, FORGET = args.data_dir, Path(args.out), [100, args.images // 2, args.images - 100]
shutil.rmtree(RUN, ignore_errors=True)
print(describe_machine("cpu"))
t = time.perf_counter()
subprocess.run([sys.executable, "-m", "rcdl", "reproduce", "cifar10-1epoch", "--models", "gws",
                "--train-size", str(args.images), "--test-size", "1000", "--keep-models",
                "--replay-every", "1", "--data-dir", DATA, "--out", str(RUN), "--no-progress",
                "--threads", "2"], check=True)
print(f"trained and kept in {time.perf_counter() - t:.1f} s")
before = ReplayLog.load(RUN / "models" / "gws-seed0.log.pt")
print("kept files:", {p.name: p.stat().st_size for p in (RUN / "models").iterdir()})
t = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "rcdl", "forget", str(RUN), "--samples",
                       ",".join(map(str, FORGET)), "--mode", "exact", "--data-dir", DATA],
                      capture_output=True, text=True)
print(f"rcdl forget (new process) exit {done.returncode} in {time.perf_counter() - t:.1f} s")
print(done.stdout[-3000:], done.stderr[-2000:])
cfg = read_config(RUN, Cifar10Config)
data = load_data(Cifar10Config(data_dir=DATA, train_size=args.images, test_size=1000),
                 download=False)
x, y, xt, yt = data.x_train.float(), data.y_train, data.x_test.float(), data.y_test
saved = load_checkpoint(RUN / "models" / "gws-seed0.pt")
model, _, _ = build_model("gws", 0, dtype=cfg.torch_dtype)
load_model_state(model, saved["state"])
retrained, _, grower = build_model("gws", 0, dtype=cfg.torch_dtype)
t = time.perf_counter()
with products_as(before.products):  # the run's product path
    train_one_pass(retrained, (x, y, xt, yt), batch_size=16, seed=0, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=10**6, progress=False,
                   order=stream_without(before, FORGET))
print(f"retrained without samples {FORGET} in {time.perf_counter() - t:.1f} s")
model.eval()
retrained.eval()
with torch.no_grad():
    a, b = model(xt), retrained(xt)
print(f"test outputs bit-identical: {torch.equal(a, b)} (largest difference "
      f"{(a - b).abs().max().item():.3g}); test accuracy {(a.argmax(1) == yt).float().mean():.4f}")
lines = (RUN / "forget_receipts.jsonl").read_text().splitlines()
receipt = json.loads(lines[-1])
print("receipt:", {k: receipt[k] for k in ("mode", "samples", "clean")})
