import json

import numpy as np
import pytest
import torch

import siftpipe as sp
from siftpipe.core.memory import FEEDBACK, FORWARD, key_hashes
from tests.common import race, roundtrip


def test_hashes_are_stable_and_never_zero():
    h = key_hashes(["a", "b", "a", 17])
    assert h[0] == h[2] and h[0] != h[1] and h.dtype == np.uint64 and (h != 0).all()
    # BLAKE2b-64 of the UTF-8 key, little-endian: the same in every process and Python version
    assert int(key_hashes(["x"])[0]) == int.from_bytes(
        __import__("hashlib").blake2b(b"x", digest_size=8).digest(), "little"
    )
    # any key is hashed as str(key); numpy strings and a generator give the same values
    assert int(h[3]) == int.from_bytes(__import__("hashlib").blake2b(b"17", digest_size=8).digest(), "little")
    assert key_hashes(np.array(["a", "b"])).tolist() == h[:2].tolist()
    assert key_hashes(k for k in ["a", "b"]).tolist() == h[:2].tolist()
    assert key_hashes([]).shape == (0,) and key_hashes([]).dtype == np.uint64


def test_remembers_the_last_loss_per_key_against_a_dict():
    rng = np.random.default_rng(0)
    memory = sp.ScoreMemory(capacity=5000, max_age=2)
    truth: dict[int, tuple[float, int]] = {}
    for epoch in range(5):
        for _ in range(20):
            keys = rng.integers(0, 3000, size=200)
            losses = rng.random(200).astype(np.float32)
            memory.update(key_hashes(keys), losses, epoch, FEEDBACK)
            for k, v in zip(keys, losses):
                truth[int(k)] = (float(v), epoch)
    assert len(memory) == len(truth)
    probe = np.arange(3500)
    loss, source = memory.lookup(key_hashes(probe), epoch=5)
    for k in probe:
        if k in truth and 1 <= 5 - truth[k][1] <= 2:
            assert loss[k] == pytest.approx(truth[k][0])
            assert source[k] == FEEDBACK
        else:
            assert np.isnan(loss[k])


def test_current_epoch_losses_are_not_used_and_age_limits():
    memory = sp.ScoreMemory(100, max_age=1)
    memory.update(key_hashes(["a"]), np.array([2.0]), epoch=3, source=FORWARD)
    assert np.isnan(memory.lookup(key_hashes(["a"]), 3)[0][0])  # not this epoch's own
    assert memory.lookup(key_hashes(["a"]), 4)[0][0] == 2.0
    assert np.isnan(memory.lookup(key_hashes(["a"]), 5)[0][0])  # too old


def test_bounded_refuses_and_counts_beyond_capacity():
    memory = sp.ScoreMemory(capacity=1000)
    memory.update(key_hashes(range(1500)), np.ones(1500), 0, FEEDBACK)
    assert len(memory) == 1000 and memory.refused == 500
    held = key_hashes(range(1500))[~np.isnan(memory.lookup(key_hashes(range(1500)), 1)[0])][:10]
    memory.update(held, np.zeros(10), 0, FEEDBACK)  # keys it holds are still updated when full
    assert (memory.lookup(held, 1)[0] == 0).all() and len(memory) == 1000
    assert memory.nbytes / memory.capacity < 25


def test_state_and_file_roundtrip(tmp_path):
    memory = sp.ScoreMemory(capacity=2000, max_age=3)
    memory.update(key_hashes(range(1200)), np.arange(1200.0), 1, FEEDBACK)
    memory.update(key_hashes(range(600, 900)), np.full(300, -1.0), 2, FORWARD)
    copy = sp.ScoreMemory(capacity=2000, max_age=3)
    copy.load_state_dict(roundtrip(memory.state_dict()))
    memory.save(str(tmp_path / "m.npz"))
    loaded = sp.ScoreMemory.load(str(tmp_path / "m.npz"))
    assert loaded.capacity == 2000 and loaded.max_age == 3 and len(loaded) == len(memory)
    probe = key_hashes(range(1300))
    for other in (copy, loaded):
        a, b = memory.lookup(probe, 3), other.lookup(probe, 3)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(sp.ResumeError, match="capacity=2000"):
        sp.ScoreMemory(capacity=10).load_state_dict(memory.state_dict())


def test_key_cache_answers_what_key_hashes_would_and_stays_within_its_bound():
    keys = [f"k{i}" for i in range(50)]
    memory = sp.ScoreMemory(100, key_cache=30)
    first = memory.hashes(keys[:20])
    assert first.tolist() == key_hashes(keys[:20]).tolist() and not memory._slot_of  # none stored yet
    memory.update_keys(keys[:20], np.ones(20), 0, FEEDBACK)
    assert set(memory._slot_of) == set(keys[:20])
    memory.update_keys(keys[10:50], np.ones(40), 0, FEEDBACK)  # 10 cached, 30 new of which 10 fit
    assert len(memory._slot_of) == 30 and set(memory._slot_of) == set(keys[:30])
    for at, key in ((memory._slot_of[k], k) for k in keys[:30]):
        assert memory._keys[at] == key_hashes([key])[0]
    again = memory.hashes([*keys[::-1], keys[0]])  # repeats, cached and uncached together
    assert again.tolist() == key_hashes([*keys[::-1], keys[0]]).tolist() and len(memory._slot_of) == 30
    assert memory.hashes(np.array(keys[:3])).tolist() == first[:3].tolist()  # numpy strings
    assert memory.hashes([]).shape == (0,)
    memory.load_state_dict(memory.state_dict())  # refilled: the keys may sit elsewhere now
    assert not memory._slot_of
    off = sp.ScoreMemory(100, key_cache=0)
    off.update_keys(keys, np.ones(50), 0, FEEDBACK)
    assert off.hashes(keys).tolist() == key_hashes(keys).tolist() and not off._slot_of
    for bad in (-1, 1.5, True):
        with pytest.raises(sp.ConfigError, match="key_cache"):
            sp.ScoreMemory(100, key_cache=bad)


