"""Classical baselines on the same standardised pixels: k-nearest neighbours and SVMs
(docs/reference.md §8).

The paper reports that one epoch of the growing networks beats kNN and SVM classifiers.
These baselines use scikit-learn (the ``classical`` extra) on the ``(N, 3072)`` standardised,
flattened images that every other model sees:

- :func:`fit_knn` — kNN with the L2 or the cosine distance. ``k`` is chosen by accuracy on
  a held-out part of the training set, and the final classifier is fitted on all of it.
- :func:`fit_linear_svm` — a linear SVM (hinge loss, L2 penalty chosen on the held-out
  part, one-vs-rest), trained by scikit-learn's SGD solver so that it scales to 50 000
  images.
- :func:`fit_rbf_svm` — an RBF-kernel SVM approximated so that it fits a small machine. A
  Nyström map with ``n_components`` landmarks (``gamma = 1 / (d · Var(x))``, scikit-learn's
  ``"scale"``) is followed by that linear SVM. The exact kernel SVM costs O(N²) memory and
  O(N²–N³) time on 50 000 images.

Each function returns a :class:`ClassicalResult` with the test accuracy, the fit and predict
wall times, the entries the model keeps (kNN: every training image; SVMs: none, they are
parametric) and its chosen settings. Neither kNN votes nor SVM margins are probabilities, so
they have no test cross-entropy.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["CLASSICAL_MODELS", "ClassicalResult", "fit_classical", "fit_knn", "fit_linear_svm",
           "fit_rbf_svm"]

DEFAULT_KS = (1, 3, 5, 7, 9, 11, 15, 21, 31)


@dataclass
class ClassicalResult:
    """What a classical baseline achieved, and at what cost."""

    test_acc: float
    fit_seconds: float
    predict_seconds: float
    entries: int | None  # training points stored (kNN), None for a parametric model
    settings: dict[str, Any] = field(default_factory=dict)


def _sklearn():  # noqa: ANN202
    try:
        import sklearn  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the classical baselines need scikit-learn: pip install "
                          "'rcdl[classical]' (or pip install scikit-learn)") from e


def _numpy(x: Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def _check(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor) -> None:
    if x_train.dim() != 2 or x_test.dim() != 2 or x_train.shape[1] != x_test.shape[1]:
        raise ValueError(f"classical baselines expect x_train (N, D) and x_test (M, D), got "
                         f"{tuple(x_train.shape)} and {tuple(x_test.shape)}")
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise ValueError("classical baselines: inputs and labels differ in length")
    if len(x_train) < 2:
        raise ValueError(f"classical baselines need at least 2 training points, got "
                         f"{len(x_train)}")


def _vote(neighbour_labels: np.ndarray, k: int, classes: int) -> np.ndarray:  # (M, K) -> (M,)
    """Majority vote over the first ``k`` neighbours; ties go to the nearest tied class
    (the class whose votes include the closer neighbour)."""
    top = neighbour_labels[:, :k]  # (M, k)
    counts = np.zeros((len(top), classes), dtype=np.int64)
    np.add.at(counts, (np.arange(len(top))[:, None], top), 1)
    best = counts.max(1, keepdims=True)
    tied = counts == best  # (M, C)
    # among tied classes, the first to appear in the neighbour list wins
    rank = np.where(tied[np.arange(len(top))[:, None], top], np.arange(k)[None, :], k)
    return top[np.arange(len(top)), rank.argmin(1)]


def fit_knn(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, *,
            metric: str = "l2", ks: Sequence[int] = DEFAULT_KS, holdout: float = 0.1,
            seed: int = 0) -> ClassicalResult:
    """k-nearest neighbours with ``k`` chosen on a held-out ``holdout`` fraction of the
    training set (largest accuracy, smallest k on ties), then refitted on all of it.

    Args:
        metric: ``"l2"`` (Euclidean) or ``"cosine"``.
        ks: candidate neighbour counts (those above the fitting set's size are dropped).
    """
    _sklearn()
    from sklearn.neighbors import NearestNeighbors

    _check(x_train, y_train, x_test, y_test)
    metrics = {"l2": "euclidean", "cosine": "cosine"}
    if metric not in metrics:
        raise ValueError(f"unknown kNN metric {metric!r}; known: l2, cosine")
    x, y, xt, yt = map(_numpy, (x_train, y_train, x_test, y_test))
    classes = int(max(y.max(), yt.max())) + 1
    start = time.perf_counter()
    held, fit = _holdout_split(len(x), holdout, seed)
    n_held = len(held)
    ks = sorted({int(k) for k in ks if 1 <= k <= len(fit)})
    if not ks:
        raise ValueError(f"no candidate k fits {len(fit)} fitting points")
    knn = NearestNeighbors(n_neighbors=max(ks), metric=metrics[metric], algorithm="brute")
    neighbours = knn.fit(x[fit]).kneighbors(x[held], return_distance=False)  # (H, K)
    held_acc = {k: float((_vote(y[fit][neighbours], k, classes) == y[held]).mean()) for k in ks}
    best_k = max(ks, key=lambda k: (held_acc[k], -k))
    knn = NearestNeighbors(n_neighbors=best_k, metric=metrics[metric], algorithm="brute")
    knn.fit(x)
    fit_seconds = time.perf_counter() - start
    start = time.perf_counter()
    neighbours = knn.kneighbors(xt, return_distance=False)  # (M, k)
    predictions = _vote(y[neighbours], best_k, classes)
    predict_seconds = time.perf_counter() - start
    return ClassicalResult(
        test_acc=float((predictions == yt).mean()), fit_seconds=fit_seconds,
        predict_seconds=predict_seconds, entries=len(x),
        settings={"metric": metric, "k": best_k, "holdout_points": n_held,
                  "holdout_accuracy": held_acc},
    )  # fmt: skip


def _holdout_split(n: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be a fraction in (0, 1), got {holdout}")
    order = np.random.default_rng(seed).permutation(n)
    n_held = max(1, int(round(holdout * n)))
    return order[:n_held], order[n_held:]


def _fit_svm(features: np.ndarray, y: np.ndarray, alphas: Sequence[float], holdout: float,
             epochs: int, seed: int):  # noqa: ANN202
    """A linear SVM (hinge loss, L2 penalty ``alpha``) trained by scikit-learn's SGD solver,
    one-vs-rest; ``alpha`` chosen on the held-out part, then refitted on everything."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import SGDClassifier

    if not alphas or min(alphas) <= 0:
        raise ValueError(f"alphas must be positive penalties, got {list(alphas)}")
    held, fit = _holdout_split(len(features), holdout, seed)

    def svm(alpha: float) -> SGDClassifier:
        return SGDClassifier(loss="hinge", alpha=alpha, max_iter=epochs, tol=1e-4,
                             random_state=seed)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        held_acc = {a: float(svm(a).fit(features[fit], y[fit]).score(features[held], y[held]))
                    for a in alphas}
        best = max(alphas, key=lambda a: (held_acc[a], a))
        model = svm(best).fit(features, y)
    converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    return model, {"alpha": best, "holdout_accuracy": held_acc, "epochs": epochs,
                   "converged": converged}


def fit_linear_svm(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, *,
                   alphas: Sequence[float] = (1e-4, 1e-3, 1e-2), holdout: float = 0.1,
                   epochs: int = 20, seed: int = 0) -> ClassicalResult:
    """A linear SVM: hinge loss with an L2 penalty ``alpha``, one-vs-rest, trained by SGD
    (``SGDClassifier``: linear in N, where exact solvers such as liblinear grow much faster
    with N; docs/cifar10.md). ``alpha`` is chosen on a held-out
    ``holdout`` fraction of the training set."""
    _sklearn()
    _check(x_train, y_train, x_test, y_test)
    x, y, xt, yt = map(_numpy, (x_train, y_train, x_test, y_test))
    start = time.perf_counter()
    svm, settings = _fit_svm(x, y, alphas, holdout, epochs, seed)
    fit_seconds = time.perf_counter() - start
    start = time.perf_counter()
    acc = float((svm.predict(xt) == yt).mean())
    return ClassicalResult(acc, fit_seconds, time.perf_counter() - start, None, settings)


def fit_rbf_svm(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, *,
                n_components: int = 2000, alphas: Sequence[float] = (1e-5, 1e-4, 1e-3),
                holdout: float = 0.1, epochs: int = 20, seed: int = 0) -> ClassicalResult:
    """An RBF-kernel SVM: a Nyström map with ``n_components`` landmarks (at most the number
    of training points), then the linear SVM of :func:`fit_linear_svm` on the features."""
    _sklearn()
    from sklearn.kernel_approximation import Nystroem

    _check(x_train, y_train, x_test, y_test)
    x, y, xt, yt = map(_numpy, (x_train, y_train, x_test, y_test))
    gamma = 1.0 / (x.shape[1] * float(x.var()))  # scikit-learn's gamma="scale"
    start = time.perf_counter()
    nystroem = Nystroem(kernel="rbf", gamma=gamma, n_components=min(n_components, len(x)),
                        random_state=seed)
    features = nystroem.fit_transform(x)
    svm, settings = _fit_svm(features, y, alphas, holdout, epochs, seed)
    fit_seconds = time.perf_counter() - start
    start = time.perf_counter()
    acc = float((svm.predict(nystroem.transform(xt)) == yt).mean())
    return ClassicalResult(acc, fit_seconds, time.perf_counter() - start, None,
                           {"gamma": gamma, "n_components": nystroem.n_components, **settings})


CLASSICAL_MODELS = {
    "knn-l2": ("k-nearest neighbours, L2", lambda *d, seed: fit_knn(*d, metric="l2",
                                                                     seed=seed)),
    "knn-cosine": ("k-nearest neighbours, cosine",
                   lambda *d, seed: fit_knn(*d, metric="cosine", seed=seed)),
    "svm-linear": ("linear SVM", lambda *d, seed: fit_linear_svm(*d, seed=seed)),
    "svm-rbf": ("RBF SVM (Nyström, 2 000 landmarks)",
                lambda *d, seed: fit_rbf_svm(*d, seed=seed)),
}


def fit_classical(name: str, x_train: Tensor, y_train: Tensor, x_test: Tensor,
                  y_test: Tensor, *, seed: int = 0) -> ClassicalResult:
    """Fit the baseline ``name`` (a key of :data:`CLASSICAL_MODELS`) and score it."""
    if name not in CLASSICAL_MODELS:
        raise ValueError(f"unknown classical baseline {name!r}; known: "
                         f"{', '.join(CLASSICAL_MODELS)}")
    with torch.no_grad():
        return CLASSICAL_MODELS[name][1](x_train, y_train, x_test, y_test, seed=seed)
