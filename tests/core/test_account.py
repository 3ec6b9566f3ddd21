"""The stage's account of what sifting costs and saves (stats.stage_seconds, step_seconds,
saved_seconds, net_seconds) and its warning when a pass does not pay. Timing enters only as lower
bounds that sleeps guarantee; no test depends on how fast this machine is."""

import contextlib
import logging
import time

import numpy as np
import pytest
import torch

import siftpipe as sp
from siftpipe.core.account import CostAccount
from siftpipe.core.state import digest
from tests.common import race, roundtrip

N = 64


def samples(n: int = N) -> list[dict]:
    losses = np.random.default_rng(0).exponential(size=n)
    return [{"__key__": f"k{i:04d}", "x": torch.zeros(2), "loss": float(losses[i])} for i in range(n)]


def free(model, batch):
    return batch["loss"].double()


def stage(scorer=free, policy=None, **kwargs):
    """A per-sample stage of micro-batches of 8 (``Uniform(0.5)`` unless ``policy``)."""
    return sp.Sifter(None, scorer, policy or sp.Uniform(0.5), micro_batch=8, seed=0, **kwargs)


def slow_source(items, seconds):
    for item in items:
        time.sleep(seconds)
        yield item


def test_step_time_is_what_the_consumer_spends_and_the_saving_is_dropped_times_step_per_sample():
    s = stage()
    for _ in s(samples()):
        time.sleep(0.002)  # the training step
    st = s.stats
    assert 0 < st.kept < N and st.kept + st.dropped == N
    assert st.step_seconds >= 0.002 * st.kept  # every handed-on sample's step is counted
    assert st.saved_seconds == pytest.approx(st.dropped * st.step_seconds / st.kept)
    assert st.net_seconds == pytest.approx(st.saved_seconds - st.stage_seconds)
    assert st.stage_seconds > 0


def test_the_sources_time_is_not_charged_to_the_stage_and_observe_is():
    s = stage(memory=sp.ScoreMemory(1000))
    account = s._account
    for sample in s(slow_source(samples(), 0.004)):
        s.observe([sample["__key__"]], np.array([1.0]))
    assert account.source >= 0.004 * N  # measured as the source's...
    assert s.stats.stage_seconds == pytest.approx(account.inside - account.source + account.observe)
    assert account.observe > 0  # ...and observe() as the stage's
    assert s.stats.step_seconds == pytest.approx(max(0.0, account.outside - account.observe))


