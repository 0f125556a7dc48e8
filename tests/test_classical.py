"""Classical baselines (kNN, linear and RBF SVMs) on small synthetic problems."""

import numpy as np
import pytest
import torch

from rcdl.app.classical import _vote, fit_classical, fit_knn, fit_linear_svm, fit_rbf_svm


def _blobs(n, seed, d=6, classes=3):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=torch.Generator().manual_seed(99)) * 4
    y = torch.randint(0, classes, (n,), generator=gen)
    return centres[y] + torch.randn(n, d, generator=gen), y


def _rings(n, seed):
    """Two concentric rings in 2-D (padded to 4-D): not linearly separable."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    angle = torch.rand(n, generator=gen) * 6.283
    radius = 1.0 + 2.0 * y + 0.1 * torch.randn(n, generator=gen)
    x = torch.stack([radius * angle.cos(), radius * angle.sin()], 1)
    return torch.cat([x, 0.01 * torch.randn(n, 2, generator=gen)], 1), y


def test_vote_is_the_majority_with_ties_to_the_nearest():
    labels = np.array([[2, 1, 1, 0, 2], [0, 1, 2, 2, 1]])
    assert _vote(labels, 3, 3).tolist() == [1, 0]  # 1 wins 2:1; three-way tie -> nearest
    assert _vote(labels, 5, 3).tolist() == [2, 1]  # 2:2 tie between 2 and 1 -> 2 is nearer
    assert _vote(labels, 1, 3).tolist() == [2, 0]


@pytest.mark.extra("classical")
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_knn_separates_blobs_and_keeps_every_training_point(metric):
    data = (*_blobs(300, 0), *_blobs(100, 1))
    result = fit_knn(*data, metric=metric)
    assert result.test_acc > 0.95
    assert result.entries == 300
    assert result.settings["k"] in (1, 3, 5, 7, 9, 11, 15, 21, 31)


@pytest.mark.extra("classical")
def test_one_nearest_neighbour_matches_scikit_learn():
    from sklearn.neighbors import KNeighborsClassifier

    x, y = _blobs(200, 2, classes=5)
    xt, yt = _blobs(80, 3, classes=5)
    x = x + 2 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4))  # overlap
    result = fit_knn(x, y, xt, yt, ks=(1,))
    reference = KNeighborsClassifier(1).fit(x.numpy(), y.numpy()).score(xt.numpy(), yt.numpy())
    assert result.test_acc == pytest.approx(reference)


@pytest.mark.extra("classical")
def test_rbf_svm_separates_rings_where_the_linear_one_cannot():
    data = (*_rings(400, 0), *_rings(200, 1))
    linear = fit_linear_svm(*data)
    rbf = fit_rbf_svm(*data, n_components=100)
    assert rbf.test_acc > 0.9 > linear.test_acc + 0.2
    assert rbf.entries is None and rbf.settings["n_components"] == 100


@pytest.mark.extra("classical")
def test_bad_input_is_refused():
    data = (*_blobs(50, 0), *_blobs(20, 1))
    with pytest.raises(ValueError, match="unknown kNN metric"):
        fit_knn(*data, metric="l1")
    with pytest.raises(ValueError, match="holdout"):
        fit_knn(*data, holdout=1.5)
    with pytest.raises(ValueError, match="unknown classical baseline 'knn'"):
        fit_classical("knn", *data)
    with pytest.raises(ValueError, match=r"x_train \(N, D\)"):
        fit_linear_svm(data[0], data[1], data[2][:, :3], data[3])
