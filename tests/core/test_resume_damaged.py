"""A partial, damaged or foreign state is refused with ``ResumeError`` naming the entry, and the
stage is exactly as before the attempt: a failed load and then a normal run equal a run that
never tried."""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import siftpipe as sp
from siftpipe.adapters.nodes import SiftNode
from tests.common import loss_field, make_samples, roundtrip, same_state
from tests.contract import output_keys

SAMPLES = make_samples(200, seed=5)


def stage():
    return sp.Sifter(
        None,
        loss_field,
        sp.PruneEasy(0.5, None, 64),
        micro_batch=16,
        output_batch=6,
        seed=1,
        memory=sp.ScoreMemory(1000),
    )


def good_state():
    s = stage()
    it = s(SAMPLES)
    for _ in range(4):
        next(it)
    return roundtrip(s.state_dict())


def damaged():
    """(what the error must name, the bad state)."""
    good = good_state()

    def edit(path, value=None, drop=False):
        state = roundtrip(good)
        where = state
        for part in path[:-1]:
            where = where[part]
        if drop:
            del where[path[-1]]
        else:
            where[path[-1]] = value
        return state

    loader = StatefulDataLoader(list(range(10)), batch_size=2)
    next(iter(loader))
    return [
        ("lacks", {"version": 1}),
        ("lacks \\['rng'\\]", edit(["rng"], drop=True)),
        ("lacks \\['memory'\\]", edit(["memory"], drop=True)),
        ("version 7", edit(["version"], 7)),
        ("entry consumed must be an integer", edit(["consumed"], "12")),
        ("entry consumed must be an integer", edit(["consumed"], -1)),
        ("entry emitted", edit(["emitted"], 10**6)),
        ("entry epoch", edit(["epoch"], 1.5)),
        ("entry pass_open", edit(["pass_open"], "yes")),
        ("counts\\['seen'\\]", edit(["counts", "seen"], None)),
        ("counts\\['bogus'\\]", edit(["counts", "bogus"], 3)),
        ("entry rng", edit(["rng", "state"], {"state": 1})),
        ("pending\\[0\\]\\['keep'\\]", edit(["pending", 0, "keep"], good["pending"][0]["keep"][:-1])),
        ("pending\\[0\\]\\['keep'\\]", edit(["pending", 0, "keep"], good["pending"][0]["keep"].float())),
        ("pending\\[0\\]\\['weight'\\]", edit(["pending", 0, "weight"], torch.full((16,), float("nan")))),
        ("pending\\[0\\]\\['keys'\\]", edit(["pending", 0, "keys"], ["a"])),
        ("pending\\[0\\]\\['rows'\\]", edit(["pending", 0], {**good["pending"][0], "rows": 0})),
        ("entry pending", edit(["pending"], "none")),
        (
            "entry policy must be the value the checkpoint recorded a digest of",
            edit(["policy", "history", "values"], torch.tensor([1.0, float("nan")])),
        ),
        (
            "entry policy must be the value the checkpoint recorded a digest of",
            edit(["policy", "history"], drop=True),
        ),
        ("memory\\['loss'\\]", edit(["memory", "loss"], good["memory"]["loss"].double())),
        (
            "memory must be tensors of one length",
            edit(["memory", "keys"], torch.zeros(5000, dtype=torch.int64)),
        ),
        ("memory\\['capacity'\\] must be the capacity its config names", edit(["memory", "capacity"], 10)),
        ("memory\\['drift_mean'\\]", edit(["memory", "drift_mean"], ["x", 1.0])),
        ("memory\\['hard'\\]", edit(["memory", "hard"], torch.full((2, 2), -1.0))),
        ("memory\\['hard'\\]", edit(["memory", "hard"], torch.tensor([[1.0, 3.0], [0.0, 0.0]]))),
        ("memory\\['hard_verdict'\\]", edit(["memory", "hard_verdict"], 3.0)),
        ("memory\\['hard_verdict'\\]", edit(["memory", "hard_verdict"], True)),
        ("entry steps must be", edit(["steps"], -3)),
        ("entry raised must be an ascending list", edit(["raised"], [30, 20])),
        ("entry raised must be an ascending list", edit(["raised"], "20")),
        ("entry audit", edit(["audit"], {"run_id": 3})),
        ("entry tail must be None, or the last input items", edit(["tail"], [["k"]])),
        ("entry tail must be None, or the last input items", edit(["tail"], [["k", 3]])),
        ("entry tail must be None, or the last input items", edit(["tail"], "k")),
        ("SiftNode's state", SiftNode.get_state.__get__(_node())()),
        ("loader's or a torchdata node's state", roundtrip(loader.state_dict())),
        ("no 'version'", [1, 2, 3]),
    ]


def _node():
    from torchdata.nodes import IterableWrapper

    node = SiftNode(IterableWrapper(SAMPLES), stage())
    node.reset()
    next(node)
    return node


CASES = damaged()


@pytest.mark.parametrize("what,state", CASES, ids=[f"{i}:{c[0][:30]}" for i, c in enumerate(CASES)])
def test_a_damaged_state_is_refused_by_entry_and_changes_nothing(what, state):
    tried, untouched = stage(), stage()
    runs = []
    for s in (tried, untouched):
        it = s(SAMPLES)
        runs.append(output_keys([next(it) for _ in range(3)]))
        if s is tried:
            before = roundtrip(s.state_dict())
            with pytest.raises(sp.ResumeError, match=what):
                s.load_state_dict(state)
            same_state(roundtrip(s.state_dict()), before)
        runs[-1] += output_keys(it)  # the pass goes on as if nothing happened
        runs[-1] += output_keys(s(SAMPLES))
    assert runs[0] == runs[1]
    same_state(roundtrip(tried.state_dict()), roundtrip(untouched.state_dict()))


def test_a_refused_audit_state_leaves_the_policy_as_it_was(tmp_path):
    """The audit log's own refusal (another run id) comes after the policy loaded: it is undone."""
    log = sp.AuditLog(str(tmp_path / "log"), run_id="first", writer="thread")
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 64), micro_batch=16, audit=log)
    it = s(SAMPLES)
    next(it)
    state = roundtrip(s.state_dict())
    s.close()
    policy = sp.RelativeProbabilistic(1.0, 64)
    t = sp.Sifter(
        None,
        loss_field,
        policy,
        micro_batch=16,
        audit=sp.AuditLog(str(tmp_path / "log"), run_id="second", writer="thread"),
    )
    with pytest.raises(sp.ResumeError, match="run_id='second'"):
        t.load_state_dict(state)
    assert len(policy.history) == 0
