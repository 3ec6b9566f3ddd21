"""The stage talks to where its decisions go only through ``siftpipe.sink``: a sink of one's own works."""

import numpy as np
import pytest

import siftpipe as sp
from siftpipe.core.sink import (
    Decisions,
    DecisionSink,
    StageInfo,
    make_sink,
)
from tests.common import loss_field, make_samples


class Recorder:
    """A sink that keeps everything in memory."""

    def __init__(self):
        self.info = None
        self.starts = 0
        self.groups: list[Decisions] = []
        self.closed = False
        self.loaded = None
        self.refuse = False

    def bind(self, info, shard_report):
        self.info = info
        self.shard_report = shard_report

    def start(self):
        self.starts += 1

    def write(self, decisions):
        self.groups.append(decisions)

    def state_dict(self):
        return {"rows": sum(d.n for d in self.groups)}

    def check_state(self, state):
        if self.refuse:
            raise sp.ResumeError("this sink refuses the checkpoint")

    def load_state_dict(self, state, resumed_from=0):
        self.loaded = (dict(state), resumed_from)

    def close(self):
        self.closed = True


def test_a_sink_of_ones_own_receives_every_decision_in_sequence_order():
    samples = make_samples(300)
    sink = Recorder()
    assert isinstance(sink, DecisionSink) and make_sink(sink) is sink
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=32, audit=sink, seed=0)
    s.set_epoch(3)
    s.model_version = 17
    out = list(s(samples))
    assert isinstance(sink.info, StageInfo) and sink.info.policy == "top_fraction"
    assert sink.info.micro_batch == 32 and sink.info.as_dict()["batched"] is False
    assert sink.starts == 1
    seqs = np.concatenate([np.arange(d.seq0, d.seq0 + d.n) for d in sink.groups])
    assert seqs.tolist() == list(range(300))  # every row once, in order
    keys = [k for d in sink.groups for k in d.keys]
    assert keys == [x["__key__"] for x in samples]
    kept = [k for d in sink.groups for k, keep in zip(d.keys, d.kept) if keep]
    assert kept == [o["__key__"] for o in out]
    assert all(d.epoch == 3 and d.model_version == 17 for d in sink.groups)
    assert all(d.loss.shape == d.prob.shape == d.kept.shape == (d.n,) for d in sink.groups)
    assert s.state_dict()["audit"] == {"rows": 300}
    s.close()
    assert sink.closed


def test_a_sink_that_refuses_a_checkpoint_leaves_the_stage_unchanged():
    samples = make_samples(100)
    first = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, audit=Recorder())
    it = first(samples)
    for _ in range(20):
        next(it)
    state = first.state_dict()
    sink = Recorder()
    sink.refuse = True
    second = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, audit=sink)
    before = second.policy.state_dict()
    with pytest.raises(sp.ResumeError, match="refuses"):
        second.load_state_dict(state)
    assert second.stats.seen == 0 and sink.loaded is None
    assert second.policy.state_dict().keys() == before.keys()
    sink.refuse = False
    second.load_state_dict(state)
    assert sink.loaded == ({"rows": state["audit"]["rows"]}, state["counts"]["seen"])


def test_a_url_still_becomes_an_audit_log(tmp_path):
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=16, audit=str(tmp_path / "log"))
    assert isinstance(s.audit, sp.AuditLog) and isinstance(s.audit, DecisionSink)
    list(s(make_samples(64)))
    s.close()
    assert sp.read_log(str(tmp_path / "log")).num_rows == 64


def test_bound_once_however_many_passes():
    sink = Recorder()
    binds = []
    sink.bind = lambda info, report: binds.append(info)
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=8, audit=sink)
    list(s(make_samples(16)))
    s.micro_batch = 4
    list(s(make_samples(16)))
    assert len(binds) == 1 and binds[0].micro_batch == 8 and sink.starts == 2


@pytest.mark.timeout(120)
def test_numpy_settings_reach_the_manifests_as_numbers(tmp_path):
    """A numpy seed or policy setting once made the writer process's JSON fail, and the stage
    waited for it forever."""
    log = sp.AuditLog(str(tmp_path), writer="process")
    s = sp.Sifter(
        None, loss_field, sp.TopFraction(np.float64(0.5)), micro_batch=8, seed=np.int64(3), audit=log
    )
    list(s(make_samples(40)))
    s.close()
    assert sp.read_log(str(tmp_path)).num_rows == 40
    assert s.describe().as_dict()["rng_seed"] == 3 and s.describe().as_dict()["policy_config"] == {
        "keep": 0.5
    }


def test_what_is_not_a_sink_is_refused_by_name():
    with pytest.raises(sp.ConfigError, match="the class AuditLog; pass an instance"):
        sp.Sifter(None, loss_field, audit=sp.AuditLog)

    class Half:
        def write(self, decisions):
            pass

    with pytest.raises(sp.ConfigError, match=r"lacks the DecisionSink methods \['bind', 'start'"):
        sp.Sifter(None, loss_field, audit=Half())


def test_a_sink_that_fails_to_load_is_named_not_the_policy():
    samples = make_samples(40)
    first = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, audit=Recorder())
    it = first(samples)
    next(it)
    state = first.state_dict()
    sink = Recorder()
    sink.load_state_dict = lambda state, resumed_from=0: 1 / 0
    second = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, audit=sink)
    with pytest.raises(sp.ResumeError, match="audit sink Recorder could not load .*ZeroDivisionError"):
        second.load_state_dict(state)
    assert second.stats.seen == 0


def test_a_copy_of_a_stage_has_settings_of_its_own():
    import copy

    s = sp.Sifter(None, loss_field, micro_batch=4)
    c = copy.copy(s)
    c.micro_batch, c.model = 8, "other"
    assert (s.micro_batch, s.model) == (4, None) and (c.micro_batch, c.model) == (8, "other")
    with pytest.raises(AttributeError):
        s.batched = True  # fixed at construction: positions in the state count it
