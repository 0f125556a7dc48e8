"""Fast forgetting (rcdl.memory.repair) and memory budgets: the re-write replays the
readout's history from the rows it holds, so a readout whose budget evicted rows is refused
before anything changes, naming the layer and the evictions; rows an earlier ``forget``
removed are not taken for evictions."""

import copy

import pytest
import torch
import torch.nn.functional as F

from rcdl import Grower, GrowingRBFNet
from rcdl.memory.budgets import MemoryBudget
from rcdl.memory.forgetting import forget
from rcdl.memory.provenance import entry_samples
from rcdl.memory.repair import forget_and_repair, repair_refusal, rewrite_readout
from rcdl.nn.rules import FunctionalSGD
from rcdl.train.loop import accuracy, train_one_pass

D, CLASSES, N, B, CAPACITY = 8, 3, 64, 8, 24


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N + 32, D, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:N], y[:N], x[N:], y[N:]


def train(budget=None):
    torch.manual_seed(0)
    model = GrowingRBFNet(D, CLASSES, 2, temperature=1.0, rule=FunctionalSGD(1.0)).double()
    grower = Grower(model, budget=budget)
    train_one_pass(model, data(), batch_size=B, seed=3, grower=grower,
                   loss_fn=F.cross_entropy, eval_every=1000, progress=False,
                   metrics={"acc": accuracy})
    return model, grower


def snapshot(model):
    """Every tensor of the model's state (stores, ids, provenance) and its test outputs."""
    with torch.no_grad():
        outputs = model.eval()(data()[2])
    model.train()
    return {k: v.clone() for k, v in model.state_dict().items()}, outputs


def assert_unchanged(model, before):
    state, outputs = snapshot(model)
    assert state.keys() == before[0].keys()
    for key, old in before[0].items():
        assert torch.equal(state[key], old), key
    assert torch.equal(outputs, before[1])


@pytest.mark.parametrize("policy", ["oldest", "random"])
@pytest.mark.parametrize("gone", ["nothing", "a kept sample"], ids=["nothing", "kept"])
@pytest.mark.parametrize("keys", [False, True], ids=["stored-keys", "recomputed-keys"])
def test_a_readout_a_budget_evicted_from_is_refused_and_left_as_it_was(policy, gone, keys):
    model, grower = train(MemoryBudget(CAPACITY, policy))
    evicted = grower.evicted["readout"]
    assert evicted == N - CAPACITY
    wanted = [] if gone == "nothing" else [int(entry_samples(model.readout)[-1])]
    x, y = data()[:2]
    before, counts = snapshot(model), dict(grower.evicted)
    with pytest.raises(ValueError, match=rf"GrowingRBF 'readout': {evicted} of its entries "
                                         r"were evicted by a memory budget.*rcdl\.forget\b.*"
                                         r"forget_exactly.*retrain"):
        forget_and_repair(model, wanted, labels=y, inputs=x if keys else None,
                          learners=[grower])
    assert_unchanged(model, before)
    assert grower.evicted == counts


def test_the_rewrite_itself_refuses_an_evicted_readout():
    model, _ = train(MemoryBudget(CAPACITY, "oldest"))
    before = snapshot(model)
    with pytest.raises(ValueError, match=f"GrowingRBF 'readout': {N - CAPACITY} of its "
                                         "entries were evicted by a memory budget"):
        rewrite_readout(model.readout, data()[1], from_step=1)
    assert_unchanged(model, before)
    assert "evicted" in repair_refusal(model)


def test_keys_are_not_recomputed_through_a_layer_that_evicted():
    model, _ = train()
    evicted = MemoryBudget(CAPACITY, "oldest").enforce(model.blocks[0])
    x, y = data()[:2]
    wanted = [int(entry_samples(model.readout)[-1])]
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"readout'.s keys through GrowingRBF 'blocks\.0': "
                                         rf"{evicted} of its entries were evicted"):
        forget_and_repair(model, wanted, labels=y, inputs=x)
    assert_unchanged(model, before)
    assert repair_refusal(model) is None  # with the stored keys, the readout can be re-written
    forget_and_repair(model, wanted, labels=y)


def test_rows_an_earlier_forget_removed_are_not_taken_for_evictions():
    model, _ = train()
    forget(model, [3, 17, 40])
    assert len(model.readout.store) < model.readout.store.next_id
    assert repair_refusal(model) is None
    twin = copy.deepcopy(model)
    receipt = forget_and_repair(model, [5], labels=data()[1], inputs=data()[0])
    assert any("re-wrote" in note for note in receipt.released["readout"])
    forget(twin, [5])
    assert not torch.equal(model.readout.store.values, twin.readout.store.values)


def test_rows_a_budget_evicted_and_then_forgotten_are_forgotten_rows():
    """Forgetting the samples whose rows a budget evicted erases them from the provenance
    map: their rows are then absent as forgotten ones are, and the re-write takes the
    readout."""
    model, grower = train(MemoryBudget(CAPACITY, "oldest"))
    held = entry_samples(model.readout)
    evicted_samples = torch.tensor([s for s in range(N) if s not in set(held.tolist())])
    forget(model, evicted_samples, learners=[grower])
    assert repair_refusal(model) is None
