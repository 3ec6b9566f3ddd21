"""siftpipe.core.decider: the stage's deciding part, on its own (no Sifter, no pass)."""

import numpy as np
import pytest
import torch

import siftpipe as sp
from siftpipe.core.decider import Decider
from siftpipe.core.ledger import Group
from siftpipe.core.memory import FEEDBACK, NONE
from siftpipe.core.sink import DecisionSink


class Collect(DecisionSink):
    def __init__(self):
        self.decisions = []

    def write(self, decisions):
        self.decisions.append(decisions)


def group(n=4, seq0=0):
    return Group([{"__key__": f"k{i}", "x": float(i)} for i in range(seq0, seq0 + n)], n, seq0, None)


def losses_scorer(model, batch):
    return batch["x"].double()


def decider(**settings):
    d = Decider()
    d.scoring.scorer = losses_scorer
    d.scoring.micro_batch = 4
    for name, value in settings.items():
        setattr(d, name, value)
    return d


def test_a_group_is_scored_decided_counted_and_written_to_the_sink():
    sink = Collect()
    d = decider(policy=sp.TopFraction(0.5), audit=sink, epoch=3, model_version=7)
    g = group()
    d.decide(g)
    assert g.keep.tolist() == [False, False, True, True]  # the two highest losses
    assert g.kept_index.tolist() == [2, 3]
    c = d.counts
    assert (c["seen"], c["kept"], c["dropped"], c["scored"], c["micro_batches"]) == (4, 2, 2, 4, 1)
    (written,) = sink.decisions
    assert written.keys == ["k0", "k1", "k2", "k3"] and written.epoch == 3 and written.model_version == 7
    assert np.array_equal(written.loss, [0.0, 1.0, 2.0, 3.0]) and written.kept.tolist() == g.keep.tolist()


def test_with_a_memory_known_samples_need_no_forward_and_unknown_ones_are_kept_with_keep():
    memory = sp.ScoreMemory(capacity=16, max_age=None)
    d = decider(policy=sp.Uniform(0.001), memory=memory, unknown="keep", audit=Collect())
    d.observe(["k0", "k1"], np.array([5.0, 6.0]))
    d.epoch = 1  # handed back losses are used from the next epoch on
    g = group()
    d.decide(g)
    assert d.counts["scored"] == 0 and d.counts["from_memory"] == 2 and d.counts["unknown"] == 2
    assert g.keep.tolist() == [False, False, True, True]  # Uniform(0.001) drops the known ones (seeded)
    (written,) = d.audit.decisions
    assert written.source.tolist() == [FEEDBACK, FEEDBACK, NONE, NONE]


def test_observe_refuses_keys_and_losses_of_different_lengths_and_a_stage_with_no_memory():
    with pytest.raises(sp.ConfigError, match="observe\\(\\) needs a score memory"):
        decider().observe(["a"], np.zeros(1))
    d = decider(memory=sp.ScoreMemory(capacity=16))
    with pytest.raises(sp.ScorerOutputError, match="2 keys but 3 losses.*reduction='none'"):
        d.observe(["a", "b"], np.zeros(3))
    assert d.counts["observed"] == 0


def test_once_the_cost_guard_stopped_every_row_is_kept_with_weight_one_and_nothing_is_scored():
    d = decider(policy=sp.TopFraction(0.25), cost_guard=True)
    d.counts["stopped_at"] = 1
    assert d.stopped
    g = group()
    d.decide(g)
    assert g.keep.all() and np.array_equal(g.weight, np.ones(4)) and d.counts["scored"] == 0
    d.cost_guard = False  # a stage resumed with cost_guard=False sifts again
    assert not d.stopped


def test_a_non_finite_loss_names_the_sample_and_the_fix():
    d = decider()
    g = group()
    g.items[2]["x"] = float("nan")
    with pytest.raises(sp.NonFiniteLossError, match=r"seq 2, keys .*k2.*on_nan='keep' or 'drop'"):
        d.decide(g)
    d.on_nan = "drop"
    d.decide(g)
    assert not g.keep[2] and d.counts["nan"] == 1


def test_the_stage_exposes_the_deciders_settings_as_its_own():
    s = sp.Sifter(None, losses_scorer, sp.Uniform(0.5), seed=1)
    s.model_version = 12
    s.epoch = 4
    assert s._decider.model_version == 12 and s._decider.epoch == 4
    assert s._decider.scoring is s._scoring  # one scoring part, shared
    s.policy = sp.TopFraction(0.5)
    g = Group(
        [{"__key__": "a", "x": torch.tensor(1.0)}, {"__key__": "b", "x": torch.tensor(2.0)}], 2, 0, None
    )
    s._decider.decide(g)
    assert g.keep.tolist() == [False, True]  # the policy set on the stage decides