def test_the_time_a_source_takes_to_start_a_pass_is_the_sources_too():
    """``iter(source)`` (a DataLoader starting its workers, a shard listing) is paid with or
    without sifting. Charged to the stage (found by review), a source that spent 1 s a pass
    there made the cost guard stop a run that was paying."""

    class SlowStart:
        def __iter__(self):
            time.sleep(0.25)
            return iter(samples())

    s = stage()
    account = s._account
    for _ in range(3):
        for _ in s(SlowStart()):
            pass
    assert account.source >= 3 * 0.25
    assert s.stats.stage_seconds == pytest.approx(max(0.0, account.inside - account.source) + account.observe)
    assert s.stats.stage_seconds < 0.25  # none of the three starts (the stage's own work: ms)


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

    s = stage(slow_scorer)

    def said():
        return [r.getMessage() for r in caplog.records if "not paying for itself" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        list(s(samples()))
        assert not said()  # one pass that dropped samples is not yet evidence
        for _ in range(2):
            list(s(samples()))
    assert len(said()) == 1, said()
    # 3.75 ms of its own a sample seen against microseconds a step: no share dropped pays for that
    assert "would have cost about" in said()[0] and "cannot pay at any share dropped" in said()[0]
    assert s.stats.net_seconds < 0


def test_a_run_that_pays_is_not_logged_nor_is_one_that_dropped_nothing(caplog, monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        paying = stage()
        for _ in range(2):
            for _ in paying(samples()):
                time.sleep(0.005)  # each dropped sample saves at least this
        keeping = stage(policy=sp.Uniform(1.0))
        for _ in range(2):
            for _ in keeping(slow_source(samples(), 0.003)):
                pass
    assert not [r for r in caplog.records if "not paying" in r.getMessage()]
    assert paying.stats.net_seconds > 0 and paying._account.dropping_passes == 2
    assert keeping.stats.dropped == 0 and keeping.stats.saved_seconds == 0.0


def test_the_account_travels_in_the_state_so_a_job_restarted_every_pass_is_judged(caplog, monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)

    state = None
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        for _ in range(3):  # each pass in a new "process": a stage loaded from the last checkpoint
            s = stage(slow_scorer, cost_guard=True)
            if state is not None:
                s.load_state_dict(state)
            list(s(samples()))
            state = roundtrip(s.state_dict())
    assert state["account"]["dropping_passes"] == 2 and state["account"]["warned"] is True
    assert state["counts"]["stopped_at"] == 2 * N
    assert len([r for r in caplog.records if "not paying for itself" in r.getMessage()]) == 1
    assert "account" not in state["checks"]  # wall time: nothing to check it against
    for bad in ({**state["account"], "inside": -1.0}, {**state["account"], "handed": 1.5}, {"inside": 0.0}):
        t = stage(slow_scorer, cost_guard=True)
        with pytest.raises(sp.ResumeError, match="entry account"):
            t.load_state_dict({**state, "account": bad})
    older = {k: v for k, v in state.items() if k != "account"}  # written before the account existed
    t = stage(slow_scorer, cost_guard=True)
    t.load_state_dict(older)
    assert t.stats.stage_seconds == 0.0 and t.stats.stopped_at == 2 * N


def test_a_job_cut_after_each_passs_last_decision_is_judged_as_the_uninterrupted_one(monkeypatch):
    # found by review, 2026-12-05: a pass resumed from a cut after its last decision counted its
    # drops as earlier passes', so the guard judged (and stopped) one pass late
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    whole = stage(slow_scorer, cost_guard=True)
    for _ in range(3):
        list(whole(samples()))
    state = None
    for p in range(3):  # each pass cut once all of it is decided, and finished by a new "process"
        s = stage(slow_scorer, cost_guard=True)
        if state is not None:
            s.load_state_dict(state)
            list(s(samples()[state["consumed"] :]))  # the pass the cut was in, to its end
        it = iter(s(samples()))
        while s.stats.seen < (p + 1) * N:
            next(it)
        state = roundtrip(s.state_dict())
    s = stage(slow_scorer, cost_guard=True)
    s.load_state_dict(state)
    list(s(samples()[state["consumed"] :]))
    assert whole.stats.stopped_at == 2 * N and s.stats.stopped_at == whole.stats.stopped_at
    assert s._account.dropping_passes == whole._account.dropping_passes == 2
    bad = {**state["account"], "pass_dropped": state["account"]["dropped"] + 1}
    with pytest.raises(sp.ResumeError, match="entry account"):
        stage(slow_scorer, cost_guard=True).load_state_dict({**state, "account": bad})

    # a cut when a pass is opened and not yet read: a whole pass, judged on its own drops (the
    # review of the fix: the previous pass's start was kept, and a pass that dropped nothing
    # counted as one that did: a stop the uninterrupted run never made)
    def pruning_once():  # prunes in the first pass only (anneal after N samples)
        return stage(slow_scorer, policy=sp.PruneEasy(0.5, N), cost_guard=True)

    whole = pruning_once()
    for _ in range(3):
        list(whole(samples()))
    cut = pruning_once()
    list(cut(samples()))
    opened = iter(cut(samples()))  # noqa: F841 - the pass open, unread, as the state is taken
    resumed = pruning_once()
    resumed.load_state_dict(roundtrip(cut.state_dict()))
    for _ in range(2):
        list(resumed(samples()))
    assert whole._account.dropping_passes == resumed._account.dropping_passes == 1
    assert resumed.stats.stopped_at == whole.stats.stopped_at == 0


def slow_scorer(model, batch):  # the stage's own cost: 30 ms a micro-batch; the "step" is free
    time.sleep(0.03)
    return batch["loss"].double()


def test_cost_guard_stops_sifting_from_the_pass_after_it_judged_and_the_state_keeps_it(
    caplog, monkeypatch, tmp_path
):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    memory = sp.ScoreMemory(1000, max_age=None)
    s = stage(slow_scorer, cost_guard=True, memory=memory, audit=str(tmp_path / "log"))
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        for _ in range(2):
            list(s(samples()))
    assert s.stats.stopped_at == 2 * N and s.stats.sifting_scale == 0.0
    said = [r.getMessage() for r in caplog.records if "not paying for itself" in r.getMessage()]
    assert len(said) == 1 and "Sifting stops here for the rest of the run" in said[0]
    dropped, scored = s.stats.dropped, s.stats.scored
    third = list(s(samples()))
    assert [x["__key__"] for x in third] == [x["__key__"] for x in samples()]  # every sample
    assert s.stats.dropped == dropped and s.stats.scored == scored  # nothing scored or dropped
    remembered = len(memory)
    s.observe(["k0000", "new-key"], np.array([1.0, 2.0]))  # counted, not remembered
    assert len(memory) == remembered and s.stats.observed == 2
    state = s.state_dict()
    s.close()
    table = sp.read_log(str(tmp_path / "log"))
    last = table.slice(2 * N)
    assert last.num_rows == N and all(last.column("kept").to_pylist())
    assert set(last.column("reason").to_pylist()) == {"unknown"}  # kept unseen by the policy
    assert all(np.isnan(v) for v in last.column("loss").to_pylist())
    assert set(last.column("source").to_pylist()) == {"none"}
    assert len(set(last.column("micro_batch").to_pylist())) == N // 8  # one per group, as before
    # the stop is part of the state: a resumed stage goes on keeping everything
    t = stage(cost_guard=True, memory=sp.ScoreMemory(1000, max_age=None))
    t.load_state_dict(state)
    assert len(list(t(samples()))) == N and t.stats.stopped_at == 2 * N


def test_cost_guard_judges_each_epoch_of_one_endless_pass_that_set_epoch_numbers(caplog, monkeypatch):
    # before, one endless pass (fixed_steps over resampled shards) was never judged: only a
    # pass's end judged, and the same work split into passes stopped at its second
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    s = stage(slow_scorer, cost_guard=True)

    def endless():
        while True:
            yield from samples()

    stream = s(endless())
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        for epoch in range(3):
            s.set_epoch(epoch)
            while s.stats.seen < (epoch + 1) * N:
                next(stream)
    assert s.stats.stopped_at == 2 * N  # judged when the third epoch began
    assert sum("not paying for itself" in r.getMessage() for r in caplog.records) == 1
    dropped = s.stats.dropped
    for _ in range(2 * N):
        next(stream)
    assert s.stats.dropped == dropped  # nothing dropped since


def test_without_cost_guard_a_stage_that_does_not_pay_only_says_so(caplog, monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    s = stage(slow_scorer)
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        for _ in range(3):
            list(s(samples()))
    said = [r.getMessage() for r in caplog.records if "not paying for itself" in r.getMessage()]
    assert len(said) == 1 and "Sifting stops here" not in said[0]
    assert s.stats.stopped_at == 0 and 0 < s.stats.dropped < 3 * N


def test_a_state_written_before_the_cost_guard_existed_loads_as_not_stopped():
    s = stage()
    list(s(samples()))
    state = s.state_dict()
    del state["counts"]["stopped_at"]
    state["checks"]["counts"] = digest(state["counts"])  # as that version's state_dict wrote it
    t = stage(cost_guard=True)
    t.load_state_dict(state)
    assert t.stats.stopped_at == 0 and t.stats.seen == N


def test_the_recipe_turns_the_cost_guard_on_and_lets_it_be_turned_off():
    assert sp.recipe(None, free, budget=100).cost_guard is True
    assert sp.recipe(None, free, budget=100, cost_guard=False).cost_guard is False


def test_cost_guard_in_batched_mode_hands_every_row_on_re_batched(monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    batches = [{"__key__": [f"b{j}-{i}" for i in range(16)], "loss": torch.rand(16)} for j in range(4)]
    s = sp.Sifter(None, slow_scorer, sp.Uniform(0.5), batched=True, output_batch=5, seed=0, cost_guard=True)
    for _ in range(2):
        list(s(batches))
    assert s.stats.stopped_at == 128
    out = list(s(batches))
    assert [len(b["__key__"]) for b in out] == [5] * 12 + [4]
    assert [k for b in out for k in b["__key__"]] == [k for b in batches for k in b["__key__"]]


def stopped_stage(policy=None, **kwargs):
    """A stage whose cost guard stopped sifting after two passes (its scorer costs 30 ms a call)."""
    s = stage(slow_scorer, policy, cost_guard=True, **kwargs)
    for _ in range(2):
        list(s(samples()))
    assert s.stats.stopped_at == 2 * N
    return s


def test_a_checkpoint_taken_mid_pass_after_the_stop_resumes_with_a_weighting_policy(monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    s = stopped_stage(sp.PruneEasy())
    it = s(samples())
    first = [next(it) for _ in range(3)]
    state = roundtrip(s.state_dict())
    rest = list(it)
    t = stage(policy=sp.PruneEasy(), cost_guard=True)
    t.load_state_dict(state)
    resumed = list(t(samples()))
    assert [x["__key__"] for x in resumed] == [x["__key__"] for x in rest]
    assert [x["__key__"] for x in first + rest] == [x["__key__"] for x in samples()]
    assert {x["__sift_weight__"] for x in first + rest + resumed} == {1.0}


def test_passes_left_early_are_judged_too(caplog, monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    s = stage(slow_scorer, cost_guard=True)
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        for _ in range(2):
            for i, _ in enumerate(s(samples())):
                if i == 20:
                    break  # the generator is closed here (CPython frees it at once)
    assert s._account.dropping_passes == 2 and s.stats.stopped_at > 0
    assert [r for r in caplog.records if "not paying for itself" in r.getMessage()]


def test_loading_a_state_restores_its_account_and_the_stop_follows_the_state_and_the_setting(monkeypatch):
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    fresh = stage()
    list(fresh(samples()))
    before = fresh.state_dict()
    s = stopped_stage()
    stopped = s.state_dict()
    s.load_state_dict(before)  # a rollback to before the stop, in the same process
    # the account is the checkpoint's (one pass that dropped samples, no verdict yet)
    assert s.stats.stopped_at == 0 and not s._account.warned and s._account.dropping_passes == 1
    assert s.stats.dropped > 0 and len(list(s(samples()))) < N  # it sifts again, and may stop again
    old = dict(before, counts={k: v for k, v in before["counts"].items() if k != "stopped_at"})
    old["checks"] = {**before["checks"], "counts": digest(old["counts"])}
    again = stopped_stage()
    again.load_state_dict(old)  # a state from before the counter existed: not stopped
    assert again.stats.stopped_at == 0 and again.stats.seen == N
    off = stage(cost_guard=False)
    off.load_state_dict(stopped)  # the stop is recorded, but this stage does not guard: it sifts
    assert off.stats.stopped_at == 2 * N and off.stats.sifting_scale == 1.0
    assert len(list(off(samples()))) < N


def test_building_output_batches_is_the_stages_time_not_the_steps():
    from torch.utils.data import default_collate

    def slow_collate(rows):
        time.sleep(0.005)
        return default_collate(rows)

    s = sp.Sifter(
        None, free, sp.Uniform(0.5), micro_batch=64, output_batch=2, collate_fn=slow_collate, seed=0
    )
    batches = list(s(samples()))
    assert s.stats.stage_seconds >= 0.005 * len(batches)


def test_on_one_rank_of_several_the_guard_logs_and_does_not_stop(caplog, monkeypatch):
    """A rank whose stage was slower stopped sifting alone: ranks step together, so it saved no
    step, and EqualSteps cut its epochs at random instead of by loss (found by review,
    2026-12-05). On one rank of several the guard logs and goes on sifting."""
    monkeypatch.setattr(CostAccount, "MIN_EVIDENCE_SECONDS", 0.1)
    monkeypatch.setenv("WORLD_SIZE", "2")  # (what dist_info reads without a process group)
    s = stage(slow_scorer, cost_guard=True)
    with caplog.at_level(logging.WARNING, logger="siftpipe"):
        for _ in range(3):
            list(s(samples()))
    said = [r.getMessage() for r in caplog.records if "not paying for itself" in r.getMessage()]
    assert len(said) == 1 and "Sifting stops here" not in said[0]
    assert s.stats.stopped_at == 0 and s.stats.dropped > 2 * N // 4
    # and says why it did not stop (the review of the fix: its log read as cost_guard=False's)
    why = [
        r.getMessage() for r in caplog.records if "does not stop sifting on one rank of 2" in r.getMessage()
    ]
    assert len(why) == 1


class StepClock:
    """``time.perf_counter`` that moves only when told (and a nanosecond per read, to stay
    monotonic): the account's arithmetic, judged exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-9
        return self.now


def test_time_spent_off_the_clock_between_batches_is_not_step_time_nor_saved(monkeypatch):
    clock = StepClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    runs = {}
    for off in (False, True, "nested"):
        s = stage()
        for _epoch in range(2):
            for _ in s(samples()):
                clock.now += 1.0  # the training step: one second a sample handed on
                with s.off_clock() if off else contextlib.nullcontext():
                    clock.now += 50.0  # an evaluation between two steps
                    # (a trainer's evaluation is off the clock already: a block of one's own
                    # inside it is left out once, where twice made the step time 0)
                    with s.off_clock() if off == "nested" else contextlib.nullcontext():
                        clock.now += 50.0
            with s.off_clock():
                clock.now += 1000.0  # between passes: nothing is timed, off the clock or not
        runs[off] = s.stats
    on, off = runs[False], runs[True]
    assert on.kept == off.kept == runs["nested"].kept and 0 < off.kept < N  # the same decisions
    assert runs["nested"].step_seconds == pytest.approx(off.step_seconds, abs=1e-6)
    assert off.step_seconds == pytest.approx(off.kept * 1.0, abs=1e-3)  # the steps alone
    assert on.step_seconds == pytest.approx(on.kept * 101.0, abs=1e-3)  # without it: evaluations too
    assert off.saved_seconds == pytest.approx(off.dropped * off.step_seconds / off.kept)


def test_off_clock_blocks_in_several_threads_close_to_none_open(monkeypatch):
    # the depth of open blocks was counted without a lock: a thread switch inside the update
    # left it above 0 with every block closed, and from then on no block was left out (the
    # review of the change, 2026-12-06)
    s = stage()

    def blocks():
        for _ in range(5000):
            with s.off_clock():
                pass

    assert not race(*[blocks] * 4)
    clock = StepClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    for _ in s(samples()):
        clock.now += 1.0
        with s.off_clock():
            clock.now += 100.0
    assert s.stats.step_seconds == pytest.approx(s.stats.kept * 1.0, abs=1e-3)


def test_a_copy_made_inside_an_off_clock_block_has_none_open(monkeypatch):
    # a stage pickled (or deep-copied) while an off_clock block was open carried the open block
    # into the copy, where nothing closes it: no block of the copy's was ever left out again
    import copy
    import pickle

    s = stage()
    with s.off_clock():
        copies = [pickle.loads(pickle.dumps(s)), copy.deepcopy(s)]
    clock = StepClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    for c in copies:
        for _ in c(samples()):
            clock.now += 1.0
            with c.off_clock():
                clock.now += 100.0
        assert 0 < c.stats.kept < N
        assert c.stats.step_seconds == pytest.approx(c.stats.kept * 1.0, abs=1e-3)


def test_an_account_pickled_before_its_own_getstate_still_loads():
    # Python pickles a class with slots and no __getstate__ as (None, {slot: value}): such
    # pickles (a Sifter pickled whole by the version before) failed to load with "'tuple' object
    # has no attribute 'items'" once the account had a __setstate__ (the review of the change)
    s = stage()
    list(s(samples()))
    account = s._account
    old = (None, {name: getattr(account, name) for name in CostAccount.__slots__})
    old[1]["_off_depth"] = 1  # (taken inside an off_clock block)
    loaded = CostAccount.__new__(CostAccount)
    loaded.__setstate__(old)
    assert loaded.state_dict() == account.state_dict()
    loaded.off_begins()
    loaded.off_ends()  # none open in the copy: one block opens and closes to none
    assert loaded._off_depth == 0
