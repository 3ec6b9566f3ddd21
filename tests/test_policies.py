import math

import numpy as np
import pytest

import siftpipe as sp


def run_policy(policy, losses, micro_batch=64, seed=0):
    rng = np.random.default_rng(seed)
    keeps, decisions = [], []
    for start in range(0, len(losses), micro_batch):
        d = policy.decide(losses[start : start + micro_batch], rng, start)
        keeps.append(d.keep)
        decisions.append(d)
    return np.concatenate(keeps), decisions


@pytest.mark.parametrize("beta", [0.5, 1.0, 3.0])
def test_relative_probabilistic_keeps_one_over_one_plus_beta(beta):
    losses = np.random.default_rng(7).lognormal(size=60_000)
    keep, _ = run_policy(sp.RelativeProbabilistic(beta=beta, history=500), losses)
    expected = 1 / (1 + beta)
    # binomial standard error at n=60000 is < 0.002; allow 5 of them plus the small-window bias
    assert keep.mean() == pytest.approx(expected, abs=0.012)


def test_relative_probabilistic_prefers_high_loss():
    losses = np.random.default_rng(3).random(20_000)
    keep, _ = run_policy(sp.RelativeProbabilistic(beta=2.0, history=1000), losses)
    assert losses[keep].mean() > losses[~keep].mean() + 0.15


@pytest.mark.parametrize("keep_fraction", [0.1, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_top_fraction_keeps_exactly_the_highest(keep_fraction, n):
    rng = np.random.default_rng(n)
    losses = rng.random(n)
    d = sp.TopFraction(keep_fraction).decide(losses, rng, 0)
    k = math.floor(keep_fraction * n + 0.5)
    assert d.keep.sum() == k
    if 0 < k < n:
        assert losses[d.keep].min() > losses[~d.keep].max()


def test_top_fraction_ties_go_to_earlier_samples():
    d = sp.TopFraction(0.5).decide(np.ones(4), np.random.default_rng(0), 0)
    assert d.keep.tolist() == [True, True, False, False]


def test_uniform_rate_ignores_losses():
    losses = np.random.default_rng(11).random(50_000)
    keep, _ = run_policy(sp.Uniform(0.3), losses)
    assert keep.mean() == pytest.approx(0.3, abs=0.01)
    # independent of the loss: kept and dropped have the same mean loss
    assert losses[keep].mean() == pytest.approx(losses[~keep].mean(), abs=0.01)


def test_prune_easy_weights_keep_the_loss_sum_unbiased():
    losses = np.random.default_rng(5).exponential(size=100_000)
    policy = sp.PruneEasy(ratio=0.6, history=2000)
    keep, decisions = run_policy(policy, losses)
    weight = np.concatenate([d.weight for d in decisions])
    easy = np.concatenate([d.score for d in decisions]).astype(bool)
    # hard samples are always kept, with weight 1
    assert keep[~easy].all() and np.all(weight[~easy] == 1.0)
    # easy samples are kept with probability 0.4 and weigh 1/0.4
    assert keep[easy].mean() == pytest.approx(0.4, abs=0.01)
    assert np.allclose(weight[easy], 2.5)
    # so the weighted sum of kept losses estimates the full sum
    assert (losses[keep] * weight[keep]).sum() == pytest.approx(losses.sum(), rel=0.02)


def test_prune_easy_stops_after_anneal():
    losses = np.random.default_rng(0).random(10_000)
    keep, decisions = run_policy(sp.PruneEasy(ratio=0.9, anneal=5000), losses)
    assert keep[:5000].mean() < 0.7
    assert keep[5000:].all()
    assert all(np.all(d.weight == 1.0) for d in decisions[5000 // 64 + 1 :])


@pytest.mark.parametrize(
    "make",
    [
        lambda: sp.RelativeProbabilistic(beta=0),
        lambda: sp.RelativeProbabilistic(beta=-1),
        lambda: sp.RelativeProbabilistic(beta=float("nan")),
        lambda: sp.TopFraction(0),
        lambda: sp.TopFraction(1.5),
        lambda: sp.Uniform(0.0),
        lambda: sp.Uniform(-0.1),
        lambda: sp.PruneEasy(ratio=1.0),
        lambda: sp.RelativeProbabilistic(history=0),
    ],
)
def test_bad_parameters_raise_config_error(make):
    with pytest.raises(sp.ConfigError):
        make()


def test_registry_by_name_and_duplicate_names():
    p = sp.get_policy("relative_probabilistic", beta=3.0)
    assert isinstance(p, sp.RelativeProbabilistic) and p.beta == 3.0
    assert {"relative_probabilistic", "top_fraction", "prune_easy", "uniform"} <= set(sp.policy_names())
    with pytest.raises(sp.RegistryError, match="already registered"):
        sp.register_policy("uniform")(type("Other", (sp.Uniform,), {}))
    with pytest.raises(sp.RegistryError, match="unknown policy 'nope'"):
        sp.get_policy("nope")

    @sp.register_policy("test_keep_all", overwrite=True)
    class KeepAll(sp.Policy):
        name = "test_keep_all"

        def decide(self, losses, rng, seen):
            n = losses.size
            return sp.Decision(np.ones(n, bool), np.ones(n), np.zeros(n), np.ones(n))

    assert isinstance(sp.get_policy("test_keep_all"), KeepAll)


def test_fresh_copies_configuration_not_state():
    p = sp.RelativeProbabilistic(beta=2.0, history=10)
    p.decide(np.arange(5.0), np.random.default_rng(0), 0)
    q = p.fresh()
    assert q.config() == p.config() and len(q.history) == 0 and len(p.history) == 5
