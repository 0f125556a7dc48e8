"""What the class-incremental experiment measures and concludes
(:mod:`rcdl.app.experiments.continual`): the metrics of an accuracy matrix, what a growing
model's entries still hold after the last task (:func:`own_entries_copy`,
:func:`entries_by_task`, :func:`value_mass`), and the summary's rows and verdict over every
(model, order, seed)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rcdl.app.experiments.continual.spec import CLASSES, ContinualConfig, ModelName
from rcdl.app.report import mean_sd
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import UNKNOWN, entry_samples
from rcdl.nn.layers import growing_layers
from rcdl.nn.networks import eval_mode, layer_input
from rcdl.ops.kernels import RBFKernel

__all__ = ["KEPT_TARGET", "METRICS", "average_incremental_accuracy", "backward_transfer",
           "entries_by_task", "finish", "forgetting", "mean_known", "own_entries_copy",
           "readout_rows", "readouts", "rows", "silent_rows", "value_mass", "verdict"]


# --------------------------------------------------------------------------- metrics


def _lower(matrix: Sequence[Sequence[float | None]]) -> int:
    """The number of tasks ``T`` of a square accuracy matrix (checked)."""
    t = len(matrix)
    if t == 0 or any(len(row) != t for row in matrix):
        raise ValueError(f"expected a square T × T accuracy matrix, got rows of lengths "
                         f"{[len(row) for row in matrix]}")
    return t


def mean_known(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are not ``None`` (``None`` if none is)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def average_incremental_accuracy(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Rebuffi et al. (iCaRL, 2017): the mean over the steps ``i`` of the accuracy on every
    class seen so far, ``(1/T) Σ_i (1/i) Σ_{j≤i} R[i][j]`` (tasks of equal test size;
    ``None`` entries, tasks without test images, left out)."""
    t = _lower(matrix)
    return mean_known([mean_known(matrix[i][: i + 1]) for i in range(t)])


