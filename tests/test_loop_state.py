"""The training loop's state (rcdl.train.loop.LoopState): what a checkpoint holds of the loop,
in the layout checkpoints have always had, and a resumed state saved back as it was loaded."""

import pytest

from rcdl.train.loop import LoopConfig, LoopState


def test_a_fresh_state_is_the_layout_checkpoints_hold():
    assert LoopState().state_dict() == {
        "step": 0, "history": [], "clock": {"train": 0.0, "eval": 0.0}, "loss_sum": 0.0,
        "loss_count": 0, "last_loss": None}


def test_the_methods_count_time_and_close_the_loss_window_at_a_record():
    state = LoopState()
    state.add_loss(0.5)
    state.add_loss(1.5, count=3)
    state.advance(4, 0.25)
    record = {"step": 4, "samples": 16, "epoch": 0.5, "test_mse": 0.1}
    assert state.record(record, 0.125) is record
    assert (state.step, state.train_seconds, state.eval_seconds) == (4, 0.25, 0.125)
    assert (state.last_loss, state.loss_sum, state.loss_count) == (0.5, 0.0, 0)
    state.record({"step": 4}, 0.0)  # no losses since: last_loss kept
    assert state.last_loss == 0.5 and len(state.history) == 2


def test_a_loaded_state_is_saved_back_with_its_keys_and_order():
    saved = {"clock": {"eval": 1.0, "train": 2.0}, "step": 3, "history": [{"step": 2}],
             "loss_sum": 0.5, "loss_count": 1, "last_loss": None, "later": "kept"}
    state = LoopState.from_state_dict(saved)
    state.advance(4, 1.0)
    again = state.state_dict()
    assert list(again) == list(saved) and list(again["clock"]) == ["eval", "train"]
    assert again == saved | {"step": 4, "clock": {"eval": 1.0, "train": 3.0}}
    assert saved["step"] == 3  # the loaded dict itself is not changed


@pytest.mark.parametrize("change, said", [
    ({"history": None}, "history is NoneType"),
    ({"clock": {"train": 0.0}}, "clock does not hold the train and eval seconds"),
    ({"loss_count": True}, "loss_count is bool"),
    ({"history": ["step 2"]}, "history is not a list of evaluation records"),
])
def test_a_state_the_loop_did_not_write_is_refused(change, said):
    state = LoopState()
    with pytest.raises(ValueError, match=said):
        state.load_state_dict(LoopState().state_dict() | change)
    assert state == LoopState()


def test_the_config_is_frozen_and_saves_every_eval_by_default():
    config = LoopConfig(batch_size=8, eval_every=5)
    assert config.save_every == 5 and LoopConfig(8, checkpoint_every=3).save_every == 3
    with pytest.raises(AttributeError):
        config.seed = 1  # type: ignore[misc]
