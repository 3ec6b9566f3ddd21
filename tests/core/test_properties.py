"""Bad values, property-based: any losses (inf, NaN, ties, all equal, one sample), any policy and
state, any micro-batch, output batch and cut point. Invariants, not examples."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.core.decide import check_decision
from siftpipe.core.memory import (
    FEEDBACK,
    FORWARD,
    STALE,
    key_hashes,
)
from tests.common import loss_field, roundtrip
from tests.contract import PlainList, check_save_load, output_keys

SETTINGS = settings(max_examples=60, deadline=None, derandomize=False)

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
# few distinct values, so that ties are common; all-equal and one-sample runs come up often
tied = st.sampled_from([0.0, 1.0, 1.0, 2.5, -3.0, 1e-300, 7.0])
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


def losses(allow_non_finite: bool, max_size: int = 160):
    element = st.one_of(finite, tied, non_finite) if allow_non_finite else st.one_of(finite, tied)
    return st.lists(element, min_size=1, max_size=max_size)


@st.composite
def policies(draw, infobatch=False):
    """A policy of any kind and setting (``infobatch``: also InfoBatch, bound to a memory of its
    own: alone, not through a stage, which would need a score memory)."""
    kinds = ["relative", "top", "prune", "uniform"] + (["infobatch"] if infobatch else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "relative":
        return sp.RelativeProbabilistic(draw(st.floats(0.05, 8.0)), draw(st.integers(1, 300)))
    if kind == "top":
        return sp.TopFraction(draw(st.floats(0.01, 1.0)))
    if kind == "prune":
        anneal = draw(st.one_of(st.none(), st.integers(0, 200)))
        return sp.PruneEasy(draw(st.floats(0.0, 0.95)), anneal, draw(st.integers(1, 300)))
    if kind == "infobatch":
        budget = draw(st.one_of(st.none(), st.integers(1, 400)))
        guard = draw(st.one_of(st.none(), st.floats(0.01, 10.0)))
        policy = sp.InfoBatch(draw(st.floats(0.0, 0.95)), budget, 0.875, guard, draw(st.booleans()))
        memory = sp.ScoreMemory(64, max_age=None)
        # a remembered mean of any sign, or none at all
        known = draw(st.lists(st.one_of(finite, tied), max_size=20))
        memory.update(key_hashes([f"m{i}" for i in range(len(known))]), np.array(known), 0, FEEDBACK)
        policy.bind_memory(memory)
        return policy
    return sp.Uniform(draw(st.floats(0.01, 1.0)))


def samples_of(values):
    return [{"__key__": f"k{i:05d}", "loss": float(v)} for i, v in enumerate(values)]


def batches_of(samples, size):
    return [default_collate(samples[i : i + size]) for i in range(0, len(samples), size)]


# ------------------------------------------------------------------ the policies alone


@SETTINGS
@given(policy=policies(infobatch=True), values=losses(False), seed=st.integers(0, 2**32 - 1))
def test_a_policy_decision_is_well_formed_for_any_finite_losses(policy, values, seed):
    x = np.asarray(values, dtype=np.float64)
    d = policy.decide(x, np.random.default_rng(seed), 0)
    n = x.size
    check_decision(policy, d, n, 0)  # what the stage skips for these policies on its hot path
    assert d.keep.shape == d.prob.shape == d.score.shape == (n,) and d.keep.dtype == bool
    assert np.all((d.prob >= 0) & (d.prob <= 1)), d.prob
    assert not d.keep[d.prob == 0].any() and d.keep[d.prob == 1].all()
    if d.weight is not None:
        assert np.all(np.isfinite(d.weight) & (d.weight >= 1.0))
    if isinstance(policy, sp.TopFraction):
        # round(keep * n) half up, of keep as written (the float product may fall below .5)
        assert d.keep.sum() == math.floor(Fraction(repr(policy.keep)) * n + Fraction(1, 2))
        if 0 < d.keep.sum() < n:  # the kept are the highest, ties to the earlier sample
            assert x[d.keep].min() >= x[~d.keep].max()
    if isinstance(policy, sp.RelativeProbabilistic):
        assert np.all((d.score >= 0) & (d.score <= 1))


# ------------------------------------------------------------------ the stage


@SETTINGS
@given(
    policy=policies(),
    values=losses(True),
    micro_batch=st.integers(1, 70),
    output_batch=st.one_of(st.none(), st.integers(1, 50)),
    delay=st.integers(0, 60),
    on_nan=st.sampled_from(["raise", "keep", "drop"]),
    batched=st.booleans(),
    chunk=st.one_of(st.none(), st.integers(1, 70)),
    pad=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_any_losses_through_the_stage_keep_an_ordered_subset_and_counts_add_up(
    policy, values, micro_batch, output_batch, delay, on_nan, batched, chunk, pad, seed
):
    samples = samples_of(values)
    # batched: input batches of `micro_batch` rows, scored in chunks of `chunk` rows (None: whole)
    source = batches_of(samples, micro_batch) if batched else samples
    scoring = chunk if batched else micro_batch
    s = sp.Sifter(
        None,
        loss_field,
        policy,
        micro_batch=scoring,
        batched=batched,
        output_batch=output_batch,
        delay=delay,
        on_nan=on_nan,
        pad_micro_batch=pad and scoring is not None,
        seed=seed,
    )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad and on_nan == "raise":
        with pytest.raises(sp.NonFiniteLossError, match=repr(samples[bad[0]]["__key__"])):
            list(s(source))
        return
    out = list(s(source))
    kept = output_keys(out)
    order = [int(k[1:]) for k in kept]
    assert order == sorted(set(order)), "kept samples must be a subset of the input, in order, once each"
    st_ = s.stats
    assert st_.seen == len(values) and st_.kept + st_.dropped == st_.seen and st_.kept == len(kept)
    assert st_.nan == len(bad)
    assert all(int(k[1:]) not in bad for k in kept) if on_nan == "drop" else True
    if on_nan == "keep":
        assert {f"k{i:05d}" for i in bad} <= set(kept)
    assert st_.warmup == sum(1 for i, v in enumerate(values) if i < delay and math.isfinite(v))
    assert {f"k{i:05d}" for i, v in enumerate(values) if i < delay and math.isfinite(v)} <= set(kept)
    if output_batch is not None:
        sizes = [len(b["__key__"]) for b in out]
        assert all(n == output_batch for n in sizes[:-1]) and (not sizes or 1 <= sizes[-1] <= output_batch)
    history = getattr(policy, "history", None)
    if history is not None:  # no non-finite loss ever enters the window
        assert np.isfinite(history.values()).all()


@SETTINGS
@example(  # found by this test: weights went through the state as float32 and came back changed
    policy=sp.PruneEasy(0.8125, None, 1),
    values=[0.0, 0.0, 1.0],
    micro_batch=3,
    output_batch=None,
    delay=1,
    batched=False,
    cut=1,
)
@given(
    policy=policies(),
    values=losses(False, max_size=120),
    micro_batch=st.integers(1, 40),
    output_batch=st.one_of(st.none(), st.integers(1, 30)),
    delay=st.integers(0, 30),
    batched=st.booleans(),
    cut=st.integers(0, 200),
)
def test_resume_at_any_cut_equals_the_uninterrupted_run(
    policy, values, micro_batch, output_batch, delay, batched, cut
):
    samples = samples_of(values)
    data = batches_of(samples, micro_batch) if batched else samples
    config = policy.config()

    def make():
        return PlainList(
            data,
            model=None,
            scorer=loss_field,
            policy=type(policy)(**config),  # the state goes through torch.load(weights_only=True)
            micro_batch=None if batched else micro_batch,
            batched=batched,
            output_batch=output_batch,
            delay=delay,
            seed=17,
        )

    reference = list(make().start())
    if not reference:
        return  # nothing kept: no cut to make (TopFraction of 1 sample rounding to 0, say)
    check_save_load(make, [cut % (len(reference) + 1)], input_keys=[s["__key__"] for s in samples])


# ------------------------------------------------------------------ the loss window


def brute_percentile(window, probe):
    w = np.asarray(window, dtype=np.float64)
    return np.array([((w < v).sum() + (w <= v).sum()) / (2 * w.size) for v in probe])


@settings(max_examples=50, deadline=None)
@given(
    size=st.one_of(st.integers(1, 64), st.integers(2040, 2300)),  # both update paths (re-sort, incremental)
    chunks=st.lists(st.lists(st.one_of(finite, tied), min_size=0, max_size=700), min_size=1, max_size=8),
    probe=st.lists(st.one_of(finite, tied), min_size=1, max_size=20),
)
def test_loss_history_equals_a_brute_force_window(size, chunks, probe):
    h = sp.LossHistory(size)
    everything: list[float] = []
    for chunk in chunks:
        h.extend(np.asarray(chunk, dtype=np.float64))
        everything.extend(chunk)
        window = everything[-size:]
        assert len(h) == len(window)
        np.testing.assert_array_equal(h.values(), np.asarray(window, dtype=np.float64))
        if window:
            np.testing.assert_array_equal(h.percentile(np.asarray(probe)), brute_percentile(window, probe))
            assert h.mean() == pytest.approx(float(np.mean(window)), rel=1e-9, abs=1e-6)
        else:
            assert (h.percentile(np.asarray(probe)) == 0.5).all()
    copy = sp.LossHistory(size)
    copy.load_state_dict(roundtrip(h.state_dict()))
    np.testing.assert_array_equal(copy.values(), h.values())
    np.testing.assert_array_equal(copy.percentile(np.asarray(probe)), h.percentile(np.asarray(probe)))


# ------------------------------------------------------------------ the score memory

update_op = st.tuples(
    st.just("update"),
    st.lists(st.integers(0, 60), min_size=0, max_size=40),  # keys
    st.lists(st.one_of(finite, non_finite), min_size=40, max_size=40),  # losses (zipped with keys)
    st.integers(0, 6),  # epoch
    st.sampled_from([FORWARD, FEEDBACK, STALE]),
)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(update_op, min_size=1, max_size=12),
    max_age=st.integers(1, 3),
    capacity=st.integers(1, 80),
    probe_epoch=st.integers(0, 9),
)
def test_score_memory_equals_a_dict_model(ops, max_age, capacity, probe_epoch):
    memory = sp.ScoreMemory(capacity=capacity, max_age=max_age)
    model: dict[int, tuple[float, int, int]] = {}  # key -> (loss, epoch, source)
    refused: set[int] = set()
    for _, keys, values, epoch, source in ops:
        values = values[: len(keys)]
        memory.update(key_hashes(keys), np.asarray(values, dtype=np.float64), epoch, source)
        for k, v in zip(keys, values):
            if math.isfinite(v) and (k in model or k not in refused):
                model[k] = (float(np.float32(v)), epoch, source)
        # which new keys a full memory turns away is its own business (the model follows it); a
        # memory with room turns none away
        known = set(_held_keys(memory, model))
        for k in list(model):
            if k not in known:
                assert len(memory) == capacity, f"key {k} was lost by a memory that had room"
                refused.add(k)
                del model[k]
    assert len(memory) == len(model) <= capacity
    probe = list(range(70))
    loss, source = memory.lookup(key_hashes(probe), probe_epoch)
    for k, got, src in zip(probe, loss, source):
        if k in model and 1 <= probe_epoch - model[k][1] <= max_age:
            assert got == model[k][0] and src == model[k][2]
        else:
            assert math.isnan(got)
    copy = sp.ScoreMemory(capacity=capacity, max_age=max_age)
    copy.load_state_dict(roundtrip(memory.state_dict()))
    again = copy.lookup(key_hashes(probe), probe_epoch)
    np.testing.assert_array_equal(again[0], loss)
    np.testing.assert_array_equal(again[1], source)
    assert copy.refused == memory.refused and len(copy) == len(memory)


def _held_keys(memory, model):
    """Keys of ``model`` the memory holds (any epoch): its slots, read through its own probe."""
    hashes = key_hashes(list(model))
    slot = memory._slots(hashes)
    return [k for k, here, h in zip(model, memory._keys[slot], hashes) if here == h]
