"""A step refused at a deferred check leaves the model as a step refused in the step does
(docs/gpu.md, "Host reads in a step"), its error names the step as the training loop
counts it, also after a resume, and a grower's state is checked whole before it is loaded."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from rcdl import FunctionalSGD, Grower, GrowingRBFNet, GrowingSoftmaxNet
from rcdl.memory.budgets import MemoryBudget
from rcdl.nn.layers import GrowingLinear, growing_layers
from rcdl.nn.networks import HybridSoftmaxNet
from rcdl.nn.rules import ClippedSoftmaxRule
from rcdl.optim.hybrid_grower import HybridGrower
from rcdl.train.loop import train_one_pass

D, CLASSES, B = 6, 3, 4
REFUSED = 3  # the step refused in the runs below


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, D, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (B,), generator=gen))


def rbf(defer: bool, budget: MemoryBudget | None = None) -> tuple[nn.Module, Grower]:
    """An RBF net whose rule ages its entries (weight decay): every step that counts moves
    every output."""
    torch.manual_seed(0)
    net = GrowingRBFNet(D, CLASSES, 1, temperature=1.0,
                        rule=FunctionalSGD(0.5, weight_decay=0.1)).double()
    return net, Grower(net, budget=budget, defer_checks=defer)


def gws(defer: bool, budget: MemoryBudget | None = None) -> tuple[nn.Module, Grower]:
    torch.manual_seed(0)
    net = GrowingSoftmaxNet(D, CLASSES, 1, temperature=5.0,
                            rule=ClippedSoftmaxRule(eta=0.003, beta=3.0), seed=0).double()
    return net, Grower(net, budget=budget, defer_checks=defer)


def linear(defer: bool, budget: MemoryBudget | None = None) -> tuple[nn.Module, Grower]:
    """The dual form of SGD with weight decay and momentum: its initial weight ages too."""
    torch.manual_seed(0)
    rule = FunctionalSGD(0.1, weight_decay=0.1, momentum=0.5, per_sample=False)
    net = nn.Sequential(GrowingLinear(D, CLASSES, rule=rule, dtype=torch.float64))
    return net, Grower(net, budget=budget, defer_checks=defer)


def hybrid(defer: bool, budget: MemoryBudget | None = None) -> tuple[nn.Module, HybridGrower]:
    torch.manual_seed(0)
    net = HybridSoftmaxNet(D, CLASSES, 1, temperature=5.0,
                           rule=ClippedSoftmaxRule(eta=1.0, beta=30.0)).double()
    return net, HybridGrower(net, lr=1e-3, budget=budget, defer_checks=defer)


def refuse_by_records(net: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The step's records are refused as diverging (an output-growth limit every output
    exceeds); the gradients stay finite, so the hybrid's Adam step could run."""
    for _, layer in growing_layers(net):
        layer.max_output_growth = 1.000001
    return loss


