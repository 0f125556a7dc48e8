"""The training loop's state (rcdl.train.loop.LoopState): what a checkpoint holds of the loop,
in the layout checkpoints have always had, and a resumed state saved back as it was loaded;
its settings (LoopConfig), given whole or as keywords."""

from dataclasses import fields

import pytest
import torch

from rcdl.train.loop import LoopConfig, LoopSettings, LoopState, train_one_pass
from small_runs import TEACHER_DATA, same, teacher_net


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


# --------------------------------------------------------------------------- a ready config


def _without_clocks(result):
    """A run's result without its wall-clock times (the rest is deterministic)."""
    return {k: v for k, v in result.items() if "seconds" not in k} | {
        "history": [{k: v for k, v in h.items() if "seconds" not in k}
                    for h in result["history"]]}


def test_a_ready_config_trains_as_its_keywords_bit_for_bit(tmp_path):
    settings = {"batch_size": 8, "seed": 3, "epochs": 2, "eval_every": 3,
                "eval_batch_size": 5, "device": "cpu", "name": "net", "progress": False,
                "checkpoint_every": 4, "incremental_eval": True}
    runs = []
    for way in ("keywords", "config"):
        net, grower = teacher_net()
        path = tmp_path / way / "ckpt.pt"
        given = settings | {"checkpoint_path": path}
        loop = {"config": LoopConfig(**given)} if way == "config" else given
        result = train_one_pass(net, TEACHER_DATA, grower=grower, **loop)
        runs.append((_without_clocks(result), net.state_dict(), grower.state_dict()))
    (a, model_a, grower_a), (b, model_b, grower_b) = runs
    assert a["steps"] == 2 * 8 and len(a["history"]) > 3
    assert same(a, b) and same(model_a, model_b) and same(grower_a, grower_b)


def test_a_config_and_its_keywords_together_are_refused():
    net, grower = teacher_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    config = LoopConfig(batch_size=8, progress=False)
    with pytest.raises(TypeError, match=r"config= and the keywords seed=1, epochs=2, which the "
                                        r"config holds too: .*dataclasses.replace\(config, "
                                        r"seed=\.\.\.\)"):
        train_one_pass(net, TEACHER_DATA, grower=grower, config=config, seed=1, epochs=2)
    with pytest.raises(TypeError, match=r"needs batch_size=\.\.\., or the settings whole as "
                                        r"config=LoopConfig"):
        train_one_pass(net, TEACHER_DATA, grower=grower, seed=1)
    with pytest.raises(TypeError, match=r"config must be a rcdl.train.loop.LoopConfig, got dict"):
        train_one_pass(net, TEACHER_DATA, grower=grower, config={"batch_size": 8})
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['batchsize'\]"):
        train_one_pass(net, TEACHER_DATA, grower=grower, batchsize=8)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing trained


def test_the_keyword_settings_are_the_config_fields():
    assert list(LoopSettings.__annotations__) == [f.name for f in fields(LoopConfig)]