@pytest.mark.parametrize(("capacity", "key_cache"), [(40, 500), (400, 60), (400, 500)])
def test_keyed_lookups_and_updates_agree_with_the_hashed_ones_whatever_the_cache_holds(capacity, key_cache):
    """A memory that answers from its slot cache and one that hashes every key (key_cache=0) go
    through the same operations and must agree on every answer and on their states: repeated
    keys, NaN losses, a full memory refusing keys, int keys, a refill from a state."""
    rng = np.random.default_rng(7)
    universe = [f"s{i}" for i in range(120)]
    cached = sp.ScoreMemory(capacity, max_age=2, key_cache=key_cache)
    hashed = sp.ScoreMemory(capacity, max_age=2, key_cache=0)
    slow = []  # update_keys calls that went through hashing (the others took the cached slots)
    update = cached.update
    cached.update = lambda *a: (slow.append(1), update(*a))  # type: ignore[method-assign]
    fast = 0
    for step in range(300):
        epoch = step // 40
        n = int(rng.integers(1, 30))
        keys = [universe[i] for i in rng.integers(0, len(universe), n)]
        if step % 7 == 3:
            keys = list(dict.fromkeys(keys))  # distinct: the fast path when all are cached
        if step % 50 == 17:
            keys = [np.str_(k) for k in keys]
        losses = rng.exponential(size=len(keys))
        if step % 11 == 5:
            losses[0] = np.nan
        source = FEEDBACK if step % 5 else 0
        for memory in (cached, hashed):
            memory.update_keys(keys, losses, epoch, source)
        fast += not slow
        slow.clear()
        probe = [universe[i] for i in rng.integers(0, len(universe), 25)]
        a, b = cached.lookup_keys(probe, epoch + 1), hashed.lookup_keys(probe, epoch + 1)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        assert cached.refused == hashed.refused and len(cached) == len(hashed)
        assert cached.mean() == pytest.approx(hashed.mean(), rel=1e-12, nan_ok=True)
        assert cached.forgetting() == hashed.forgetting()
        if step == 150:
            cached.load_state_dict(cached.state_dict())
            hashed.load_state_dict(hashed.state_dict())
    # (the cache was in use, and so was its fast path, but where few keys fit in it)
    assert cached._slot_of and (fast > 10 or min(capacity, key_cache) < len(universe))
    a, b = cached.state_dict(), hashed.state_dict()
    for name in ("keys", "loss", "epoch", "source"):
        order_a, order_b = a["keys"].argsort(), b["keys"].argsort()
        assert torch.equal(a[name][order_a], b[name][order_b]), name
    for memory in (cached, hashed):  # not strings: hashed, never cached
        memory.update_keys([1, 2, "s1"], np.full(3, 5.0), 9, FEEDBACK)
    assert all(type(k) is str for k in cached._slot_of)
    probe = key_hashes(["1", "2", "s1"])
    np.testing.assert_array_equal(cached.lookup(probe, 10)[0], hashed.lookup(probe, 10)[0])


def test_observe_stores_under_the_same_hashes_whether_the_stage_remembered_them_or_not():
    from tests.common import loss_field, make_samples

    samples = make_samples(60)
    keys = [x["__key__"] for x in samples]
    s = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, memory=sp.ScoreMemory(1000)
    )
    list(s(samples))  # the lookups and the scores remembered cache these keys' slots
    assert keys[0] in s.memory._slot_of  # (the cache is in use, so the checks below exercise it)
    # some remembered, one never seen, then keys that are equal as dict keys but not as strings
    observed = [*keys[:5], "never-seen", *keys[5:8]]
    s.observe(observed, np.arange(len(observed), dtype=np.float64) + 0.5)
    s.observe([1, 1.0, True], np.array([7.0, 8.0, 9.0]))
    s.observe(keys[:5], np.full(5, 3.0))  # the second time: from the cache again, same slots
    got, _ = s.memory.lookup(key_hashes([*observed, 1, 1.0, True]), epoch=1)
    assert got.tolist() == [3.0] * 5 + [5.5, 6.5, 7.5, 8.5, 7.0, 8.0, 9.0]
    # a stage whose keys are ints: True and 1.0 must not pick up the hash remembered for 1
    ints = [{**x, "__key__": i} for i, x in enumerate(samples)]
    s = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, memory=sp.ScoreMemory(1000)
    )
    list(s(ints))
    s.observe([True, 1.0, 1], np.array([1.0, 2.0, 3.0]))
    got, _ = s.memory.lookup(key_hashes(["True", "1.0", "1"]), epoch=1)
    assert got.tolist() == [1.0, 2.0, 3.0]

    class Tagged(str):  # a str subclass whose str() differs: the cache must not answer for it
        def __str__(self):
            return "tag:" + str.__str__(self)

    s = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, memory=sp.ScoreMemory(1000)
    )
    list(s(samples))
    s.observe([Tagged(keys[0])], np.array([4.0]))
    got, _ = s.memory.lookup(key_hashes([Tagged(keys[0]), keys[0]]), epoch=1)
    assert got[0] == 4.0 and got[1] != 4.0  # keys[0] keeps what the pass scored