def refuse_by_proposal(net: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The step's records pass, its proposed entries are not finite (β = ∞)."""
    for _, layer in growing_layers(net):
        layer.rule = dataclasses.replace(layer.rule, beta=float("inf"))
    return loss


def refuse_by_a_nan(net: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The step's output gradients are NaN."""
    return loss * float("nan")


def restore(net: nn.Module, saved: list) -> None:
    for (_, layer), (limit, rule) in zip(growing_layers(net), saved, strict=True):
        layer.max_output_growth, layer.rule = limit, rule


def train(net: nn.Module, learner, steps: int, refuse=None) -> list[str]:
    """``steps`` steps of batches 0, 1, ...; step ``REFUSED`` under ``refuse``. Returns the
    errors raised in the steps and at the final check."""
    errors = []
    for step in range(steps):
        saved = [(layer.max_output_growth, layer.rule) for _, layer in growing_layers(net)]
        loss = F.cross_entropy(net(batch(step)[0]), batch(step)[1])
        if step == REFUSED and refuse is not None:
            loss = refuse(net, loss)
        loss.backward()
        try:
            learner.step()
        except ValueError as error:
            errors.append(str(error))
        learner.zero_grad()
        restore(net, saved)
    try:
        learner.check()
    except ValueError as error:
        errors.append(str(error))
    return errors


def outputs(net: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = net.eval()(batch(99)[0])
    net.train()
    return out


# --------------------------------------------------------------------------- the refused step


@pytest.mark.parametrize("at", ["records", "proposal"])
def test_a_deferred_refusal_ages_no_entry(at):
    """With weight decay every step ages every entry: a refused step must not (it moved the
    outputs by 0.014 here, and layer.steps by one)."""
    net, grower = rbf(defer=True)
    train(net, grower, REFUSED)
    before, steps = outputs(net), [int(layer.steps) for layer in grower.layers]
    saved = [(layer.max_output_growth, layer.rule) for layer in grower.layers]
    x, y = batch(REFUSED)
    if at == "records":
        refuse_by_records(net, F.cross_entropy(net(x), y)).backward()
    else:  # a target far away: the entries proposed would make the layer diverge
        F.mse_loss(net(x), torch.full((B, CLASSES), 1e9, dtype=torch.float64)).backward()
    grower.step()  # refused on the device: no error yet
    grower.zero_grad()
    restore(net, saved)
    assert torch.equal(outputs(net), before)
    assert [int(layer.steps) for layer in grower.layers] == steps
    with pytest.raises(ValueError, match=rf"grower step {REFUSED}, counted from 0 .* changed "
                                         "no output"):
        grower.check()


@pytest.mark.parametrize("refuse", [refuse_by_records, refuse_by_proposal],
                         ids=["records", "proposal"])
@pytest.mark.parametrize("budget", [None, 17], ids=["unbounded", "budget"])
def test_a_deferred_hybrid_refusal_moves_what_an_immediate_one_moves(refuse, budget):
    """Refused by its records, the step moves no entry by Adam (it moved every key by lr);
    refused at its proposals, it keeps its Adam move, as in the step. Either way it writes
    nothing, and the runs go on bit for bit alike."""
    runs = []
    for defer in (False, True):
        net, learner = hybrid(defer, None if budget is None else MemoryBudget(budget))
        errors = train(net, learner, REFUSED + 3, refuse)
        assert len(errors) == 1 and ("grower step 3" in errors[0]) is defer, errors
        runs.append((net, learner))
    (net_a, learner_a), (net_b, learner_b) = runs
    assert budget is None or learner_a.grower.num_evicted > 0
    assert torch.equal(outputs(net_a), outputs(net_b))
    state_a, state_b = net_a.state_dict(), net_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
    for name, moments in learner_a.adam.moments.items():
        theirs = learner_b.adam.moments[name]
        assert torch.equal(moments.steps, theirs.steps)
        assert torch.equal(moments.m.keys, theirs.m.keys)
        assert torch.equal(moments.v.values, theirs.v.values)


def test_the_records_refused_hybrid_step_moves_nothing():
    net, learner = hybrid(defer=True)
    train(net, learner, REFUSED)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    adam_steps = [m.steps.clone() for m in learner.adam.moments.values()]
    refuse_by_records(net, F.cross_entropy(net(batch(REFUSED)[0]), batch(REFUSED)[1])).backward()
    learner.step()
    learner.zero_grad()
    for key, value in net.state_dict().items():
        if key.endswith("max_output_growth"):
            continue
        assert torch.equal(value, before[key]), key
    assert [m.steps for m in learner.adam.moments.values()] == adam_steps


@pytest.mark.parametrize(("build", "refuse", "budget"), [
    (rbf, refuse_by_records, None), (rbf, refuse_by_records, MemoryBudget(20, "oldest")),
    (gws, refuse_by_records, None), (gws, refuse_by_records, MemoryBudget(30, "contribution")),
    (linear, refuse_by_a_nan, None)], ids=["rbf", "rbf-budget", "gws", "gws-budget", "linear"])
def test_later_steps_follow_an_immediate_refusal(build, refuse, budget):
    """After the refused step the run goes on as one whose refusal raised in the step: to
    rounding without a budget (the refused rows, of zero weight, stay in the store), bit for
    bit with one (the budget reads the verdict and takes the rows back)."""
    runs = []
    for defer in (False, True):
        net, grower = build(defer, budget)
        errors = train(net, grower, REFUSED + 4, refuse)
        assert len(errors) == 1
        runs.append((net, grower))
    (net_a, grower_a), (net_b, grower_b) = runs
    assert [int(layer.steps) for layer in grower_a.layers] == [
        int(layer.steps) for layer in grower_b.layers]
    if budget is None:
        assert_close(outputs(net_a), outputs(net_b), rtol=1e-12, atol=1e-15)
        for layer_a, layer_b in zip(grower_a.layers, grower_b.layers, strict=True):
            store = layer_b.store  # the refused step's B rows more, all zero
            zero = (store.weights == 0) & (store.keys == 0).all(1) & (store.values == 0).all(1)
            assert len(store) == len(layer_a.store) + B and int(zero.sum()) == B
    else:
        assert torch.equal(outputs(net_a), outputs(net_b))
        for layer_a, layer_b in zip(grower_a.layers, grower_b.layers, strict=True):
            assert torch.equal(layer_a.store.ids, layer_b.store.ids)
            assert layer_a.store.next_id == layer_b.store.next_id
        assert grower_a.evicted == grower_b.evicted and grower_a.num_evicted > 0


def test_drop_last_step_after_a_deferred_refusal():
    """The zero rows of a refused step count as written at the last step that passed:
    dropping that step takes them too, and leaves what an immediate refusal leaves."""
    runs = []
    for defer in (False, True):
        net, grower = rbf(defer)
        train(net, grower, REFUSED + 1, refuse_by_records)
        grower.drop_last_step()
        runs.append((net, grower))
    (net_a, grower_a), (net_b, grower_b) = runs
    assert grower_a.local_num_entries == grower_b.local_num_entries
    assert torch.equal(outputs(net_a), outputs(net_b))


def _sharded_worker(rank: int, world: int, init_file, result_file) -> None:
    import torch.distributed as dist

    from rcdl.distributed import shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = {}
        for name, build, budget in (("rbf", rbf, None), ("rbf-budget", rbf, 5),
                                    ("hybrid", hybrid, None)):
            for defer in (False, True):
                net, learner = build(defer, None if budget is None else MemoryBudget(budget))
                shard(net)
                errors = train(net, learner, REFUSED + 3, refuse_by_records)
                assert len(errors) == 1, errors
                results[name, defer] = (outputs(net), [
                    (int(layer.steps), layer.store.ids.clone())
                    for _, layer in growing_layers(net)])
        if rank == 0:
            torch.save(results, result_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_sharded_stores_refuse_at_a_deferred_check_as_in_the_step(tmp_path):
    """Over two ranks: the step counters (which choose each rank's rows of a batch) and,
    with a budget or in the hybrid, the rows each rank keeps follow an immediate refusal."""
    from rank_pool import run_ranks

    result_file = tmp_path / "result.pt"
    run_ranks(_sharded_worker, (2, tmp_path / "init", result_file), world=2)
    results = torch.load(result_file, weights_only=False)
    for name in ("rbf", "rbf-budget", "hybrid"):
        (out_a, layers_a), (out_b, layers_b) = results[name, False], results[name, True]
        assert [steps for steps, _ in layers_a] == [steps for steps, _ in layers_b], name
        if name == "rbf":  # the refused rows stay, zeroed
            assert_close(out_a, out_b, rtol=1e-12, atol=1e-15)
        else:
            assert torch.equal(out_a, out_b), name
            for (_, ids_a), (_, ids_b) in zip(layers_a, layers_b, strict=True):
                assert torch.equal(ids_a, ids_b), name


# --------------------------------------------------------------------------- the step it names


def test_a_refusal_after_a_resume_names_the_loop_step(tmp_path, interrupt_after):
    """Resumed from step 6, a refusal at the loop's step 8 was named grower step 2."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, D, generator=gen, dtype=torch.float64), torch.randn(
        48, CLASSES, generator=gen, dtype=torch.float64)
    y[8 * B + 1] = 1e12  # a finite loss whose step would diverge: refused at the check
    data = (x, y, x[:8], y[:8])
    kw = {"batch_size": B, "eval_every": 3, "progress": False, "order": torch.arange(48),
          "checkpoint_path": tmp_path / "ckpt.pt", "loss_fn": F.mse_loss}

    def build():
        torch.manual_seed(0)
        net = GrowingRBFNet(D, CLASSES, 1, temperature=1.0, rule=FunctionalSGD(0.5)).double()
        return net, Grower(net, defer_checks=True)

    net, grower = build()
    with pytest.raises(interrupt_after(grower, 7)):
        train_one_pass(net, data, grower=grower, **kw)
    net, grower = build()
    with pytest.raises(ValueError, match=r"grower step 8, counted from 0 as the training loop"):
        train_one_pass(net, data, grower=grower, **kw)


def test_the_steps_taken_are_saved_and_an_older_state_is_read():
    net, grower = rbf(defer=True)
    train(net, grower, 5)
    state = grower.state_dict()
    assert state["steps_taken"] == 5
    for saved in (state, {k: v for k, v in state.items() if k != "steps_taken"}):
        twin, again = rbf(defer=True)
        again.load_state_dict(copy.deepcopy(saved))  # without it: the layers' steps
        refuse_by_records(twin, F.cross_entropy(twin(batch(0)[0]), batch(0)[1])).backward()
        again.step()
        with pytest.raises(ValueError, match="grower step 5,"):
            again.check()


def test_a_step_that_records_nothing_still_counts():
    net, grower = rbf(defer=True)
    train(net, grower, 2)
    grower.step()  # nothing recorded since the last step
    assert grower.state_dict()["steps_taken"] == 3


# --------------------------------------------------------------------------- loading a state


def _malformed() -> dict:
    def with_part(key, value):
        return lambda s: {**s, key: value}

    def in_part(part, key, value):
        return lambda s: {**s, part: {**s[part], key: value}}

    def group(key, value):  # in the readout's group
        return lambda s: {**s, "param_groups": [*s["param_groups"][:-1],
                                                {**s["param_groups"][-1], key: value}]}

    return {
        "a-list": (lambda s: list(s), "expected the dict of a Grower's state_dict"),
        "no-evicted": (lambda s: {k: v for k, v in s.items() if k != "evicted"},
                       "the state has no 'evicted'"),
        "groups-a-string": (with_part("param_groups", "readout"),
                            "'param_groups' must be a list of dicts, got str"),
        "groups-of-other-layers": (group("layer", "x"), r"the state is for layers "
                                   r"\['blocks.0', 'x'\] \(its param_groups\), this grower has"),
        "steps-of-other-layers": (  # the groups match: the message used to name them twice
            lambda s: {**s, "steps": {"blocks.0": 2, "x": 2}},
            r"'steps' is for layers \['blocks.0', 'x'\], this grower has \['blocks.0', "
            r"'readout'\]; missing \['readout'\]; not in this grower \['x'\]"),
        "steps-negative": (in_part("steps", "readout", -1),
                           "steps of layer 'readout' must be an int >= 0, got int -1"),
        "evicted-a-float": (in_part("evicted", "readout", 1.5),
                            "evicted of layer 'readout' must be an int >= 0, got float"),
        "scale-a-string": (in_part("output_scale", "readout", "big"),
                           "output_scale of layer 'readout' must be None or a float"),
        "lr-none": (group("lr", None), "lr of layer 'readout' must be a finite float"),
        "lr-that-decay-refuses": (group("lr", 0.25), "cannot change lr from 0.5 to 0.25"),
        "steps-taken-negative": (with_part("steps_taken", -2), "'steps_taken' must be an int"),
        "shard-a-string": (with_part("shard", "0/2"), "'shard' must be None or"),
    }


MALFORMED = _malformed()


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_malformed_grower_state_is_refused_and_changes_nothing(fault):
    change, said = MALFORMED[fault]
    net, grower = rbf(defer=False)
    train(net, grower, 2)
    saved = grower.state_dict()
    twin, other = rbf(defer=False)
    train(twin, other, 1)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=said):
        other.load_state_dict(change(copy.deepcopy(saved)))
    assert other.state_dict() == before
    assert other.layers[0].rule.lr == 0.5


def test_a_hybrid_state_with_a_bad_grower_part_leaves_adam_as_it_was():
    net, learner = hybrid(defer=False)
    train(net, learner, 2)
    saved = copy.deepcopy(learner.state_dict())
    train(net, learner, 1)
    moments = {name: (m.m.keys.clone(), m.steps.clone()) for name, m in
               learner.adam.moments.items()}
    saved["grower"]["steps"] = {"x": 1}
    with pytest.raises(ValueError, match=r"'steps' is for layers \['x'\]"):
        learner.load_state_dict(saved)
    for name, m in learner.adam.moments.items():
        assert torch.equal(m.m.keys, moments[name][0]) and torch.equal(m.steps,
                                                                       moments[name][1])
