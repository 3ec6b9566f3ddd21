"""Cheaper scoring: losses fed back by the training step, stale scores, proxies."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import siftpipe as sp
from tests.common import loss_field, make_samples, roundtrip

SAMPLES = make_samples(600, seed=6)


class CountingScorer:
    """Precomputed losses, counting how many samples needed a forward."""

    def __init__(self):
        self.scored = 0

    def __call__(self, model, batch):
        self.scored += len(batch["__key__"])
        return batch["loss"].double()


def train_epochs(sifter, epochs, feedback=True):
    """A training loop that hands back the loss of every sample it trained on."""
    kept = []
    for _ in range(epochs):
        epoch = []
        for batch in sifter(SAMPLES):
            if feedback:
                sifter.observe(batch["__key__"], batch["loss"] * 0.5)  # the model learned them
            epoch.extend(batch["__key__"])
        kept.append(epoch)
    return kept


def test_feedback_decides_later_epochs_without_a_forward(tmp_path):
    scorer = CountingScorer()
    log = sp.AuditLog(str(tmp_path), run_id="fb", flush_every=10_000)
    sifter = sp.Sifter(
        None,
        scorer,
        sp.RelativeProbabilistic(1.0, 300),
        micro_batch=50,
        output_batch=20,
        memory=sp.ScoreMemory(10_000),
        remember_forward=False,
        audit=log,
    )
    kept = train_epochs(sifter, 2)
    sifter.close()
    first_kept = len(kept[0])
    # epoch 0 scores everything; epoch 1 scores only what epoch 0 dropped (never trained, never observed)
    assert scorer.scored == 600 + (600 - first_kept)
    assert sifter.stats.from_memory == first_kept and sifter.stats.observed == first_kept + len(kept[1])
    table = sp.read_log(str(tmp_path))
    epoch1 = table.filter(table.column("epoch").to_numpy() == 1)
    sources = epoch1.column("source").to_pylist()
    assert sources.count("feedback") == first_kept and sources.count("forward") == 600 - first_kept
    # the fed-back loss is what decided
    fed = {x["__key__"]: x["loss"] * 0.5 for x in SAMPLES}
    for key, loss, source in zip(
        epoch1.column("key").to_pylist(), epoch1.column("loss").to_pylist(), sources
    ):
        if source == "feedback":
            assert loss == pytest.approx(fed[key], rel=1e-6)


def test_feedback_and_remembered_forward_losses_together_need_no_forward_in_epoch_two():
    scorer = CountingScorer()
    sifter = sp.Sifter(
        None,
        scorer,
        sp.RelativeProbabilistic(1.0, 300),
        micro_batch=50,
        output_batch=20,
        memory=sp.ScoreMemory(10_000),
    )
    kept = train_epochs(sifter, 2)
    assert scorer.scored == 600 and sifter.stats.from_memory == 600
    assert 0 < len(kept[1]) < 600


def test_stale_mode_reuses_forward_losses_for_max_age_epochs():
    scorer = CountingScorer()
    sifter = sp.Sifter(
        None, scorer, sp.Uniform(0.5), micro_batch=50, memory=sp.ScoreMemory(10_000, max_age=2)
    )
    with warnings.catch_warnings():
        # epoch 3 finds nothing, but nothing there was usable: expiry is not a key mismatch
        warnings.simplefilter("error", sp.ScoreMemoryWarning)
        for _ in range(4):
            list(sifter(SAMPLES))
    # scored in epochs 0 and 3 only: epochs 1 and 2 reuse the epoch-0 losses (age 1 and 2)
    assert scorer.scored == 1200 and sifter.stats.from_memory == 1200
    no_reuse = sp.Sifter(
        None,
        CountingScorer(),
        sp.Uniform(0.5),
        micro_batch=50,
        memory=sp.ScoreMemory(10_000),
        remember_forward=False,
    )
    for _ in range(3):
        list(no_reuse(SAMPLES))
    assert no_reuse.stats.scored == 1800


def test_memory_is_part_of_the_state_and_resume_is_exact():
    def make():
        return sp.Sifter(
            None,
            loss_field,
            sp.RelativeProbabilistic(1.0, 100),
            micro_batch=40,
            output_batch=16,
            memory=sp.ScoreMemory(5000),
        )

    reference = make()
    ref_keys = train_epochs(reference, 3)
    first = make()
    train_epochs(first, 1)
    it = first(SAMPLES)
    head = []
    for batch in it:
        first.observe(batch["__key__"], batch["loss"] * 0.5)
        head.extend(batch["__key__"])
        if len(head) >= 100:
            break
    state = roundtrip(first.state_dict())
    second = make()
    second.load_state_dict(state)
    tail = []
    for batch in second(SAMPLES[state["consumed"] :]):
        second.observe(batch["__key__"], batch["loss"] * 0.5)
        tail.extend(batch["__key__"])
    assert head + tail == ref_keys[1]


def test_memory_needs_keys_and_observe_needs_memory():
    tuples = [(torch.tensor([x["loss"]]), 0) for x in SAMPLES[:10]]
    with pytest.raises(sp.ConfigError, match="finds samples by key"):
        sp.Sifter(None, loss_field, memory=sp.ScoreMemory(100), key=None)
    s = sp.Sifter(None, lambda m, b: b[0][:, 0].double(), micro_batch=5, memory=sp.ScoreMemory(100))
    with pytest.raises(sp.MissingKeyError, match="score memory needs one key per sample"):
        list(s(tuples))
    with pytest.raises(sp.ConfigError, match="observe\\(\\) needs a score memory"):
        sp.Sifter(None, loss_field).observe(["a"], [1.0])
    s = sp.Sifter(None, loss_field, memory=sp.ScoreMemory(10))
    with pytest.raises(sp.ScorerOutputError, match="2 keys but 3 losses"):
        s.observe(["a", "b"], torch.ones(3))


@pytest.mark.parametrize(
    "losses,match",
    [
        (torch.ones(2, device="meta"), "on the meta device"),
        (torch.ones(2).to_sparse(), r"as a sparse_coo tensor.*loss.to_dense\(\)"),
        (torch.ones(2, dtype=torch.complex64), "complex losses"),
        (np.ones(2, dtype=np.complex128), "complex losses"),
    ],
)
def test_observe_refuses_losses_without_real_values_by_name(losses, match):
    # found 2026-12-05 (fourth session): NotImplementedError from torch for meta losses, numpy's
    # TypeError for sparse ones, and complex ones lost their imaginary part with a warning
    s = sp.Sifter(None, loss_field, memory=sp.ScoreMemory(10))
    with pytest.raises(sp.ScorerOutputError, match=match):
        s.observe(["a", "b"], losses)
    assert s.stats.observed == 0


@pytest.mark.parametrize(
    "keys, losses, error, match",
    [
        (
            torch.tensor(5),
            torch.tensor(0.5),
            sp.ConfigError,
            "got a 0-d Tensor .one key.: pass observe.\\[key\\]",
        ),
        (np.array(5), np.array(0.5), sp.ConfigError, "got a 0-d ndarray"),
        (["a", "b"], torch.tensor([True, False]), sp.ScorerOutputError, "boolean losses"),
        (["a", "b"], [True, False], sp.ScorerOutputError, "boolean losses"),
        (["a", "b"], ["0.5", "1.5"], sp.ScorerOutputError, "not numbers"),
        (["a", "b"], {"a": 1, "b": 2}, sp.ScorerOutputError, "cannot read losses from a dict"),
        (["a", "b"], (v for v in [0.5, 1.5]), sp.ScorerOutputError, "cannot read losses from a generator"),
    ],
    ids=["0d_tensor_key", "0d_array_key", "bool_tensor", "bool_list", "text", "dict", "generator"],
)
def test_observe_refuses_keys_and_losses_it_would_misread_by_name(keys, losses, error, match):
    """A 0-d key raised "object of type 'int' has no len()"; boolean or text losses were taken
    as 0/1 and as the numbers they spell; a dict or a generator raised a bare TypeError (found
    by review, 2026-12-05)."""
    s = sp.Sifter(None, loss_field, memory=sp.ScoreMemory(10))
    with pytest.raises(error, match=match):
        s.observe(keys, losses)
    assert s.stats.observed == 0


def test_observe_takes_a_list_of_0d_losses_that_require_grad():
    """A per-sample loop's losses, a list of 0-d tensors, raised torch's "Can't call numpy() on
    Tensor that requires grad" when one required grad (found by review, 2026-12-05); a tensor
    that requires grad was detached. Both are now."""
    w = torch.tensor(2.0, requires_grad=True)
    s = sp.Sifter(None, loss_field, memory=sp.ScoreMemory(10))
    s.observe(["a", "b"], [w * 0.25, torch.tensor(1.5)])
    assert s.stats.observed == 2
    assert s.memory.lookup_keys(["a", "b"], 1)[0].tolist() == [0.5, 1.5]
    # a loss vector per micro-batch of a gradient accumulation, joined (the review of the fix:
    # it took each for one 0-d loss); a None among numbers is no loss, ignored, as before
    s.observe(["c", "d", "e"], [w * torch.tensor([0.25, 0.5]), torch.tensor([1.5])])
    s.observe(["f", "g"], [2.5, None])
    assert s.stats.observed == 7
    known = s.memory.lookup_keys(["c", "d", "e", "f", "g"], 1)[0].tolist()
    assert known[:4] == [0.5, 1.0, 1.5, 2.5] and np.isnan(known[4])
    with pytest.raises(sp.ScorerOutputError, match="cannot read losses from a list"):
        s.observe(["h", "i", "j"], [[0.5, 0.6], [0.7]])  # ragged: named, not numpy's ValueError
    # each tensor of a list is checked as one would be (the second review: a (2, 2) token loss
    # in a list was flattened and paired with keys; 0-d booleans were read as 1.0 and 0.0)
    with pytest.raises(sp.ScorerOutputError, match=r"shape \[2, 2\]"):
        s.observe(["h", "i", "j", "k"], [torch.ones(2, 2)])
    with pytest.raises(sp.ScorerOutputError, match="boolean losses"):
        s.observe(["h", "i"], [torch.tensor(True), torch.tensor(False)])
    with pytest.raises(sp.ScorerOutputError, match="cannot stack|cannot read"):
        s.observe(["h", "i"], [torch.tensor([0.5]), "0.7"])
    s.observe(["h", "i"], np.array([0.5, 1.0], dtype=object))  # numbers, held as objects
    assert s.memory.lookup_keys(["h", "i"], 1)[0].tolist() == [0.5, 1.0]


def test_a_memory_that_is_not_a_score_memory_is_refused_made_or_set():
    # found 2026-12-05 (fourth session): AttributeError 'persistent_hard' when the pass opened
    with pytest.raises(sp.ConfigError, match="memory must be a siftpipe.ScoreMemory or None, got str"):
        sp.Sifter(None, loss_field, memory="x")
    s = sp.Sifter(None, loss_field, micro_batch=8)
    s.memory = {"capacity": 10}
    with pytest.raises(sp.ConfigError, match="got dict"):
        list(s(SAMPLES[:8]))


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)
        self.sizes = []

    def forward(self, x):
        self.sizes.append(tuple(x.shape[-2:]))
        return self.head(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


def test_proxy_scores_a_downscaled_input_or_a_small_model(tmp_path):
    torch.manual_seed(0)
    data = [{"__key__": f"k{i}", "x": torch.randn(3, 32, 32), "y": i % 4} for i in range(64)]
    model = TinyCNN()
    proxy = sp.Proxy("cross_entropy", scale_factor=0.5, input="x", target="y")
    log = sp.AuditLog(str(tmp_path), run_id="p")
    s = sp.Sifter(model, proxy, sp.TopFraction(0.5), micro_batch=32, audit=log)
    assert len(list(s(data))) == 32
    s.close()
    assert set(model.sizes) == {(16, 16)}
    assert set(sp.read_log(str(tmp_path)).column("source").to_pylist()) == {"proxy"}
    small = TinyCNN()
    s = sp.Sifter(
        model, sp.Proxy(sp.CrossEntropy("x", "y"), model=small), sp.TopFraction(0.5), micro_batch=32
    )
    list(s(data))
    assert small.sizes == [(32, 32), (32, 32)] and len(model.sizes) == 2
    with pytest.raises(sp.ConfigError, match="scale_factor=, model="):
        sp.Proxy("cross_entropy")


@pytest.mark.parametrize("kind", ["proxy", "reference"])
def test_a_scorers_own_model_left_in_training_mode_scores_in_eval_mode_and_is_put_back(kind):
    """Proxy(model=) and ReducibleLoss(reference) switched their model to eval mode once, when
    made: a proxy trained online, left in training mode, scored with dropout on and its
    batch-norm statistics moving, so the same data scored twice gave other losses (found by
    review, 2026-12-05)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    )
    frozen = net[1]
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    data = [{"x": x[i : i + 8], "y": y[i : i + 8], "__key__": torch.arange(i, i + 8)} for i in (0, 8)]
    base = sp.CrossEntropy("x", "y")
    if kind == "proxy":
        scorer, model = sp.Proxy(base, model=net), None
    else:
        scorer, model = sp.ReducibleLoss(net, base), torch.nn.Linear(4, 3)
    net.train()  # the proxy's own training step left it so
    net[2].eval()  # and a module the user keeps in eval mode stays so
    before = frozen.running_mean.clone()
    decided = []
    for _ in range(2):
        s = sp.Sifter(model, scorer, sp.TopFraction(0.5), batched=True, micro_batch=None)
        decided.append([k for b in s(data) for k in b["__key__"].tolist()])
        assert net.training and frozen.training and not net[2].training  # each in its own mode
    assert torch.equal(frozen.running_mean, before) and decided[0] == decided[1]