def test_integer_key_arrays_find_the_slots_their_strings_hash_to():
    """Keys given as an integer array are cached by value; they must land where ``str(key)``
    does in a memory that hashes every key: negatives, values past the cache, repeats, NaN."""
    rng = np.random.default_rng(3)
    by_value = sp.ScoreMemory(500, max_age=None, key_cache=64)
    hashed = sp.ScoreMemory(500, max_age=None, key_cache=0)
    for step in range(200):
        n = int(rng.integers(1, 40))
        keys = rng.integers(-5, 90, n)
        if step % 3 == 0:
            keys = np.unique(keys)  # distinct: the cached fast path once all are known
        losses = rng.exponential(size=keys.size)
        if step % 13 == 4:
            losses[-1] = np.inf
        by_value.update_keys(keys.astype(np.int32 if step % 2 else np.int64), losses, step // 20, FEEDBACK)
        hashed.update_keys([str(k) for k in keys.tolist()], losses, step // 20, FEEDBACK)
        probe = rng.integers(-5, 100, 30)
        a = by_value.lookup_keys(probe, step // 20 + 1)
        b = hashed.lookup_keys([str(k) for k in probe.tolist()], step // 20 + 1)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        assert by_value.hashes(probe).tolist() == key_hashes(probe.tolist()).tolist()
        assert by_value.mean() == pytest.approx(hashed.mean(), rel=1e-12, nan_ok=True)
        if step == 100:
            by_value.load_state_dict(by_value.state_dict())  # refilled: slots move, the cache empties
            assert (by_value._slot_of_int == -1).all()
    table = by_value._slot_of_int
    assert table is not None and (table >= 0).sum() == 64  # every value in [0, 64) was seen
    assert table.size == 64  # grown to what was stored, never past key_cache
    assert not by_value._slot_of  # no string keys were cached
    big = sp.ScoreMemory(100, key_cache=10**9)  # a cache of a billion values costs nothing unused
    big.update_keys(np.array([3, 5]), np.ones(2), 0, FEEDBACK)
    assert big._slot_of_int is not None and big._slot_of_int.size == 1024
    big.update_keys(np.array([5000]), np.ones(1), 0, FEEDBACK)
    assert big._slot_of_int.size == 10002 and (big._slot_of_int >= 0).sum() == 3
    assert big.lookup_keys(np.array([3, 5, 5000, 7]), 1)[0].tolist()[:3] == [1.0, 1.0, 1.0]


def test_usable_at_counts_the_losses_a_look_up_in_that_epoch_can_use():
    memory = sp.ScoreMemory(100, max_age=2)
    memory.update_keys(["a", "b"], np.array([1.0, 2.0]), 0, FEEDBACK)
    memory.update_keys(["c"], np.array([3.0]), 1, FEEDBACK)
    # epoch 1: a, b (age 1), not c (stored in this epoch); epoch 3: c only (a, b are 3 old)
    assert [memory.usable_at(e) for e in (0, 1, 2, 3, 4)] == [0, 2, 3, 1, 0]
    assert sp.ScoreMemory(100, max_age=None).usable_at(5) == 0


def test_training_losses_that_replace_one_from_the_same_epoch_are_counted_as_repeated():
    memory = sp.ScoreMemory(capacity=100, max_age=None)
    memory.update_keys(["a", "b"], np.array([1.0, 2.0]), 0, FEEDBACK)
    memory.update_keys(["c", "c", "d"], np.array([1.0, 2.0, 3.0]), 0, FEEDBACK)  # twice in one batch
    assert memory.repeated == 1
    memory.update_keys(["a", "d"], np.array([5.0, 6.0]), 0, FEEDBACK)  # again in the same epoch
    assert memory.repeated == 3
    memory.update_keys(["a", "b"], np.array([5.0, 6.0]), 1, FEEDBACK)  # the next epoch: not repeats
    memory.update_keys(["e"], np.array([1.0]), 1, FORWARD)  # a scoring forward, then its training
    memory.update_keys(["e"], np.array([1.5]), 1, FEEDBACK)  # step: one sample, not a repeat
    index = np.arange(5, dtype=np.int64)
    memory.update_keys(index, np.ones(5), 1, FEEDBACK)
    memory.update_keys(index[:2], np.ones(2), 1, FEEDBACK)  # integer keys through the cache
    assert memory.repeated == 5
    copy = sp.ScoreMemory(capacity=100, max_age=None)
    copy.load_state_dict(roundtrip(memory.state_dict()))
    assert copy.repeated == 5
    older = {k: v for k, v in memory.state_dict().items() if k != "repeated"}
    copy.load_state_dict(older)  # a state written before the count loads with none
    assert copy.repeated == 0


def test_deferred_losses_are_applied_in_order_before_any_read_and_nothing_is_lost():
    """defer_keys (what Sifter.observe uses) applies its losses at the next read: the memory then
    answers exactly as one fed update_keys call by call."""
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(60):
        n = int(rng.integers(1, 20))
        keys = rng.integers(0, 50, size=n)
        form = rng.integers(0, 3)
        keys = keys if form == 0 else keys.tolist() if form == 1 else [str(k) for k in keys.tolist()]
        losses = rng.exponential(size=n).astype(np.float32)
        losses[rng.random(n) < 0.1] = np.nan
        steps.append((keys, losses, int(rng.integers(0, 4)), FEEDBACK if rng.random() < 0.8 else FORWARD))
    direct, deferred = sp.ScoreMemory(200, max_age=None), sp.ScoreMemory(200, max_age=None)
    probe = key_hashes(range(50))
    for i, (keys, losses, epoch, source) in enumerate(steps):
        direct.update_keys(keys, losses, epoch, source)
        buffer = np.array(losses)
        deferred.defer_keys(np.asarray(keys) if isinstance(keys, np.ndarray) else keys, buffer, epoch, source)
        buffer[:] = 99.0  # the caller reuses its buffer: what was handed over is a copy
        if i % 7 == 6:  # a read now and then: everything so far is applied first
            for a, b in zip(direct.lookup(probe, 5), deferred.lookup(probe, 5)):
                np.testing.assert_array_equal(a, b)
    assert len(deferred) == len(direct) and deferred.repeated == direct.repeated
    assert deferred.mean() == pytest.approx(direct.mean())
    assert deferred.forgetting() == direct.forgetting()
    for name in ("keys", "loss", "epoch", "source"):
        assert torch.equal(deferred.state_dict()[name], direct.state_dict()[name])


@pytest.mark.parametrize("repeat", [False, True])
def test_the_forgetting_evidence_does_not_depend_on_how_deferred_losses_are_grouped(repeat):
    """Losses handed over one by one and applied together, one by one, or cut anywhere by a
    read (a checkpoint, len()) leave the same memory and the same forgetting figure, also when a
    key comes twice in one epoch (``repeat``): a checkpoint must not change later decisions."""
    rng = np.random.default_rng(5)
    n = 400
    keys = np.arange(n)
    base = rng.exponential(1.0, n).astype(np.float32)
    steps = [(keys, base, 0), (keys[1::2], base[1::2] * 0.9, 1)]
    for part in np.array_split(rng.permutation(n), 8):  # epoch 2 in 8 training steps
        steps.append((part, base[part] * rng.uniform(0.3, 1.2, part.size).astype(np.float32), 2))
    if repeat:
        again = steps[3][0][:10]
        steps.insert(6, (again, base[again] * 2.0, 2))  # those keys trained twice in epoch 2
    results = []
    for cut_every in (None, 1, 2, 3, 5):
        memory = sp.ScoreMemory(1000, max_age=None)
        for i, (k, losses, epoch) in enumerate(steps):
            memory.defer_keys(k, losses, epoch, FEEDBACK)
            if cut_every and i % cut_every == 0:
                memory.state_dict() if i % 2 else len(memory)  # reads apply what waits
        state = memory.state_dict()
        results.append(
            (memory.forgetting(), memory.repeated, state["drift"], state["drift_mean"], state["hard"])
        )
    first = results[0]
    assert first[0] is not None and (first[1] == 10) == repeat and first[4].sum() > 0
    for other in results[1:]:
        assert other[0] == first[0] and other[1] == first[1]
        assert torch.equal(other[2], first[2]) and other[3] == first[3]
        assert torch.equal(other[4], first[4])  # the persistent-hard evidence too


def test_deferred_losses_reach_the_state_files_and_a_full_buffer_applies_itself(tmp_path):
    memory = sp.ScoreMemory(100, max_age=None)
    memory.defer_keys(np.arange(5), np.ones(5), 0, FEEDBACK)
    assert memory._deferred  # waiting
    assert int(memory.state_dict()["keys"].numel()) == 5 and not memory._deferred
    memory.defer_keys(["a"], np.ones(1), 0, FEEDBACK)
    memory.save(str(tmp_path / "m.npz"))
    assert len(sp.ScoreMemory.load(str(tmp_path / "m.npz"))) == 6
    small = sp.ScoreMemory(100, max_age=None)
    small.DEFER_ROWS = 8
    small.defer_keys(np.arange(5), np.ones(5), 0, FEEDBACK)
    small.defer_keys(np.arange(5, 10), np.ones(5), 0, FEEDBACK)
    assert not small._deferred and small._count == 10  # applied without a read


def test_a_failing_flush_keeps_what_it_could_not_apply():
    memory = sp.ScoreMemory(100, max_age=None)

    class Unnamable:
        def __str__(self):
            raise RuntimeError("no name")

    memory.defer_keys(["a", "b"], np.ones(2), 0, FEEDBACK)
    memory.defer_keys([Unnamable()], np.ones(1), 1, FEEDBACK)
    memory.defer_keys(["c"], np.ones(1), 2, FEEDBACK)
    with pytest.raises(RuntimeError, match="no name"):
        len(memory)
    assert memory._count == 2 and [d[2] for d in memory._deferred] == [2]  # "c" still waits
    assert len(memory) == 3
    # in one run of one epoch (applied as one update): the good hand-overs around the bad one
    # are applied or wait, only the bad one is dropped
    memory.defer_keys(["d"], np.ones(1), 3, FEEDBACK)
    memory.defer_keys([Unnamable()], np.ones(1), 3, FEEDBACK)
    memory.defer_keys(["e"], np.ones(1), 3, FEEDBACK)
    with pytest.raises(RuntimeError, match="no name"):
        memory.mean()
    assert memory._count == 4 and [d[0] for d in memory._deferred] == [["e"]]
    assert len(memory) == 5 and not memory._deferred


def test_spread_is_the_mean_shortfall_below_the_mean_in_mean_losses():
    memory = sp.ScoreMemory(capacity=100, max_age=None)
    assert memory.spread() is None  # empty
    memory.update_keys(["a", "b", "c", "d"], np.array([0.0, 0.0, 0.0, 4.0]), 0, FEEDBACK)
    assert memory.spread() == pytest.approx(0.75)  # mean 1: three sit 1 below it, one above
    flat = sp.ScoreMemory(capacity=100, max_age=None)
    flat.update_keys(list("abcd"), np.full(4, 2.5), 0, FEEDBACK)
    assert flat.spread() == 0.0
    zero = sp.ScoreMemory(capacity=100, max_age=None)
    zero.update_keys(list("abcd"), np.zeros(4), 0, FEEDBACK)
    assert zero.spread() is None  # no mean to measure against
    rng = np.random.default_rng(0)
    big = sp.ScoreMemory(capacity=20_000, max_age=None)
    big.update_keys(np.arange(20_000), rng.exponential(size=20_000), 0, FEEDBACK)
    assert big.spread() == pytest.approx(np.exp(-1), abs=0.01)  # exponential losses: 1/e


def test_spread_is_measured_again_after_a_quarter_of_the_memory_and_resumes_to_the_same_bits():
    rng = np.random.default_rng(1)
    memory = sp.ScoreMemory(capacity=1000, max_age=None)
    memory.update_keys(np.arange(800), rng.exponential(size=800), 0, FEEDBACK)
    first = memory.measure_spread()
    memory.update_keys(np.arange(100), np.full(100, 50.0), 1, FEEDBACK)  # 100 < 800 / 4: not yet
    assert memory.measure_spread() == first and memory.measured_spread == first
    twin = sp.ScoreMemory(capacity=1000, max_age=None)
    twin.load_state_dict(roundtrip(memory.state_dict()))  # keys land in other slots
    for m in (memory, twin):
        m.update_keys(np.arange(100, 200), np.full(100, 50.0), 1, FEEDBACK)  # 200 since: measured
    assert memory.measure_spread() != first
    assert twin.measure_spread() == memory.measure_spread()  # the same bits, wherever the losses sit
    # a state written before the measure loads and measures at its next read
    older = {k: v for k, v in memory.state_dict().items() if k not in ("applied", "spread", "spread_at")}
    old = sp.ScoreMemory(capacity=1000, max_age=None)
    old.load_state_dict(older)
    assert old.measured_spread is None and old.measure_spread() == memory.measure_spread()


def test_reading_the_spread_changes_nothing_the_recipe_decides():
    """A user logging sifter.memory.spread() after each step moved the points the spread floor
    was measured at, so sp.recipe pruned other samples than in the same run unwatched (found by
    review, 2026-12-05). Reads measure apart from the policy now; they still see the memory as
    it is (measured again after a quarter of its size of losses)."""

    def run(watch: bool):
        def losses(keys, epoch):
            learned = (keys % 20) < 2 + 3 * epoch
            return torch.tensor(np.where(learned & (epoch > 0), 0.2, 1.0) + 0.01 * (keys % 7))

        stage = sp.recipe(None, "cross_entropy", budget=4000, batched=True, output_batch=25,
                          seed=0, cost_guard=False)  # fmt: skip
        trained, seen = [], []
        for epoch in range(4):
            stage.set_epoch(epoch)
            order = np.random.default_rng(epoch).permutation(1000)
            batches = [{"__key__": torch.from_numpy(order[i : i + 100])} for i in range(0, 1000, 100)]
            for batch in stage(batches):
                keys = batch["__key__"].numpy()
                trained.append(keys.tolist())
                stage.observe(batch["__key__"], losses(keys, epoch))
                if watch:
                    seen.append(stage.memory.spread())
        return trained, seen

    alone, _ = run(False)
    watched, seen = run(True)
    assert watched == alone
    assert len(set(seen)) > 3  # the reads follow the losses


def test_deferred_integer_keys_of_both_signs_are_joined_as_the_same_keys():
    # int64 and uint64 arrays concatenate to float64, whose 1 is the key "1.0": they stay ints
    memory = sp.ScoreMemory(100)
    memory.defer_keys(np.array([1, 2], dtype=np.int64), np.array([0.5, 1.5]), 0, FEEDBACK)
    memory.defer_keys(np.array([3], dtype=np.uint64), np.array([2.5]), 0, FEEDBACK)
    assert memory.lookup_keys(["1", "2", "3"], 1)[0].tolist() == [0.5, 1.5, 2.5]


def test_a_memory_loaded_for_lookups_is_sized_to_what_it_holds_and_answers_alike(tmp_path):
    """Every PreDecodeFilter worker loads each publication: a memory saved with a capacity of
    millions and holding a few losses took its full table (about 1 GiB at 50M) in each worker."""
    memory = sp.ScoreMemory(2_000_000, max_age=None)
    keys = [f"k{i}" for i in range(1000)]
    memory.update_keys(keys, np.arange(1000, dtype=np.float32), 0, FEEDBACK)
    memory.save(str(tmp_path / "m.npz"))
    small = sp.ScoreMemory.load(str(tmp_path / "m.npz"), lookups_only=True)
    full = sp.ScoreMemory.load(str(tmp_path / "m.npz"))
    assert full.capacity == 2_000_000 and small.nbytes * 100 < full.nbytes
    probe = key_hashes([*keys, "unknown"])
    for a, b in zip(small.lookup(probe, 1), full.lookup(probe, 1)):
        np.testing.assert_array_equal(a, b)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    np.save(tmp_path / "other.npy", np.zeros(3))
    whole = (tmp_path / "m.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])
    for name in ("other.npz", "other.npy", "cut.npz"):
        with pytest.raises(sp.ConfigError, match="not a score memory file"):
            sp.ScoreMemory.load(str(tmp_path / name))


def test_a_loaded_memory_judges_its_next_epoch_against_the_whole_tables_mean(tmp_path):
    """Loading refills the table through updates, which moved the forgetting evidence: a loaded
    memory went on judging "easy" against the mean of part of its table, at the epoch the fill
    ended on (found by review). The file holds no evidence: a loaded memory starts with none."""
    rng = np.random.default_rng(9)
    hashes = key_hashes(range(400))
    memory = sp.ScoreMemory(1000, max_age=None)
    memory.update(hashes[:200], rng.exponential(size=200), 0, FEEDBACK)
    memory.update(hashes[200:], 3 * rng.exponential(size=200), 3, FEEDBACK)
    memory.save(str(tmp_path / "m.npz"))
    loaded = sp.ScoreMemory.load(str(tmp_path / "m.npz"))
    assert loaded.forgetting() is None
    whole = loaded.mean()
    # training goes on in the epoch the file's newest losses came from (a resume inside it)
    loaded.update(hashes[:10], np.ones(10), 3, FEEDBACK)
    assert loaded._drift_epoch == 3 and loaded._drift_mean[0] == whole


# ---------------------------------------------------------------------- shared across ranks


def _table(memory):
    """Every entry a memory holds, as {hash: (loss, epoch, source)}."""
    state = memory.state_dict()
    keys = state["keys"].numpy().view(np.uint64).tolist()
    rows = zip(state["loss"].tolist(), state["epoch"].tolist(), state["source"].tolist())
    return dict(zip(keys, rows))


def test_changes_hands_on_own_entries_once_and_never_what_merge_brought():
    memory = sp.ScoreMemory(100, max_age=None)
    memory.update_keys(["a", "b"], np.array([1.0, 2.0]), 0, FEEDBACK)
    hashes, losses, epochs, sources = memory.changes()
    assert sorted(hashes.tolist()) == sorted(key_hashes(["a", "b"]).tolist())
    memory.mark_synced()
    assert memory.changes()[0].size == 0
    memory.merge(key_hashes(["c"]), np.array([3.0]), np.array([0]), np.array([FEEDBACK]))
    assert memory.changes()[0].size == 0  # what another rank sent is not sent back
    # the fast path (cached keys, all held) marks its entries too
    memory.update_keys(["a", "b"], np.array([5.0, 6.0]), 1, FEEDBACK)
    assert sorted(memory.changes()[1].tolist()) == [5.0, 6.0]


def test_an_entry_stored_while_the_ranks_exchange_is_sent_next_time():
    """A loss-logging thread storing while sync_memory gathered (between ``changes`` and
    ``mark_synced``): marked sent and never sent, the other ranks never got it (found by review,
    2026-12-06). So is a key stored again in that window, with its new loss."""
    memory = sp.ScoreMemory(100, max_age=None)
    memory.update_keys(["a", "b"], np.array([1.0, 2.0]), 0, FEEDBACK)
    assert memory.unsynced() == 2 and memory.unsynced() == 2  # (counting marks nothing)
    sent = memory.changes()
    memory.update_keys(["late"], np.array([5.0]), 0, FEEDBACK)  # in the window
    memory.update_keys(["b"], np.array([7.0]), 0, FEEDBACK)  # stored again in the window
    memory.mark_synced()
    assert sorted(sent[0].tolist()) == sorted(key_hashes(["a", "b"]).tolist())
    hashes, losses, _, _ = memory.changes()
    assert dict(zip(hashes.tolist(), losses.tolist(), strict=True)) == dict(
        zip(key_hashes(["late", "b"]).tolist(), [5.0, 7.0], strict=True)
    )
    memory.mark_synced()
    assert memory.changes()[0].size == 0
    # an exchange that failed after changes() (no mark_synced): all of it is sent next time
    memory.update_keys(["c"], np.array([3.0]), 0, FEEDBACK)
    memory.changes()
    assert memory.changes()[0].tolist() == key_hashes(["c"]).tolist()
    assert resumed_unsynced(memory) == key_hashes(["c"]).tolist()


def resumed_unsynced(memory):
    """What a memory resumed from ``memory``'s state would send."""
    resumed = sp.ScoreMemory(100, max_age=None)
    resumed.load_state_dict(roundtrip(memory.state_dict()))
    return resumed.changes()[0].tolist()


def test_merge_keeps_the_newer_entry_and_resolves_ties_the_same_way_on_every_rank():
    keys = ["old", "new", "fwd", "tie", "only_b"]
    a, b = sp.ScoreMemory(100, max_age=None), sp.ScoreMemory(100, max_age=None)
    a.update_keys(["old", "new", "tie"], np.array([1.0, 1.0, 1.0]), 2, FEEDBACK)
    a.update_keys(["fwd"], np.array([9.0]), 3, FORWARD)
    b.update_keys(["old"], np.array([7.0]), 1, FEEDBACK)  # older than a's: a's stays
    b.update_keys(["new", "fwd"], np.array([4.0, 0.5]), 3, FEEDBACK)  # newer; feedback over forward
    b.update_keys(["tie", "only_b"], np.array([3.0, 2.5]), 2, FEEDBACK)  # same epoch: larger loss
    sent_a, sent_b = a.changes(), b.changes()
    # a takes b's newer or better entries of new, fwd, tie and only_b; b takes a's newer "old"
    assert a.merge(*sent_b) == 4 and b.merge(*sent_a) == 1
    assert _table(a) == _table(b)
    loss = dict(zip(keys, a.lookup(key_hashes(keys), 4)[0].tolist()))
    assert loss == {"old": 1.0, "new": 4.0, "fwd": 0.5, "tie": 3.0, "only_b": 2.5}
    assert a.mean() == pytest.approx(np.mean([1.0, 4.0, 0.5, 3.0, 2.5]))
    # the same entries merged in the other order, or twice, end the same
    c = sp.ScoreMemory(100, max_age=None)
    c.merge(*sent_b)
    c.merge(*sent_a)
    c.merge(*sent_b)
    assert _table(c) == _table(a)


def test_merge_beyond_capacity_refuses_and_counts_new_keys_but_updates_held_ones():
    memory = sp.ScoreMemory(capacity=10, max_age=None)
    memory.update_keys([f"k{i}" for i in range(8)], np.ones(8), 0, FEEDBACK)
    incoming = [f"k{i}" for i in range(4, 14)]  # 4 held, 6 new: room for 2
    stored = memory.merge(key_hashes(incoming), np.full(10, 3.0), np.ones(10), np.full(10, FEEDBACK))
    assert stored == 6 and len(memory) == 10 and memory.refused == 4
    assert (memory.lookup(key_hashes(["k4", "k7"]), 2)[0] == 3.0).all()
    with pytest.raises(sp.ConfigError, match="as many losses"):
        memory.merge(key_hashes(["x"]), np.ones(2), np.ones(1), np.ones(1))


def test_which_entries_are_still_to_send_survives_a_checkpoint():
    memory = sp.ScoreMemory(100, max_age=None)
    memory.update_keys(["a"], np.array([1.0]), 0, FEEDBACK)
    memory.changes()
    memory.mark_synced()
    memory.merge(key_hashes(["m"]), np.array([2.0]), np.array([0]), np.array([FEEDBACK]))
    memory.update_keys(["b"], np.array([3.0]), 1, FEEDBACK)
    resumed = sp.ScoreMemory(100, max_age=None)
    resumed.load_state_dict(roundtrip(memory.state_dict()))
    assert resumed.changes()[0].tolist() == key_hashes(["b"]).tolist()
    # a state written before sync_memory: nothing of it was ever sent (found by review: only the
    # latest epoch's entries were, so losses of samples pruned before never reached other ranks)
    old = roundtrip(memory.state_dict())
    del old["unsynced"], old["merged"]
    resumed = sp.ScoreMemory(100, max_age=None)
    resumed.load_state_dict(old)
    assert sorted(resumed.changes()[0].tolist()) == sorted(key_hashes(["a", "m", "b"]).tolist())
    # a damaged mask is refused before anything changes
    bad = roundtrip(memory.state_dict())
    bad["unsynced"] = bad["unsynced"][:1]
    with pytest.raises(sp.ResumeError, match="tensors of one length"):
        resumed.load_state_dict(bad)
    assert len(resumed) == 3


def test_merge_ties_on_every_field_and_a_later_epoch_of_another_rank_is_usable_now():
    # found by review: ties of source and of 0.0 against -0.0 kept each rank's own entry; and
    # an entry from a rank in a later epoch (HF passes do not end together) replaced a usable
    # loss by one this rank could not use in its current pass
    k = key_hashes(["k"])
    for mine, theirs in (((1.0, FORWARD), (1.0, 3)), ((0.0, FEEDBACK), (-0.0, FEEDBACK))):
        a, b = sp.ScoreMemory(10, max_age=None), sp.ScoreMemory(10, max_age=None)
        a.update(k, np.array([mine[0]]), 2, mine[1])
        b.update(k, np.array([theirs[0]]), 2, theirs[1])
        sent_a, sent_b = a.changes(), b.changes()
        a.merge(*sent_b)
        b.merge(*sent_a)
        assert _table(a) == _table(b)
    b = sp.ScoreMemory(10, max_age=None)
    b.update(k, np.array([0.5]), 9, FEEDBACK)
    assert b.lookup(k, 10)[0].tolist() == [0.5]
    b.merge(k, np.array([0.25]), np.array([11]), np.array([FEEDBACK]), now=10)
    assert b.lookup(k, 10)[0].tolist() == [0.25]  # usable in this rank's current pass
    b.merge(k, np.array([0.75]), np.array([10]), np.array([FEEDBACK]), now=10)
    assert np.isnan(b.lookup(k, 10)[0][0]) and b.lookup(k, 11)[0].tolist() == [0.75]


def test_a_merged_loss_trained_here_in_the_same_epoch_is_not_a_repeat():
    # found by review: another rank's entry for a key, then this rank training it in the same
    # epoch (a padding duplicate, a mid-epoch sync), counted as a key repeated in the epoch
    memory = sp.ScoreMemory(10, max_age=None)
    memory.merge(key_hashes(["k"]), np.array([2.0]), np.array([3]), np.array([FEEDBACK]))
    memory.update_keys(["k"], np.array([1.0]), 3, FEEDBACK)
    assert memory.repeated == 0
    memory.update_keys(["k"], np.array([1.5]), 3, FEEDBACK)  # this rank's own, twice: a repeat
    assert memory.repeated == 1


def _ten():
    memory = sp.ScoreMemory(capacity=100, max_age=None)
    memory.update_keys([str(i) for i in range(10)], np.arange(1, 11, dtype=np.float32), 0, FEEDBACK)
    return memory


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda s: s.update(loss=s["loss"][:5]), "one length"),
        (lambda s: s.update(epoch=s["epoch"][:5]), "one length"),
        (lambda s: s.update(loss=torch.full_like(s["loss"], float("nan"))), "finite losses"),
        (lambda s: s.update(keys=torch.zeros_like(s["keys"])), "distinct non-zero"),
        (lambda s: s.update(keys=torch.full_like(s["keys"], 1234)), "distinct non-zero"),
        (lambda s: s.update(keys=s["keys"].int()), r"state\['keys'\] must be a 1-d torch.int64"),
        (lambda s: s.update(loss=s["loss"].numpy()), r"state\['loss'\] must be a 1-d torch.float32"),
        (lambda s: s.pop("refused"), r"state\['refused'\]"),
        # an int16 epoch no memory records: refused up front, where it half-loaded the table and
        # raised a ConfigError from inside (found by review, 2026-12-05)
        (lambda s: s["epoch"].__setitem__(9, -32768), r"state\['epoch'\] must be epochs within"),
    ],
)
def test_a_damaged_state_is_refused_by_name_and_the_memory_is_left_as_it_was(damage, says):
    # before: IndexErrors, AttributeErrors, or a silently emptied memory
    memory = _ten()
    state = dict(_ten().state_dict())
    damage(state)
    with pytest.raises(sp.ResumeError, match=says):
        memory.load_state_dict(state)
    assert len(memory) == 10 and memory.mean() == 5.5


def test_a_state_of_another_max_age_is_refused_unless_fitted():
    old = sp.ScoreMemory(100, max_age=None)
    old.update_keys(["a"], np.array([1.0], np.float32), 0, FEEDBACK)
    with pytest.raises(sp.ResumeError, match="max_age=None.*this one for 1"):
        sp.ScoreMemory(100, max_age=1).load_state_dict(old.state_dict())
    fitted = sp.ScoreMemory(100, max_age=1)
    fitted.load_state_dict(old.state_dict(), fit=True)
    assert len(fitted) == 1


def test_a_state_fitted_into_a_smaller_memory_keeps_the_freshest_losses():
    big = sp.ScoreMemory(capacity=200, max_age=1)
    big.update_keys([f"old{i}" for i in range(100)], np.ones(100, np.float32), 0, FEEDBACK)
    big.update_keys([f"new{i}" for i in range(100)], np.full(100, 2.0, np.float32), 5, FEEDBACK)
    small = sp.ScoreMemory(capacity=100, max_age=1)
    small.load_state_dict(big.state_dict(), fit=True)
    # before: the 100 epoch-0 losses were held (already expired) and the epoch-5 ones refused
    loss, _ = small.lookup_keys([f"new{i}" for i in range(100)], 6)
    assert len(small) == 100 and small.refused == 100 and (loss == 2.0).all()


def test_a_damaged_memory_file_is_a_config_error(tmp_path):
    import io

    url = str(tmp_path / "memory.npz")
    _ten().save(url)
    arrays = dict(np.load(url))
    arrays["keys"] = np.zeros_like(arrays["keys"])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (tmp_path / "bad.npz").write_bytes(buffer.getvalue())
    with pytest.raises(sp.ConfigError, match="damaged: it holds an empty-slot or repeated key"):
        sp.ScoreMemory.load(str(tmp_path / "bad.npz"))
    assert len(sp.ScoreMemory.load(url)) == 10


@pytest.mark.parametrize("batched", [False, True], ids=["per_sample", "batched"])
def test_a_key_given_as_a_one_element_tensor_is_its_columns_row(batched):
    # found by review: a sample key tensor([i]) was looked up as the text "tensor([5])" while the
    # (B, 1) column observe() got was stored as "[5]": nothing was ever found, nothing sifted.
    # Now it is "[5]" too, as the batched mode has always read a (B, 1) column's rows (so
    # memories and logs written before keep their keys)
    assert key_hashes([torch.tensor([5]), np.array([5]), [5]]).tolist() == [int(key_hashes(["[5]"])[0])] * 3
    n = 64
    samples = [{"__key__": torch.tensor([i]), "x": torch.zeros(2), "y": i % 2} for i in range(n)]
    if batched:
        samples = [torch.utils.data.default_collate(samples[i : i + 16]) for i in range(0, n, 16)]
    stage = sp.recipe(
        None, "cross_entropy", budget=10 * n, micro_batch=16, output_batch=8, seed=0, min_spread=None,
        batched=batched, cost_guard=False,
    )  # fmt: skip
    for epoch in range(3):
        stage.set_epoch(epoch)
        for batch in stage(samples):
            rows, width = batch["__key__"].shape
            assert width == 1
            stage.observe(batch["__key__"], torch.rand(rows))
    assert stage.stats.unknown == n and stage.stats.from_memory == 2 * n  # the first epoch only unknown


def test_a_key_given_as_a_0d_tensor_is_its_value():
    # before: str(tensor(5)) was the key "tensor(5)", which the batch's tensor of keys never named
    assert (
        key_hashes([torch.tensor(5), torch.tensor(5, dtype=torch.int32), np.int64(5), 5, "5"]).tolist()
        == [int(key_hashes(["5"])[0])] * 5
    )
    n = 64
    samples = [{"__key__": torch.tensor(i), "x": torch.zeros(2), "y": i % 2} for i in range(n)]
    stage = sp.recipe(None, "cross_entropy", budget=10 * n, micro_batch=16, seed=0, min_spread=None)
    losses = np.random.default_rng(0).exponential(size=n)
    for epoch in range(3):
        stage.set_epoch(epoch)
        for sample in stage(samples):
            stage.observe([sample["__key__"]], np.array([losses[int(sample["__key__"])]]))
    assert stage.stats.unknown == n  # the first epoch only


def test_a_full_memory_takes_new_keys_in_the_order_they_came_however_updates_are_grouped():
    """Deferred losses are applied together at the next read: a full memory took the new keys of
    one such batch in hash order, so a checkpoint's read (state_dict) between two hand-overs
    changed which samples it kept, and the decisions of later epochs (found by review,
    2026-12-05). Now the first to come are taken, and refused and repeated count the same."""
    keys = [f"k{i}" for i in range(50)]
    order = np.argsort(key_hashes(keys))
    a, b, c = (keys[i] for i in order[[40, 0, 1]])  # a hashes above b and c

    def fill(read_between):
        memory = sp.ScoreMemory(2, max_age=None)
        memory.defer_keys([a], np.array([1.0]), 0, FEEDBACK)  # a came first
        if read_between:
            memory.state_dict()
        memory.defer_keys([b, c], np.array([2.0, 3.0]), 0, FEEDBACK)
        return memory.lookup_keys([a, b, c], 1)[0].tolist(), memory.refused

    for read_between in (False, True):
        held, refused = fill(read_between)
        assert held[:2] == [1.0, 2.0] and np.isnan(held[2]) and refused == 1, read_between

    def run(seed, mode, capacity=120):
        rng = np.random.default_rng(seed)
        memory = sp.ScoreMemory(capacity, max_age=None)
        epoch = 0
        for step in range(120):
            epoch += step % 30 == 29
            picked = rng.integers(0, 300, size=int(rng.integers(1, 20)))
            losses = rng.exponential(1.0, size=picked.size).astype(np.float32)
            memory.defer_keys([f"k{x}" for x in picked], losses, epoch, FEEDBACK)
            if mode == "eager":
                memory.flush()
            elif mode == "checkpoint" and step % 17 == 16:
                again = sp.ScoreMemory(capacity, max_age=None)
                again.load_state_dict(memory.state_dict())
                memory = again
        state = memory.state_dict()
        held = dict(zip(state["keys"].numpy().tolist(), state["loss"].numpy().tolist()))
        return held, memory.refused, memory.repeated, len(memory)

    for seed in range(6):
        lazy = run(seed, "lazy")
        assert lazy[1] > 0 and lazy[3] == 120  # it filled up
        assert run(seed, "eager") == lazy == run(seed, "checkpoint"), seed


def test_a_loss_handed_over_two_epochs_late_leaves_the_forgetting_evidence_as_it_was():
    """One training loss tagged two epochs back (Sifter.observe(..., epoch=e - 2) is accepted)
    moved the forgetting window back to that epoch: the next loss of this epoch began it again
    mid-pass, and the evidence the guard reads was lost (found by review, 2026-12-05)."""
    keys = [f"k{i}" for i in range(400)]

    def losses(seed):
        return np.random.default_rng(seed).exponential(1.0, 400).astype(np.float32)

    def run(stray):
        memory = sp.ScoreMemory(1000, max_age=None)
        memory.update_keys(keys, losses(0), 0, FEEDBACK)  # epoch 0: every sample trained
        memory.update_keys(keys[:200], losses(1)[:200], 1, FEEDBACK)  # epoch 1: half skipped
        memory.update_keys(keys[:100], losses(2)[:100], 2, FEEDBACK)
        if stray:
            memory.update_keys(["late"], np.array([1.0], np.float32), 0, FEEDBACK)
        memory.update_keys(keys[100:], losses(3)[100:], 2, FEEDBACK)
        state = memory.state_dict()
        return memory.forgetting(), memory.persistent_hard(), state["drift_epoch"], state["drift"].tolist()

    late, plain = run(True), run(False)
    assert late[1:] == plain[1:]  # the evidence and its epoch as they were
    # (the forgetting figure is in units of the mean remembered loss, which the late loss joins)
    assert plain[0] is not None and late[0] == pytest.approx(plain[0], rel=1e-3)


def test_keys_that_are_not_one_per_loss_are_refused_before_anything_is_stored():
    """A (B, 1) array of integer keys was stored, then broke the key cache with a numpy error,
    and a deferred hand-over retried applied it twice; keys and losses of different counts were
    a numpy IndexError, or, deferred, dropped at the next read (found by review, 2026-12-05)."""
    memory = sp.ScoreMemory(100, max_age=None)
    with pytest.raises(sp.ConfigError, match=r"shape \(2, 1\).*ravel"):
        memory.update_keys(np.array([[1], [2]]), np.array([1.0, 2.0]), 0, FEEDBACK)
    with pytest.raises(sp.ConfigError, match=r"shape \(2, 1\)"):
        memory.defer_keys(np.array([[1], [2]]), np.array([1.0, 2.0]), 0, FEEDBACK)
    for keys, losses in ((["a", "b"], [1.0, 2.0, 3.0]), (["a", "b", "c"], [1.0, 2.0])):
        with pytest.raises(sp.ConfigError, match=f"{len(keys)} keys for {len(losses)} losses"):
            memory.update_keys(keys, np.array(losses), 0, FEEDBACK)
        with pytest.raises(sp.ConfigError, match=f"{len(keys)} keys for {len(losses)} losses"):
            memory.defer_keys(keys, np.array(losses), 0, FEEDBACK)
    assert len(memory) == 0 and memory.repeated == 0 and memory.refused == 0
    memory.update_keys(np.array([1, 2]), np.array([1.0, 2.0]), 0, FEEDBACK)  # 1-d: taken
    assert len(memory) == 2


def test_a_memory_used_from_several_threads_loses_and_mixes_up_nothing():
    """Two sifters sharing a memory in two threads (a train and an auxiliary stream), or a
    loss-logging thread calling ``observe``: two inserts claimed one empty slot, a key held
    another's loss or none while ``len`` counted it (found by review, 2026-12-06). Each thread
    stores its own new keys, directly, deferred and read back, at a tiny switch interval."""
    memory = sp.ScoreMemory(200_000, max_age=None)
    threads_n, batches, rows = 4, 200, 64

    def work(t):
        for b in range(batches):
            keys = [f"t{t}-{b}-{i}" for i in range(rows)]
            losses = np.full(rows, t * 1000 + b, dtype=np.float64) + np.arange(rows) / 100
            if b % 2:
                memory.defer_keys(keys, losses, 0, FEEDBACK)
            else:
                memory.update_keys(keys, losses, 0, FORWARD)
            memory.lookup_keys(keys[:8], 1)

    errors = race(*[lambda t=t: work(t) for t in range(threads_n)])
    assert not errors, errors
    keys = [f"t{t}-{b}-{i}" for t in range(threads_n) for b in range(batches) for i in range(rows)]
    want = np.array(
        [t * 1000 + b + i / 100 for t in range(threads_n) for b in range(batches) for i in range(rows)]
    )
    got, _ = memory.lookup_keys(keys, 1)
    assert len(memory) == len(keys)
    assert np.array_equal(got, want.astype(np.float32)), int((got != want.astype(np.float32)).sum())


def test_a_storage_failure_saving_or_publishing_names_the_file_and_leaves_no_orphan(
    tmp_path, local_s3, bucket
):
    """A full disk under save()/publish(): a bare "OSError [Errno 28]" naming neither the file nor
    the fix (or, for a permission, only a hidden temporary file); and a publication whose
    latest.json failed left its .npz behind for good, keep= never pruning it (found by review,
    2026-12-06). Broken for real: a file-size limit (EFBIG: a write the OS refuses, as ENOSPC),
    and S3 behind a proxy that refuses latest.json."""
    import os
    import resource
    import signal

    from tests.faults import FaultProxy

    memory = sp.ScoreMemory(10_000)
    memory.update_keys([f"k{i}" for i in range(5000)], np.random.default_rng(0).random(5000), 0, FEEDBACK)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(
            sp.SiftError, match=r"saving the score memory to .*mem\.npz failed: File too large"
        ):
            memory.save(str(tmp_path / "mem.npz"))
        with pytest.raises(
            sp.SiftError, match=r"publishing the score memory to .*pub failed: File too large"
        ):
            memory.publish(str(tmp_path / "pub"), epoch=0, seed=1, beta=1.0, retry_timeout=0)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)
    assert not [n for n in os.listdir(tmp_path) if not n.startswith("pub")]  # no temporary file left
    proxy = FaultProxy(local_s3.port)
    try:
        options = {"endpoint_url": proxy.endpoint, "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        url = f"s3://{bucket}/pub"
        proxy.fail("status", 503, times=1_000, method="PUT", path="/latest.json")
        with pytest.raises(sp.SiftError, match=r"latest\.json to .*pub failed"):
            memory.publish(url, epoch=0, seed=1, beta=1.0, keep=1, storage_options=options, retry_timeout=0)
        fs = local_s3.fs()
        assert not fs.exists(f"{bucket}/pub") or not fs.ls(f"{bucket}/pub")  # its .npz deleted
        with proxy.lock:
            proxy.plan.clear()
        # the store took latest.json and its answer was lost (the connection cut): latest.json
        # names this publication, whose file must stay (the review of the fix deleted it, and
        # every worker reading the publication stopped)
        proxy.fail("lost", 0, times=1_000, method="PUT", path="/latest.json")
        with pytest.raises(sp.SiftError, match=r"latest\.json to .*pub failed"):
            memory.publish(url, epoch=5, seed=1, beta=1.0, keep=1, storage_options=options, retry_timeout=0)
        with proxy.lock:
            proxy.plan.clear()
        latest = json.loads(fs.cat_file(f"{bucket}/pub/latest.json"))
        assert latest["epoch"] == 5 and len(sp.ScoreMemory.load(f"{url}/{latest['file']}", options)) == 5000
        for epoch in (1, 2):
            memory.publish(
                url, epoch=epoch, seed=1, beta=1.0, keep=1, storage_options=options, retry_timeout=0
            )
        assert len([n for n in fs.ls(f"{bucket}/pub", refresh=True) if n.endswith(".npz")]) == 1
    finally:
        proxy.stop()


def test_a_memory_that_fills_up_on_one_rank_says_so_once():
    """A memory sized below the samples of a pass (or filled by validation batches handed to
    observe()): the samples it turned away were kept unknown every pass, never sifted, with
    nothing said on one rank (found by review, 2026-12-06; the ranks' sync warned)."""
    import warnings

    n = 1000
    losses = np.random.default_rng(0).exponential(size=n)
    samples = [{"__key__": f"k{i}", "loss": float(losses[i])} for i in range(n)]
    stage = sp.Sifter(
        None, lambda m, b: b["loss"].double(), sp.RelativeProbabilistic(1.0, 200), micro_batch=50,
        memory=sp.ScoreMemory(800, max_age=None), seed=0,
    )  # fmt: skip
    with pytest.warns(sp.ScoreMemoryWarning, match=r"memory is full \(800 samples\) and turned away 200"):
        list(stage(samples))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(stage(samples))  # once
    assert stage.memory.refused >= 200
    # a stage resumed from it with room now, or reading only what its memory holds: the old
    # refusals (in the state, or counted at a load into a smaller memory) are no new ones (the
    # review of the warning)
    state = roundtrip(stage.state_dict())
    for memory, data in (
        (sp.ScoreMemory(2000, max_age=None), samples),
        (sp.ScoreMemory(800, max_age=None), samples[:700]),
    ):
        resumed = sp.Sifter(
            None, lambda m, b: b["loss"].double(), sp.RelativeProbabilistic(1.0, 200), micro_batch=50,
            memory=memory, seed=0,
        )  # fmt: skip
        resumed.load_state_dict(state, override=("memory",))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            list(resumed(data))


@pytest.mark.parametrize("loop", ["fetch_ahead", "endless", "left_early"])
def test_a_full_memory_is_said_in_loops_whose_refusals_fall_outside_a_whole_pass(loop):
    """A trainer that fetches ahead observes a pass's last batch after the pass ended (a memory a
    batch short was refused only there, and never said); one endless pass numbering its epochs,
    and passes always left early, never reach a pass's end (the review of the warning)."""
    n, b = 96, 8
    losses = np.random.default_rng(0).exponential(size=n)
    samples = [{"__key__": f"k{i}", "loss": float(losses[i])} for i in range(n)]
    stage = sp.Sifter(
        None, lambda m, batch: batch["loss"].double(), sp.RelativeProbabilistic(0.5, 50), micro_batch=b,
        output_batch=b, memory=sp.ScoreMemory(95 if loop == "fetch_ahead" else 48, max_age=None),
        unknown="keep", seed=0,
    )  # fmt: skip
    with pytest.warns(sp.ScoreMemoryWarning, match="memory is full"):
        if loop == "endless":

            def stream():
                for epoch in range(3):
                    stage.set_epoch(epoch)
                    yield from samples

            for batch in stage(stream()):
                stage.observe(batch["__key__"], batch["loss"])
        for epoch in range(4 if loop != "endless" else 0):
            stage.set_epoch(epoch)
            it = iter(stage(samples))
            batch = next(it, None)
            step = 0
            while batch is not None and not (loop == "left_early" and step == 9):
                ahead = next(it, None)  # fetched before the step trains `batch`
                stage.observe(batch["__key__"], batch["loss"], epoch=epoch)
                batch, step = ahead, step + 1
            it.close()
