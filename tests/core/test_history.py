import numpy as np
import pytest

import siftpipe as sp


def brute_percentile(window, values):
    window = np.asarray(window)
    return np.array([((window < v).sum() + (window <= v).sum()) / (2 * len(window)) for v in values])


@pytest.mark.parametrize("size", [1, 5, 64, 500])
def test_window_matches_brute_force(size):
    rng = np.random.default_rng(size)
    h = sp.LossHistory(size)
    everything: list[float] = []
    for _ in range(60):
        # few distinct values: ties exercise the eviction of equal losses
        batch = rng.integers(0, 7, size=rng.integers(1, 40)).astype(float)
        h.extend(batch)
        everything.extend(batch)
        window = everything[-size:]
        assert len(h) == len(window)
        np.testing.assert_array_equal(h.values(), window)
        np.testing.assert_array_equal(np.sort(window), h._sorted)
        probe = rng.integers(-1, 8, size=10).astype(float)
        np.testing.assert_allclose(h.percentile(probe), brute_percentile(window, probe))
        assert h.mean() == pytest.approx(np.mean(window))


@pytest.mark.parametrize("size", [7, 500, 4096])
def test_percentile_is_the_mid_rank_with_and_without_equal_losses(size):
    # continuous losses (no loss equal to one in the window), and a few probes equal to one
    # there (or to a 0 the window holds several of) among fresh ones: both searches' cases
    rng = np.random.default_rng(size)
    h = sp.LossHistory(size)
    everything: list[float] = []
    for step in range(30):
        batch = rng.exponential(size=int(rng.integers(1, 300)))
        if step % 3 == 0:
            batch[: batch.size // 4] = 0.0
        h.extend(batch)
        everything.extend(batch)
        window = np.asarray(everything[-size:])
        fresh = rng.exponential(size=64)
        np.testing.assert_array_equal(h.percentile(fresh), brute_percentile(window, fresh))
        mixed = np.concatenate([fresh, rng.choice(window, 3), [0.0]])
        rng.shuffle(mixed)
        np.testing.assert_array_equal(h.percentile(mixed), brute_percentile(window, mixed))


def test_state_roundtrip_continues_identically():
    rng = np.random.default_rng(1)
    a = sp.LossHistory(50)
    a.extend(rng.random(73))
    b = sp.LossHistory(50)
    b.load_state_dict(a.state_dict())
    more = rng.random(20)
    a.extend(more)
    b.extend(more)
    np.testing.assert_array_equal(a.values(), b.values())
    np.testing.assert_array_equal(a._sorted, b._sorted)


def test_load_refuses_other_size():
    a = sp.LossHistory(10)
    a.extend(np.arange(4.0))
    with pytest.raises(sp.ResumeError, match="history=10"):
        sp.LossHistory(20).load_state_dict(a.state_dict())


def test_empty_window_percentile_is_half_and_bad_size_raises():
    assert sp.LossHistory(3).percentile(np.array([1.0, 2.0])).tolist() == [0.5, 0.5]
    with pytest.raises(sp.ConfigError, match="positive"):
        sp.LossHistory(0)


@pytest.mark.parametrize("size", [3000, 5000])
def test_large_windows_update_incrementally_and_match(size):
    rng = np.random.default_rng(size)
    h = sp.LossHistory(size)
    everything: list[float] = []
    for _ in range(40):
        batch = rng.integers(0, 50, size=rng.integers(1, 700)).astype(float)
        h.extend(batch)
        everything.extend(batch)
        window = everything[-size:]
        np.testing.assert_array_equal(np.sort(window), h._sorted)
        probe = rng.integers(-1, 51, size=10).astype(float)
        np.testing.assert_allclose(h.percentile(probe), brute_percentile(window, probe))
        assert h.mean() == pytest.approx(np.mean(window))


@pytest.mark.parametrize("size", [1, 2, 7, 500, 2048, 3000])
@pytest.mark.parametrize("kind", ["continuous", "ties", "mixed"])
def test_extend_percentile_equals_extend_then_percentile(size, kind):
    """The one-pass update-and-rank gives exactly what extend() then percentile() gives, while
    the window fills, wraps, takes batches larger than itself, and holds equal losses (after
    which it searches for a while, then tries the one-pass way again)."""
    rng = np.random.default_rng(size)
    fused, plain = sp.LossHistory(size), sp.LossHistory(size)
    everything: list[float] = []
    for step in range(200):
        n = int(rng.choice([1, 3, 64, 256, size - 1 if size > 1 else 1, size, size + 5]))
        batch = rng.exponential(size=n)
        if kind == "ties" or (kind == "mixed" and 100 <= step < 110):
            batch = np.round(batch, 1)  # a few dozen distinct values: ties in every window
        got = fused.extend_percentile(batch)
        plain.extend(batch)
        want = plain.percentile(batch)
        everything.extend(batch)
        everything = everything[-size:]
        np.testing.assert_array_equal(got, want)
        if step % 10 == 0:
            np.testing.assert_array_equal(got, brute_percentile(everything, batch))
        np.testing.assert_array_equal(fused.values(), plain.values())
        np.testing.assert_array_equal(fused._sorted, plain._sorted)
        assert fused.mean() == plain.mean()
        assert fused.state_dict()["total"] == plain.state_dict()["total"]


def test_extend_percentile_of_a_two_dimensional_batch_keeps_its_shape():
    h, plain = sp.LossHistory(50), sp.LossHistory(50)
    batch = np.random.default_rng(0).exponential(size=(4, 3))
    got = h.extend_percentile(batch)
    plain.extend(batch)
    assert got.shape == (4, 3)
    np.testing.assert_array_equal(got, plain.percentile(batch))


def test_one_huge_loss_that_came_and_went_leaves_the_mean_of_what_the_window_holds():
    """A window above 2,048 losses kept a running sum: one loss of 1e20 absorbed every later
    addition, and its eviction left a sum near 0 for up to a lap of the ring. PruneEasy (window
    10,000) then read no sample as easy and stopped pruning for a window, and a run resumed then
    (its sum taken afresh) decided otherwise than the one it continued (found by review, 2026-12-05)."""
    from siftpipe.core.policies import PruneEasy

    size, mb = 10_000, 100
    stream = np.random.default_rng(0).uniform(0.5, 1.5, 4 * size)
    stream[size] = 1e20
    history = sp.LossHistory(size)
    for i in range(0, stream.size, mb):
        history.extend(stream[i : i + mb])
        window = stream[max(0, i + mb - size) : i + mb]
        assert history.mean() == pytest.approx(float(np.mean(window)), rel=1e-9), i

    def run(cut=None):
        policy, rng, kept = PruneEasy(0.5, history=size), np.random.default_rng(7), []
        for i in range(0, stream.size, mb):
            if i == cut:
                state, drawn = policy.state_dict(), rng.bit_generator.state
                policy = PruneEasy(0.5, history=size)
                policy.load_state_dict(state)
                rng = np.random.default_rng()
                rng.bit_generator.state = drawn
            kept.append(policy.decide(stream[i : i + mb], rng, i).keep.copy())
        return np.concatenate(kept)

    whole = run()
    assert np.array_equal(whole, run(cut=2 * size + 500))
    # after the spike left, easy samples are pruned as before it came (about 3/4 kept)
    assert whole[2 * size + 100 : 3 * size].mean() < 0.8
