"""The stage's account of what sifting costs and saves (stats.stage_seconds, step_seconds,
saved_seconds, net_seconds) and its warning when a pass does not pay. Timing enters only as lower
bounds that sleeps guarantee; no test depends on how fast this machine is."""

import logging
import time

import numpy as np
import pytest
import torch

import siftpipe as sp
from siftpipe._account import CostAccount

N = 64


def samples(n: int = N) -> list[dict]:
    losses = np.random.default_rng(0).exponential(size=n)
    return [{"__key__": f"k{i:04d}", "x": torch.zeros(2), "loss": float(losses[i])} for i in range(n)]


def free(model, batch):
    return batch["loss"].double()


def slow_source(items, seconds):
    for item in items:
        time.sleep(seconds)
        yield item


def test_step_time_is_what_the_consumer_spends_and_the_saving_is_dropped_times_step_per_sample():
    s = sp.Sifter(None, free, sp.Uniform(0.5), micro_batch=8, seed=0)
    for _ in s(samples()):
        time.sleep(0.002)  # the training step
    st = s.stats
    assert 0 < st.kept < N and st.kept + st.dropped == N
    assert st.step_seconds >= 0.002 * st.kept  # every handed-on sample's step is counted
    assert st.saved_seconds == pytest.approx(st.dropped * st.step_seconds / st.kept)
    assert st.net_seconds == pytest.approx(st.saved_seconds - st.stage_seconds)
    assert st.stage_seconds > 0


def test_the_sources_time_is_not_charged_to_the_stage_and_observe_is():
    s = sp.Sifter(None, free, sp.Uniform(0.5), micro_batch=8, seed=0, memory=sp.ScoreMemory(1000))
    account = s._account
    for sample in s(slow_source(samples(), 0.004)):
        s.observe([sample["__key__"]], np.array([1.0]))
    assert account.source >= 0.004 * N  # measured as the source's...
    assert s.stats.stage_seconds == pytest.approx(account.inside - account.source + account.observe)
    assert account.observe > 0  # ...and observe() as the stage's
    assert s.stats.step_seconds == pytest.approx(max(0.0, account.outside - account.observe))


def test_batched_stage_counts_rows_handed_on_across_re_batching():
    rows = [{"__key__": [f"b{j}-{i}" for i in range(16)], "loss": torch.rand(16)} for j in range(8)]
    s = sp.Sifter(None, free, sp.Uniform(0.5), batched=True, output_batch=5, seed=0)
    handed = sum(len(b["__key__"]) for b in s(rows))
    assert s._account.handed == handed == s.stats.kept
    assert s._account.dropped == s.stats.dropped == 128 - handed


def test_a_run_that_costs_more_than_it_saves_is_logged_once_from_its_second_dropping_pass(
    caplog, monkeypatch
):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)

    def slow(model, batch):  # the stage's own cost: 30 ms a micro-batch; the "step" is free
        time.sleep(0.03)
        return batch["loss"].double()

    s = sp.Sifter(None, slow, sp.Uniform(0.5), micro_batch=8, seed=0)

    def said():
        return [r.getMessage() for r in caplog.records if "not paying for itself" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        list(s(samples()))
        assert not said()  # one pass that dropped samples is not yet evidence
        for _ in range(2):
            list(s(samples()))
    assert len(said()) == 1, said()
    assert "would have cost about" in said()[0] and "it pays only when it drops more than" in said()[0]
    assert s.stats.net_seconds < 0


def test_a_run_that_pays_is_not_logged_nor_is_one_that_dropped_nothing(caplog, monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        paying = sp.Sifter(None, free, sp.Uniform(0.5), micro_batch=8, seed=0)
        for _ in range(2):
            for _ in paying(samples()):
                time.sleep(0.005)  # each dropped sample saves at least this
        keeping = sp.Sifter(None, free, sp.Uniform(1.0), micro_batch=8, seed=0)
        for _ in range(2):
            for _ in keeping(slow_source(samples(), 0.003)):
                pass
    assert not [r for r in caplog.records if "not paying" in r.getMessage()]
    assert paying.stats.net_seconds > 0 and paying._account.dropping_passes == 2
    assert keeping.stats.dropped == 0 and keeping.stats.saved_seconds == 0.0


def test_the_account_is_not_part_of_the_state_a_resumed_stage_starts_a_fresh_one():
    s = sp.Sifter(None, free, sp.Uniform(0.5), micro_batch=8, seed=0)
    list(s(samples()))
    state = s.state_dict()
    assert not any("account" in k or k in ("stage_seconds", "step_seconds", "saved_seconds") for k in state)
    t = sp.Sifter(None, free, sp.Uniform(0.5), micro_batch=8, seed=0)
    t.load_state_dict(state)
    assert t.stats.stage_seconds == 0.0 and t.stats.dropped == s.stats.dropped