def backward_transfer(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Lopez-Paz & Ranzato (GEM, 2017): ``(1/(T−1)) Σ_{j<T} (R[T][j] − R[j][j])``, how much
    learning the later tasks changed the accuracy on each earlier one (negative: forgotten;
    ``None`` for one task)."""
    t = _lower(matrix)
    changes: list[float | None] = []
    for j in range(t - 1):
        last, learnt = matrix[-1][j], matrix[j][j]
        changes.append(None if last is None or learnt is None else last - learnt)
    return mean_known(changes)


def forgetting(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Chaudhry et al. (RWalk, 2018): ``(1/(T−1)) Σ_{j<T} max_{i<T} (R[i][j] − R[T][j])``
    over ``i ≥ j``, the drop from each earlier task's best accuracy to its last."""
    t = _lower(matrix)
    drops: list[float | None] = []
    for j in range(t - 1):
        best = [v for i in range(j, t - 1) if (v := matrix[i][j]) is not None]
        last = matrix[-1][j]
        drops.append(None if not best or last is None else max(best) - last)
    return mean_known(drops)


# --------------------------------------------------------------------------- memories


def own_entries_copy(model: nn.Module, keep: Tensor) -> tuple[nn.Module, dict[str, int]]:
    """A deep copy of ``model`` whose growing layers keep only the entries written by the
    training samples ``keep`` (indices) and those of unknown origin (initial entries): in
    the copy, :func:`rcdl.memory.forgetting.forget` removes every other sample's entries; with the
    entries each layer kept."""
    restricted = copy.deepcopy(model)
    layers = growing_layers(restricted)
    owners = torch.cat([entry_samples(layer) for _, layer in layers]).unique()  # (S,)
    others = owners[~torch.isin(owners, keep.to(owners.device)) & (owners != UNKNOWN)]
    forget(restricted, others, scan=False)  # the entries of unknown origin stay
    return restricted, {name: len(layer.store) for name, layer in layers}


def entries_by_task(model: nn.Module, task_of_sample: Tensor, tasks: int) -> list[int]:
    """How many stored entries (over every growing layer) each task's training samples
    wrote; ``task_of_sample (n,)`` maps a sample index to its task."""
    counts = torch.zeros(tasks, dtype=torch.long)
    for _, layer in growing_layers(model):
        owners = entry_samples(layer).cpu()
        counts += torch.bincount(task_of_sample[owners[owners != UNKNOWN]], minlength=tasks)
    return counts.tolist()


def value_mass(model: nn.Module, task_of_sample: Tensor,
               tasks: Sequence[Sequence[int]]) -> list[list[float]]:  # fmt: skip
    """The signed value mass the readout's entries put on each class, by the task whose
    images wrote them: ``M[t][k] = Σ_{j written by task t} v_j[c_k]`` over the readout's
    (the last growing layer's) stored values, ``c_k`` the ``k``-th class of the order
    (the classes of task 1 first). A plain growing readout's write is ``v = −η g`` with
    ``g = softmax(s) − onehot(y)``: positive on the sample's class, negative on the
    classes the model then predicted (results/continual/LOG.md, "Why the retrieval fails")."""
    _, readout = growing_layers(model)[-1]
    owners = entry_samples(readout).cpu()
    values = readout.store.values.detach().double().cpu()  # (N, C)
    known = owners != UNKNOWN
    task = task_of_sample[owners[known]]  # (N_known,)
    order = [c for classes in tasks for c in classes]
    mass = torch.zeros(len(tasks), len(order), dtype=torch.float64)
    mass.index_add_(0, task, values[known][:, order])
    return mass.tolist()


def readouts(model: nn.Module, x: Tensor, y: Tensor, y_train: Tensor,
             tasks: Sequence[Sequence[int]], chosen: Sequence[str],
             batch_size: int) -> dict[str, float]:  # fmt: skip
    """The accuracy (percent) on the test images ``x (M, d)``, ``y (M,)`` of the trained RBF
    X; nothing is
    trained again and no image replayed. With ``k(q, k_j) = exp(−‖q − k_j‖² / (2τ))``,
    ``τ = T √d`` (the readout's kernel) and the readout's logits ``s(q) = Σ_j k(q, k_j) v_j``:

    - ``as-trained``: ``argmax s(q)``, the model's own 10-way answer;
    - ``task-inference``: the task ``t* = argmax_t Σ_{j∈t} k(q, k_j)`` whose entries carry
      the most kernel mass at the query (the retrieval analogue of PEC's per-class error),
      then the argmax of ``s(q)`` over ``t*``'s classes;
    - ``task-balanced``: each task's logits divided by its entries' kernel mass at ``q``;
    - ``sharper-kernel``: ``Σ_j k(q, k_j)² v_j``, the temperature halved at test time.

    An entry's task is that of the training sample that wrote it (its index into
    ``y_train (n,)``, :func:`rcdl.memory.provenance.entry_samples`). With a task-mass
    readout comes ``task_identified``: the share of images whose task ``t*`` is theirs.

    Raises:
        ValueError: the model's readout is not a growing RBF layer.
    """
    layer = getattr(model, "readout", None)
    if layer is None or not isinstance(getattr(layer, "kernel", None), RBFKernel):
        raise ValueError(f"readouts: expected a network whose readout is a growing RBF "
                         f"layer, got {type(layer).__name__}")
    device = layer.store.keys.device
    with torch.no_grad(), eval_mode(model):
        logits = torch.cat([model(b.to(device)).float().cpu()
                            for b in x.split(batch_size)])  # (M, C)
    q = torch.cat([layer_input(model, layer, b.to(device)).float().cpu()
                   for b in x.split(batch_size)])  # (M, d)
    keys = layer.store.keys.detach().float().cpu()  # (N, d)
    values = layer.store.values.detach().float().cpu()  # (N, C)
    tau = layer.temperature * math.sqrt(keys.shape[1])
    sq = torch.cdist(q, keys).square()  # (M, N)
    kernel = torch.exp(-sq / (2 * tau))  # (M, N)
    torch.testing.assert_close(kernel @ values, logits, rtol=1e-3, atol=1e-3)  # the layer's

    def acc(scores: Tensor) -> float:
        return 100 * (scores.argmax(1) == y).float().mean().item()

    task_of_class = torch.empty(CLASSES, dtype=torch.long)
    for t, classes in enumerate(tasks):
        task_of_class[list(classes)] = t
    owners = entry_samples(layer).cpu()  # (N,)
    entry_task = torch.where(owners == UNKNOWN, -1,
                             task_of_class[y_train[owners.clamp_min(0)]])  # (N,), -1: unknown
    out: dict[str, float] = {}
    if "as-trained" in chosen:
        out["as-trained"] = acc(logits)
    if "task-inference" in chosen or "task-balanced" in chosen:
        mass = torch.stack([kernel[:, entry_task == t].sum(1) for t in range(len(tasks))],
                           1)  # (M, T)
        inferred = mass.argmax(1)  # (M,)
        within = torch.full_like(logits, -torch.inf)
        balanced = logits.clone()
        for t, classes in enumerate(tasks):
            cols = list(classes)
            mine = inferred == t
            within[mine.nonzero(), torch.tensor(cols)] = logits[mine][:, cols]
            balanced[:, cols] = logits[:, cols] / mass[:, t : t + 1].clamp_min(1e-30)
        if "task-inference" in chosen:
            out["task-inference"] = acc(within)
        if "task-balanced" in chosen:
            out["task-balanced"] = acc(balanced)
        out["task_identified"] = 100 * (inferred == task_of_class[y]).float().mean().item()
    if "sharper-kernel" in chosen:
        out["sharper-kernel"] = acc(torch.exp(-sq / tau) @ values)
    if "task_identified" in out:  # after the readouts
        out["task_identified"] = out.pop("task_identified")
    return out


# --------------------------------------------------------------------------- summary rows

METRICS = ("acc", "aia", "bwt", "aware_bwt", "forgetting", "iid_acc", "gap", "kept")


def _per_run(run: dict[str, Any], iid: dict[int, float | None]) -> dict[str, float | None]:
    """One class-incremental run's metrics, against the i.i.d. accuracy of its seed."""
    reference = iid.get(run["seed"])
    final = run["acc"]
    return {"acc": final, "aia": average_incremental_accuracy(run["matrix"]),
            "bwt": backward_transfer(run["matrix"]),
            "aware_bwt": backward_transfer(run["aware_matrix"]),
            "forgetting": forgetting(run["matrix"]),
            "iid_acc": reference,
            "gap": None if reference is None else reference - final,
            "kept": None if not reference else 100 * final / reference}


def _iid(cfg: ContinualConfig, runs: list[dict[str, Any]], name: str) -> dict[int, Any]:
    base = ModelName.parse(name).iid(cfg.regularised_base)
    return {r["seed"]: r["acc"] for r in runs if r["order"] == "iid" and r["model"] == base}


def rows(cfg: ContinualConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, order), and one per model over every order (``order="all"``):
    each metric's mean and sd over the runs (seeds × orders)."""
    out = []
    for name in cfg.models:
        iid, parsed = _iid(cfg, runs, name), ModelName.parse(name)
        for order in ("all", *cfg.orders):
            done = [r for r in runs if r["model"] == name and r["order"] != "iid"
                    and order in ("all", r["order"])]
            if not done:
                continue
            measured = [_per_run(r, iid) for r in done]
            row: dict[str, Any] = {
                "model": name, "label": parsed.label(cfg.regularised_base, cfg.vote_sharpness),
                "kind": parsed.kind, "order": order, "runs": len(done)}
            for metric in METRICS:
                row[metric], row[metric + "_sd"] = mean_sd(
                    [v for m in measured if (v := m[metric]) is not None])
            row["train_seconds"], _ = mean_sd([r["train_seconds"] for r in done])
            row["eval_seconds"], _ = mean_sd([r["eval_seconds"] for r in done])
            out.append(row)
    return out


def _mean_matrix(done: list[dict[str, Any]], key: str = "matrix") -> list[list[float | None]]:
    """The element-wise mean of the runs' matrices (by task position)."""
    t = len(done[0][key])
    return [[mean_known([r[key][i][j] for r in done]) for j in range(t)] for i in range(t)]


def silent_rows(cfg: ContinualConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model trained by passes and task position: the accuracy on the task's images
    just after learning it (10-way and task-aware), after the last task with the whole
    model (the same two) and, for a growing model, from its own entries alone, and the
    share of its entries still stored (means over seeds and orders)."""
    out = []
    for name in cfg.models:
        done = [r for r in runs if r["model"] == name and r["order"] != "iid"
                and r["kind"] != "pixels"]
        if not done:
            continue
        grown = [r for r in done if "silent" in r]  # growing models: their own entries
        for t in range(len(done[0]["tasks"])):
            row: dict[str, Any] = {"model": name, "task": t + 1, "runs": len(done)}
            for key, values in (
                    ("learnt_acc", [r["matrix"][t][t] for r in done]),
                    ("learnt_aware_acc", [r["aware_matrix"][t][t] for r in done]),
                    ("full_acc", [r["matrix"][-1][t] for r in done]),
                    ("task_aware_acc", [r["aware_matrix"][-1][t] for r in done]),
                    ("own_entries_acc", [r["silent"]["own_entries"][t] for r in grown])):
                row[key], row[key + "_sd"] = mean_sd([v for v in values if v is not None])
            written = [r["entries_written"][t] for r in grown]
            stored = [r["silent"]["entries_stored"][t] for r in grown]
            out.append({**row, "entries_written": mean_known(written),
                        "entries_stored": mean_known(stored),
                        "stored_pct": 100 * sum(stored) / sum(written) if sum(written) else None})
    return out


KEPT_TARGET = 90.0  # percent of its own i.i.d. one-pass accuracy (docs/continual.md)


def verdict(rows_: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per growing model, over every order and seed: is its final accuracy above every
    non-replay MLP method's and above raw-pixel kNN and streaming LDA (the best of them,
    ``best_knn``), is it above PEC (where PEC was run), and does it keep
    :data:`KEPT_TARGET` percent of its i.i.d. accuracy?"""
    overall = [r for r in rows_ if r["order"] == "all"]
    mlps = [r for r in overall if r["kind"] == "parametric"]
    knns = [r for r in overall if r["model"].startswith("knn-") or r["model"] == "slda"]
    best_mlp = max(mlps, key=lambda r: r["acc"], default=None)
    best_knn = max(knns, key=lambda r: r["acc"], default=None)
    pec = next((r for r in overall if r["model"] == "pec"), None)
    out = {}
    for r in overall:
        if r["kind"] != "growing":
            continue
        out[r["model"]] = {
            "acc": r["acc"], "kept": r["kept"],
            "above_mlps": None if best_mlp is None else r["acc"] > best_mlp["acc"],
            "best_mlp": None if best_mlp is None else best_mlp["model"],
            "above_knn": None if best_knn is None else r["acc"] > best_knn["acc"],
            "best_knn": None if best_knn is None else best_knn["model"],
            "above_pec": None if pec is None else r["acc"] > pec["acc"],
            "most_kept": None if r["kept"] is None else r["kept"] >= KEPT_TARGET}
    return out


def readout_rows(cfg: ContinualConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model read out (``--readouts``) and readout: the final accuracy's mean ± sd over
    every (order, seed), and the values (``acc``, ``acc_sd``, ``runs``, ``values``)."""
    out = []
    for name in cfg.models:
        done = [r for r in runs if r["model"] == name and "readouts" in r]
        if not done:
            continue
        for key in dict.fromkeys(k for r in done for k in r["readouts"]):
            values = [r["readouts"][key] for r in done if key in r["readouts"]]
            acc, sd = mean_sd(values)
            out.append({"model": name, "readout": key, "runs": len(values), "acc": acc,
                        "acc_sd": sd, "values": values})
    return out


def finish(cfg: ContinualConfig, summary: dict[str, Any]) -> None:
    """Add to ``summary`` what the report reads from its runs: ``rows``, ``silent``,
    ``verdict``, each growing model's mean ``value_mass``, each model's mean accuracy
    matrix (``matrices``) and, with ``--readouts``, ``readouts`` (:func:`readout_rows`)."""
    runs = summary["runs"]
    if any("readouts" in r for r in runs):
        summary["readouts"] = readout_rows(cfg, runs)
    summary["rows"] = rows(cfg, runs)
    summary["silent"] = silent_rows(cfg, runs)
    summary["verdict"] = verdict(summary["rows"])
    summary["value_mass"] = {
        name: [[mean_known([r["silent"]["value_mass"][t][k] for r in done]) or 0.0
                for k in range(len(done[0]["silent"]["value_mass"][0]))]
               for t in range(len(done[0]["silent"]["value_mass"]))]
        for name in cfg.models
        if (done := [r for r in runs if r["model"] == name and r["order"] != "iid"
                     and "value_mass" in r.get("silent", {})])}
    summary["matrices"] = {
        name: _mean_matrix(done) for name in cfg.models
        if (done := [r for r in runs if r["model"] == name and r["order"] != "iid"])}
