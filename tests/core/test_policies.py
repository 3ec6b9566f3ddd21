import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from tests.common import loss_field, make_samples


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


@pytest.mark.parametrize("value", [math.log(10), 0.1, 0.7, 1 / 3, 2.3])
def test_prune_easy_prunes_nothing_of_equal_losses(value):
    """Equal losses are not below their mean. The window's running sum put its mean an ulp
    beside them, and PruneEasy dropped ~20% of a stream of ln(10)s (a classifier whose last layer
    starts at zero) and reweighted the rest by 2 (found by review, 2026-12-05)."""
    for history in (500, 10_000):  # re-sorted windows, and ones updated in place
        policy = sp.PruneEasy(ratio=0.5, history=history)
        keep, decisions = run_policy(policy, np.full(20_000, value))
        assert keep.all(), history
        assert all(np.all(d.weight == 1.0) for d in decisions), history
        assert policy.history.mean() == value


def test_prune_easy_stops_after_anneal():
    losses = np.random.default_rng(0).random(10_000)
    keep, decisions = run_policy(sp.PruneEasy(ratio=0.9, anneal=5000), losses)
    assert keep[:5000].mean() < 0.7
    assert keep[5000:].all()
    assert all(np.all(d.weight == 1.0) for d in decisions[5000 // 64 + 1 :])


def test_a_subclass_deciding_with_the_three_argument_signature_is_not_given_positions():
    # before: a PruneEasy subclass overriding decide(losses, rng, seen) got a TypeError at the
    # first micro-batch with a row the policy does not see
    class Logged(sp.PruneEasy):
        def decide(self, losses, rng, seen):
            return super().decide(losses, rng, seen)

    losses = np.r_[np.nan, np.random.default_rng(0).exponential(size=31)]
    s = sp.Sifter(None, lambda m, b: torch.from_numpy(losses), Logged(0.5), batched=True, on_nan="keep")
    assert len(next(iter(s([{"x": torch.zeros(32)}])))["x"]) >= 1 and s.stats.nan == 1


def test_prune_easy_anneals_by_each_rows_place_when_nan_rows_lie_between():
    from siftpipe.core.decide import decide_rows

    policy = sp.PruneEasy(ratio=0.9, anneal=50, history=1000)
    policy.history.extend(np.full(1000, 5.0))  # mean 5: every loss of 0 is easy
    losses = np.r_[np.full(50, np.nan), np.zeros(50)]  # rows 50..99, past the anneal point, finite
    d = decide_rows(policy, np.random.default_rng(0), losses, seq0=0, chunk=100, delay=0, nan_kept=True)
    # before, the finite rows were placed at 0..49 and 44 of them were pruned, weighing 10
    assert d.keep.all() and (d.weight == 1.0).all()
    before = np.r_[np.zeros(50), np.full(50, np.nan)]  # the same rows before the anneal point
    d = decide_rows(policy, np.random.default_rng(0), before, seq0=0, chunk=100, delay=0, nan_kept=True)
    assert (~d.keep[:50]).sum() > 30 and d.keep[50:].all()


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


class Broken(sp.Policy):
    """A user policy whose decision is damaged by ``damage(decision, n) -> decision``."""

    name = ""

    def __init__(self, damage):
        self.damage = damage

    def decide(self, losses, rng, seen):
        n = losses.size
        prob = np.full(n, 0.5)
        good = sp.Decision(rng.random(n) < prob, prob, np.zeros(n), np.ones(n))
        return self.damage(good, n)

    def __repr__(self):
        return "Broken()"


def with_(**fields):
    return lambda d, n: sp.Decision(**{**d.__dict__, **{k: v(d, n) for k, v in fields.items()}})


MALFORMED = [
    ("keep one short", with_(keep=lambda d, n: d.keep[:-1]), r"keep has shape \(15,\), not \(16,\)"),
    (
        "prob above 1",
        with_(prob=lambda d, n: np.full(n, 1.5)),
        r"prob is not in \[0, 1\] at 16 row\(s\).*1\.5",
    ),
    ("prob below 0", with_(prob=lambda d, n: np.full(n, -0.1)), r"prob is not in \[0, 1\]"),
    ("prob NaN", with_(prob=lambda d, n: np.where(np.arange(n) == 3, np.nan, 0.5)), r"row 3: .*nan"),
    ("weight NaN", with_(weight=lambda d, n: np.full(n, np.nan)), r"weight is not finite and >= 0"),
    ("weight negative", with_(weight=lambda d, n: np.full(n, -1.0)), r"weight is not finite and >= 0"),
    ("weight infinite", with_(weight=lambda d, n: np.full(n, np.inf)), r"weight is not finite and >= 0"),
    ("weight too long", with_(weight=lambda d, n: np.ones(n + 1)), r"weight has shape \(17,\)"),
    ("keep a list", with_(keep=lambda d, n: d.keep.tolist()), r"keep is a list, not a numpy array"),
    ("prob a tensor", with_(prob=lambda d, n: torch.from_numpy(d.prob)), r"prob is a Tensor"),
    ("keep of ints", with_(keep=lambda d, n: d.keep.astype(np.int64)), r"keep has dtype int64, not bool"),
    ("prob of ints", with_(prob=lambda d, n: np.ones(n, dtype=np.int64)), r"prob has dtype int64, not float"),
    ("score of strings", with_(score=lambda d, n: np.array(["x"] * n)), r"score has dtype <U1, not numeric"),
    ("not a Decision", lambda d, n: (d.keep, d.prob), r"returned a tuple, not a siftpipe.Decision"),
    ("None", lambda d, n: None, r"returned a NoneType"),
]


@pytest.mark.parametrize("case,damage,match", MALFORMED, ids=[m[0] for m in MALFORMED])
@pytest.mark.parametrize("batched", [False, True])
def test_a_malformed_decision_raises_policy_error_naming_the_policy_and_the_fault(
    case, damage, match, batched
):
    samples = make_samples(64)
    data = [default_collate(samples[i : i + 48]) for i in range(0, 64, 48)] if batched else samples
    # batched: 48-row batches scored in micro-batches of 16, the loop branch of the decision
    s = sp.Sifter(None, loss_field, Broken(damage), micro_batch=16, batched=batched, seed=0)
    with pytest.raises(
        sp.PolicyError, match=rf"(?s)policy Broken\(\) returned a malformed decision.*{match}"
    ):
        list(s(data))
    assert issubclass(sp.PolicyError, sp.SiftError)


@pytest.mark.parametrize("batched", [False, True])
def test_a_policy_that_raises_is_named_with_the_samples_it_was_deciding(batched):
    # found 2026-12-05 (fourth session): the policy's own exception came out bare, naming
    # neither the policy nor the samples
    def explode(d, n):
        raise ValueError("no history yet")

    samples = make_samples(64)
    data = [default_collate(samples[i : i + 32]) for i in range(0, 64, 32)] if batched else samples
    s = sp.Sifter(None, loss_field, Broken(explode), micro_batch=32, batched=batched, seed=0)
    with pytest.raises(
        sp.PolicyError,
        match=r"policy Broken\(\) raised ValueError: no history yet while deciding the 32 samples "
        r"from seq 0 \(keys \['s000000', 's000001'",
    ) as caught:
        list(s(data))
    assert isinstance(caught.value.__cause__, ValueError)
    assert s.stats.seen == 0  # the group was not decided, so it is not counted


def test_a_subclass_of_a_builtin_policy_is_checked_too():
    class Greedy(sp.Uniform):
        def decide(self, losses, rng, seen):
            d = super().decide(losses, rng, seen)
            return sp.Decision(d.keep, d.prob * 3, d.score)

    with pytest.raises(sp.PolicyError, match="prob is not in"):
        list(sp.Sifter(None, loss_field, Greedy(0.5), micro_batch=8)(make_samples(16)))


def test_a_well_formed_user_policy_passes_in_any_float_width():
    def narrow(d, n):
        return sp.Decision(d.keep, d.prob.astype(np.float32), np.arange(n), d.weight.astype(np.float32))

    out = list(sp.Sifter(None, loss_field, Broken(narrow), micro_batch=16, seed=0)(make_samples(64)))
    assert 0 < len(out) < 64


@pytest.mark.parametrize(
    ("keep", "n", "kept"), [(0.29, 50, 15), (0.145, 100, 15), (0.35, 90, 32), (0.5, 3, 2)]
)
def test_top_fraction_rounds_half_up_the_fraction_as_written(keep, n, kept):
    # found by review: the float product 0.29 * 50 is 14.4999..., and it kept 14
    losses = np.random.default_rng(n).exponential(size=n)
    d = sp.TopFraction(keep).decide(losses, np.random.default_rng(0), 0)
    assert int(d.keep.sum()) == kept


def test_top_fraction_follows_keep_set_anew():
    # found by review: the count cached per micro-batch size ignored a later policy.keep = ...
    policy = sp.TopFraction(0.5)
    losses = np.arange(10.0)
    assert policy.decide(losses, np.random.default_rng(0), 0).keep.sum() == 5
    policy.keep = 0.2
    assert policy.decide(losses, np.random.default_rng(0), 0).keep.sum() == 2


def test_top_fraction_that_keeps_all_of_a_micro_batch_says_so():
    """TopFraction(0.9) over micro-batches of 3 keeps round(2.7) = 3 of each, and keep=0.5 of
    micro-batches of 1 keeps round(0.5) = 1: nothing was sifted and nothing said, where keeping
    none warned (found by review, 2026-12-06). Named: the least micro-batch that sifts."""
    for keep, micro_batch, least in ((0.9, 3, 6), (0.5, 1, 2), (0.75, 2, 3)):
        said = rf"TopFraction\({keep}\) kept all .* 8 micro-batches of {micro_batch} .* at least {least} "
        with pytest.warns(UserWarning, match=said):
            keep_, _ = run_policy(sp.TopFraction(keep), np.random.default_rng(0).random(60), micro_batch)
        assert keep_.all()
        # the least micro-batch it names does sift
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            keep_, _ = run_policy(sp.TopFraction(keep), np.random.default_rng(0).random(60), least)
        assert not keep_.all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # keep=1 keeps all by design; a pass's last, shorter micro-batch kept whole is not said
        run_policy(sp.TopFraction(1.0), np.random.default_rng(0).random(60), micro_batch=4)
        keep_, _ = run_policy(sp.TopFraction(0.5), np.random.default_rng(0).random(65), micro_batch=16)
        assert keep_.sum() == 33  # 8 of each 16, the last 1 kept


def test_top_fraction_that_keeps_none_of_a_micro_batch_says_so():
    """TopFraction(0.1) over micro-batches of 4 keeps round(0.4) = 0 of each: before, the stream
    handed nothing on and nothing was said (found by review, 2026-12-05). A pass's last, shorter
    micro-batch keeping none is not warned about."""
    said = r"TopFraction\(0.1\) kept none .* 8 micro-batches of 4 .* at least 5"
    with pytest.warns(UserWarning, match=said):
        keep, _ = run_policy(sp.TopFraction(0.1), np.random.default_rng(0).random(100), micro_batch=4)
    assert not keep.any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keep, _ = run_policy(sp.TopFraction(0.1), np.random.default_rng(0).random(66), micro_batch=32)
        assert keep.sum() == 6  # 3 of each 32, none of the last 2
        # batched mode: each input batch is a micro-batch; a small first one keeps none
        losses = np.random.default_rng(0).random(204)
        s = sp.Sifter(None, loss_field, sp.TopFraction(0.1), micro_batch=None, batched=True)
        sizes = [4] + [40] * 5
        batches = [{"loss": torch.from_numpy(part)} for part in np.split(losses, np.cumsum(sizes)[:-1])]
        assert sum(len(b["loss"]) for b in s(batches)) == 20