def test_a_raised_non_finite_loss_leaves_the_memory_as_the_decided_groups_left_it():
    """on_nan='raise' (the default) raises for a micro-batch holding a NaN loss: that micro-batch
    is not decided, so none of its scoring-forward losses may stay in the memory (found
    2026-12-05: its finite ones did, and a later pass then decided those samples from a memory
    entry of a micro-batch that never was)."""
    samples = [dict(x) for x in SAMPLES[:200]]
    samples[130]["loss"] = float("nan")  # in the third micro-batch of 50
    memory = sp.ScoreMemory(10_000)
    sifter = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, memory=memory)
    with pytest.raises(sp.NonFiniteLossError, match="seq 130"):
        list(sifter(samples))
    assert sifter.stats.seen == 100 and sifter.stats.scored == 100
    assert len(memory) == 100  # the two decided micro-batches, not the failed one's 49 finite losses
    losses, _ = memory.lookup_keys([x["__key__"] for x in samples[100:150]], 1)
    assert np.isnan(losses).all()
    losses, _ = memory.lookup_keys([x["__key__"] for x in samples[:100]], 1)
    assert np.isfinite(losses).all()


def _index_batches(n, size):
    return [{"__key__": torch.arange(i, i + size)} for i in range(0, n, size)]


def _never(model, batch):
    raise AssertionError("the recipe scored")


