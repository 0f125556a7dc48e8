"""The synthetic teacher–student task: shapes, determinism, scaling, bad arguments."""

import pytest
import torch

from rcdl.app.data import TeacherConfig, make_teacher, make_teacher_data

SMALL = TeacherConfig(d_in=5, hidden=7, d_out=3, depth=2, n_train=50, n_test=2000)


def test_shapes_and_dtype():
    x, y, xt, yt = make_teacher_data(SMALL)
    assert (x.shape, y.shape, xt.shape, yt.shape) == ((50, 5), (50, 3), (2000, 5), (2000, 3))
    assert x.dtype == torch.float32
    assert make_teacher_data(TeacherConfig(n_train=3, n_test=2, dtype="float64"))[0].dtype == (
        torch.float64
    )


def test_same_seed_same_data_other_seed_other_data():
    a, b = make_teacher_data(SMALL), make_teacher_data(SMALL)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    c = make_teacher_data(TeacherConfig(**{**SMALL.__dict__, "seed": 1}))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[3], c[3])


def test_test_set_does_not_depend_on_train_size():
    bigger = TeacherConfig(**{**SMALL.__dict__, "n_train": 80})
    assert torch.equal(make_teacher_data(SMALL)[2], make_teacher_data(bigger)[2])


@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_targets_are_the_teacher_and_have_unit_scale(act):
    cfg = TeacherConfig(**{**SMALL.__dict__, "act": act})
    _, _, xt, yt = make_teacher_data(cfg)
    torch.testing.assert_close(make_teacher(cfg)(xt), yt)
    assert torch.allclose(yt.mean(0), torch.zeros(3), atol=0.1)
    assert torch.allclose(yt.var(0), torch.ones(3), atol=0.15)


def test_noise_touches_training_targets_only():
    noisy = TeacherConfig(**{**SMALL.__dict__, "noise": 0.5})
    clean_data, noisy_data = make_teacher_data(SMALL), make_teacher_data(noisy)
    assert torch.equal(clean_data[0], noisy_data[0]) and torch.equal(clean_data[3], noisy_data[3])
    assert not torch.equal(clean_data[1], noisy_data[1])


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_in", 0), ("hidden", -1), ("depth", 1.5), ("n_test", True), ("act", "gelu"),
     ("noise", -0.1), ("noise", float("nan")), ("seed", -1), ("dtype", "float16")],
)  # fmt: skip
def test_bad_arguments_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"TeacherConfig.{field}"):
        TeacherConfig(**{field: value})
