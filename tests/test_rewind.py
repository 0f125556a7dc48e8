"""Step undo through the replay log (docs/unlearning.md, "Step undo and rewind"): ``rewind``
gives the model trained on the first steps of the log's stream, bit for bit, for a layer
that only appends and for the hybrid; a step undone outside the log
(``Grower.drop_last_step``) is refused by the next exact request instead of being trained
back in; bad requests change nothing. float64, tens of samples."""

import pytest
import torch
import torch.nn.functional as F

from rcdl.memory.forgetting import forget
from rcdl.train.loop import train_one_pass
from rcdl.train.replay import ReplayLog
from rcdl.train.unlearning import rewind
from test_edits_compose import (
    B,
    N,
    assert_same_model,
    assert_unchanged,
    build,
    data,
    everything,
    exactly,
)


def logged(kind, every=1):
    model, grower = build(kind)
    log = ReplayLog(every=every)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False, replay=log)
    return model, grower, log


def retrained(kind, order):
    model, grower = build(kind)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False, order=order)
    return model, grower


def back(model, grower, log, steps):
    return rewind(model, steps, replay=log, data=data()[:2], loss_fn=F.cross_entropy,
                  grower=grower)


@pytest.mark.parametrize("kind", ["gws", "hybrid"])
@pytest.mark.parametrize("every", [1, 3])
def test_rewind_is_the_shorter_run(kind, every):
    model, grower, log = logged(kind, every)
    order = log.order.clone()
    done = back(model, grower, log, 5)
    assert done.step == 5 and done.restored == 5 - 5 % every
    assert torch.equal(log.order, order[: 5 * B])
    assert max(log.snapshots) <= 5
    expected, _ = retrained(kind, order[: 5 * B])
    assert_same_model(model, expected)


def test_undo_then_forget_exactly_is_the_retrained_run():
    """The last step undone through the log, then an earlier sample forgotten exactly: the
    run on the stream without the last batch and without the sample."""
    model, grower, log = logged("gws")
    order = log.order.clone()
    steps = -(-N // B)
    back(model, grower, log, steps - 1)
    target = int(order[3])
    exactly(model, grower, log, [target])
    kept = order[: (steps - 1) * B]
    expected, _ = retrained("gws", kept[kept != target])
    assert_same_model(model, expected)


def test_rewind_after_a_told_forget_leaves_the_samples_out():
    model, grower, log = logged("gws")
    order = log.order.clone()
    gone = int(order[2 * B + 1])
    forget(model, [gone], learners=[grower], replay=log)
    back(model, grower, log, 6)
    kept = order[order != gone][: 6 * B]
    expected, _ = retrained("gws", kept)
    assert_same_model(model, expected)


def test_a_step_undone_outside_the_log_is_refused():
    """Grower.drop_last_step without the log, then forget_exactly: the replay would train the
    undone step back in; refused, naming the layer and the fix, and nothing changes."""
    model, grower, log = logged("gws")
    grower.drop_last_step()
    before = everything(model, grower, log)
    with pytest.raises(ValueError, match=r"undone outside the log.*rewind"):
        exactly(model, grower, log, [int(log.order[3])])
    assert_unchanged(before, model, grower, log)


@pytest.mark.parametrize("steps, message", [(-1, "steps"), (99, "steps"), (2.0, "steps")])
def test_bad_rewinds_change_nothing(steps, message):
    model, grower, log = logged("gws")
    before = everything(model, grower, log)
    with pytest.raises(ValueError, match=message):
        back(model, grower, log, steps)
    assert_unchanged(before, model, grower, log)


def test_rewind_to_now_changes_nothing():
    model, grower, log = logged("gws")
    before = everything(model, grower, log)
    done = back(model, grower, log, -(-N // B))
    assert done.replayed == 0 and done.dropped == []
    assert_unchanged(before, model, grower, log)