def test_set_epoch_skipping_epoch_numbers_is_said_once():
    # found 2026-12-05 (fourth session): with set_epoch(2 * e) every sample trained in the last
    # pass counted as skipped, and the forgetting guard never acted, unsaid
    s = sp.recipe(None, _never, budget=400, batched=True, micro_batch=None, cost_guard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.set_epoch(0)
        for batch in s(_index_batches(100, 20)):
            s.observe(batch["__key__"], torch.rand(20))
        s.set_epoch(1)  # the next: nothing said
        list(s(_index_batches(100, 20)))
    with pytest.warns(sp.ScoreMemoryWarning, match=r"set_epoch\(3\) after epoch 1 skips epoch numbers"):
        s.set_epoch(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.set_epoch(5)  # once


def test_losses_all_zero_are_said_so_not_told_to_be_made_non_negative(caplog):
    # found 2026-12-05 (fourth session): the log told the user to hand losses >= 0, which they did
    s = sp.recipe(None, _never, budget=400, batched=True, micro_batch=None, cost_guard=False)
    with caplog.at_level("WARNING", logger="siftpipe"):
        for epoch in range(2):
            s.set_epoch(epoch)
            for batch in s(_index_batches(100, 20)):
                s.observe(batch["__key__"], torch.zeros(20))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "every remembered loss is 0" in said and "add a constant" not in said
    assert s.stats.kept == s.stats.seen == 200
