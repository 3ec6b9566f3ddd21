import numpy as np
import pytest
import torch

import siftpipe as sp
from tests.common import loss_field, make_samples
from tests.contract import output_keys


def test_per_sample_output_is_an_ordered_subset_in_input_format(samples):
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 200), micro_batch=32, seed=1)
    out = list(s(samples))
    keys = output_keys(out)
    all_keys = [x["__key__"] for x in samples]
    assert set(keys) < set(all_keys)
    assert keys == sorted(keys)
    assert all(o is x for o, x in zip(out, (x for x in samples if x["__key__"] in set(keys))))
    st = s.stats
    assert st.seen == 600 and st.kept == len(out) and st.kept + st.dropped == st.seen
    assert st.micro_batches == 19  # 18 full micro-batches of 32 and one of 24
    assert 0.35 < st.keep_rate < 0.65


def test_tuple_and_tensor_samples(linear_model):
    data = [(torch.randn(4), i % 3) for i in range(100)]
    s = sp.Sifter(linear_model, "cross_entropy", sp.TopFraction(0.5), micro_batch=10, key=None)
    out = list(s(data))
    assert len(out) == 50 and all(isinstance(o, tuple) and len(o) == 2 for o in out)
    tensors = [torch.tensor([float(i)]) for i in range(40)]
    s = sp.Sifter(None, lambda m, b: b[:, 0].double(), sp.TopFraction(0.25), micro_batch=8, key=None)
    out = list(s(tensors))
    assert [int(t) for t in out] == [i for i in range(40) if i % 8 >= 6]


def test_output_batch_gives_full_batches_and_a_short_last_one(samples):
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=64, output_batch=50)
    out = list(s(samples))
    sizes = [len(b["__key__"]) for b in out]
    assert sizes == [50] * 6
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.25), micro_batch=64, output_batch=40)
    sizes = [len(b["__key__"]) for b in s(samples)]
    # 9 micro-batches of 64 keep 16 each, the last of 24 keeps 6: 150 kept
    assert sizes == [40, 40, 40, 30]
    assert isinstance(out[0]["x"], torch.Tensor) and out[0]["x"].shape == (50, 4)


def collated(samples, size):
    from torch.utils.data import default_collate

    return [default_collate(samples[i : i + size]) for i in range(0, len(samples), size)]


def test_batched_mode_filters_each_batch_and_matches_per_sample_mode(samples):
    batches = collated(samples, 64)
    per_sample = sp.Sifter(None, loss_field, sp.TopFraction(0.25), micro_batch=64)
    batched = sp.Sifter(None, loss_field, sp.TopFraction(0.25), micro_batch=None, batched=True)
    a = output_keys(per_sample(samples))
    out = list(batched(batches))
    assert output_keys(out) == a
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].shape[0] == len(b["__key__"]) for b in out)
    # a large worker batch is scored in micro-batches: the same decisions as per-sample mode
    chunked = sp.Sifter(None, loss_field, sp.TopFraction(0.25), micro_batch=64, batched=True)
    assert output_keys(chunked(collated(samples, 192))) == a


def test_batched_mode_output_batch_rebatches(samples):
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=None, batched=True, output_batch=100)
    out = list(s(collated(samples, 64)))
    assert [len(b["__key__"]) for b in out] == [100, 100, 100]
    assert [b["x"].shape[0] for b in out] == [100, 100, 100]
    tuples = [(b["x"], b["y"]) for b in collated(samples, 50)]
    s = sp.Sifter(
        None,
        lambda m, b: b[0][:, 0].double(),
        sp.TopFraction(0.5),
        micro_batch=None,
        batched=True,
        output_batch=64,
        key=None,
    )
    out = list(s(tuples))
    assert [o[0].shape[0] for o in out] == [64] * 4 + [44]
    assert all(isinstance(o, tuple) and o[1].shape[0] == o[0].shape[0] for o in out)


def test_rebatched_rows_are_the_kept_rows_in_order_in_every_structure_and_do_not_alias():
    from collections import namedtuple

    from siftpipe.core import batch as _batch

    Pair = namedtuple("Pair", "a b")
    n = 300
    batches = [
        {
            "__key__": [f"k{i}" for i in range(s, s + 50)],
            "x": torch.arange(s, s + 50, dtype=torch.float64),
            "np": np.arange(s, s + 50) * 10,
            "pair": Pair(torch.arange(s, s + 50), [f"b{i}" for i in range(s, s + 50)]),
            "scale": torch.tensor(3.0),  # 0-d: the same in every batch
        }
        for s in range(0, n, 50)
    ]
    s = sp.Sifter(
        None, lambda m, b: b["x"] % 7, sp.TopFraction(0.5), micro_batch=None, batched=True, output_batch=40
    )
    out = []
    for b in s(batches):
        # a training step that scales its batch in place, before the rest is handed on
        b["x"].mul_(-1)
        out.append(b)
    for b in out:
        assert (b["x"] <= 0).all()  # scaled once: no batch shares rows with another
        b["x"].mul_(-1)
    kept = [int(v) for b in out for v in b["x"]]
    sizes = [40] * (len(kept) // 40) + ([len(kept) % 40] if len(kept) % 40 else [])
    assert [len(b["__key__"]) for b in out] == sizes
    assert kept == sorted(kept) and len(kept) == s.stats.kept  # the kept rows, in order
    for b in out:
        rows = b["x"].long().tolist()
        assert b["__key__"] == [f"k{i}" for i in rows] and b["np"].tolist() == [10 * i for i in rows]
        assert isinstance(b["pair"], Pair) and b["pair"].a.tolist() == rows
        assert b["pair"].b == [f"b{i}" for i in rows] and float(b["scale"]) == 3.0
    head, tail = _batch.split({"t": torch.arange(5), "l": list("abcde"), "z": torch.tensor(1)}, 2)
    assert head["t"].tolist() == [0, 1] and tail["t"].tolist() == [2, 3, 4]
    assert head["l"] == ["a", "b"] and tail["l"] == ["c", "d", "e"] and head["z"] is tail["z"]


@pytest.mark.parametrize("kind", ["UserDict", "BatchEncoding", "frozen"])
def test_a_mapping_batch_keeps_its_type_whether_rows_are_dropped_rebatched_or_weighted(kind):
    """A BatchEncoding batch came out a plain dict whenever a row was dropped (and as itself when
    none was), so a loop calling batch.to(device) failed on the second batch (found by review,
    2026-12-05). A mapping type that can be neither made from a dict nor copied and set is a dict."""
    from collections import UserDict
    from collections.abc import Mapping

    class Frozen(Mapping):
        def __init__(self, data, tag):
            self.data, self.tag = dict(data), tag

        def __getitem__(self, k):
            return self.data[k]

        def __iter__(self):
            return iter(self.data)

        def __len__(self):
            return len(self.data)

    if kind == "BatchEncoding":
        from transformers import BatchEncoding as make
    elif kind == "UserDict":
        make = UserDict
    else:
        make = lambda data: Frozen(data, "t")  # noqa: E731
    batches = [
        make({"__key__": torch.arange(s, s + 8), "x": torch.arange(s, s + 8, dtype=torch.float64)})
        for s in range(0, 64, 8)
    ]
    expected = dict if kind == "frozen" else type(batches[0])
    for ratio, options in [(0.5, {}), (0.0, {}), (0.5, {"output_batch": 6}), (0.5, {"delay": 8})]:
        s = sp.Sifter(
            None,
            lambda m, b: b["x"],
            sp.PruneEasy(ratio, history=16),
            micro_batch=None,
            batched=True,
            **options,
        )
        out = list(s(batches))
        assert {type(b) for b in out} == {expected}, (ratio, options)
        assert all("__sift_weight__" in b for b in out)
        assert sum(len(b["__key__"]) for b in out) == s.stats.kept


@pytest.mark.parametrize("output_batch", [None, 6])
def test_a_sparse_field_is_sifted_in_coo_and_named_with_the_fix_in_a_layout_without_rows(output_batch):
    """A COO field failed to be re-batched and a CSR field to have its kept rows taken, both with
    torch's own error naming no field and no fix (found by review, 2026-12-05)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 3)

    def data(sparse):
        for i in range(0, 32, 8):
            x = (torch.rand(8, 20) < 0.2).float()
            yield {"x": sparse(x), "y": torch.randint(0, 3, (8,)), "__key__": torch.arange(i, i + 8)}

    scorer = sp.CrossEntropy("x", "y", forward=lambda m, x: m(x.to_dense()))

    def stage():
        return sp.Sifter(
            model, scorer, sp.TopFraction(0.5), batched=True, micro_batch=None, output_batch=output_batch
        )

    out = list(stage()(data(lambda x: x.to_sparse())))
    assert sum(b["x"].shape[0] for b in out) == 16 and all(b["x"].is_sparse for b in out)
    # coalesced as they came (the review of the fix: indices() in a training step raised)
    assert all(b["x"].is_coalesced() for b in out)
    with pytest.raises(sp.BatchError, match="batch field 'x' holds a torch.sparse_csr tensor.*to_dense"):
        list(stage()(data(lambda x: x.to_sparse_csr())))
    # the field named is the one that failed, not the first sparse one
    from siftpipe.core import batch as _batch

    mixed = {"ids": torch.eye(4).to_sparse(), "adj": torch.eye(4).to_sparse_csr()}
    with pytest.raises(sp.BatchError, match="batch field 'adj' holds a torch.sparse_csr"):
        _batch.take(mixed, np.array([0, 2]))


def test_warmup_keeps_everything_and_fills_history(samples):
    policy = sp.RelativeProbabilistic(3.0, history=1000)
    s = sp.Sifter(None, loss_field, policy, micro_batch=64, delay=100)
    out = output_keys(s(samples))
    assert out[:100] == [x["__key__"] for x in samples[:100]]
    assert s.stats.warmup == 100
    assert len(policy.history) == 600
    assert s.stats.kept < 100 + 0.5 * 500


def test_weights_attach_to_every_format(samples):
    policy = sp.PruneEasy(ratio=0.5, history=100)
    out = list(sp.Sifter(None, loss_field, policy, micro_batch=50)(samples))
    weights = {o["__sift_weight__"] for o in out}
    assert weights == {1.0, 2.0}
    tuples = [(torch.tensor([x["loss"]]), 0) for x in samples]
    out = list(
        sp.Sifter(None, lambda m, b: b[0][:, 0].double(), sp.PruneEasy(0.5), micro_batch=50, key=None)(tuples)
    )
    assert all(len(o) == 3 and o[2] in (1.0, 2.0) for o in out)
    batches = collated(samples, 64)
    out = list(sp.Sifter(None, loss_field, sp.PruneEasy(0.5), micro_batch=None, batched=True)(batches))
    assert all(b["__sift_weight__"].shape[0] == len(b["__key__"]) for b in out)
    # a policy that does not reweight attaches nothing unless asked
    out = list(sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50)(make_samples(100)))
    assert all("__sift_weight__" not in o for o in out)
    out = list(
        sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, attach_weight=True)(make_samples(100))
    )
    assert all(o["__sift_weight__"] == 1.0 for o in out)


def test_a_namedtuple_keeps_its_type_with_weights_or_is_said_to_become_a_plain_tuple(tmp_path):
    from collections import namedtuple

    Weighted = namedtuple("Weighted", "x y weight", defaults=[1.0])
    Pair = namedtuple("Pair", "x y")
    rows = torch.rand(200)

    def score(model, b):
        return b.x.double()

    # batched: the weight goes in the batch's own field, and the batch stays a Weighted
    batches = [Weighted(rows[i : i + 50], torch.arange(i, i + 50)) for i in range(0, 200, 50)]
    weighting = dict(key=None, weight_field="weight")
    s = sp.Sifter(None, score, sp.PruneEasy(0.5), micro_batch=None, batched=True, **weighting)
    out = list(s(batches))
    assert out and all(type(b) is Weighted and b.weight.shape == b.x.shape for b in out)
    assert {float(w) for b in out for w in b.weight} <= {1.0, 2.0}
    # per sample: each sample stays a Weighted holding its weight
    samples = [Weighted(rows[i], i) for i in range(200)]
    s = sp.Sifter(None, score, sp.PruneEasy(0.5), micro_batch=50, **weighting)
    out = list(s(samples))
    assert out and all(type(o) is Weighted and o.weight in (1.0, 2.0) for o in out)
    # a namedtuple with no field for it: handed on as a plain tuple with the weight last, as
    # before (x, y, w = batch works), and said once, with the fix (it was silent)
    for batched, items in (
        (True, [Pair(rows[i : i + 50], torch.arange(i, i + 50)) for i in range(0, 200, 50)]),
        (False, [Pair(rows[i], i) for i in range(200)]),
    ):
        s = sp.Sifter(
            None, score, sp.PruneEasy(0.5), micro_batch=None if batched else 50, batched=batched, key=None
        )
        with pytest.warns(
            UserWarning, match="Pair.*no field '__sift_weight__'.*weight_field='weight'"
        ) as said:
            out = list(s(items))
        assert len([w for w in said if "namedtuple" in str(w.message)]) == 1
        assert out and all(type(o) is tuple and len(o) == 3 for o in out)
        assert s.stats.seen == 200 and s.stats.kept == sum(len(o[0]) if batched else 1 for o in out)


class Recorder(torch.nn.Module):
    """Records the mode, grad mode and batch sizes it is called with."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.drop = torch.nn.Dropout(0.5)
        self.calls = []

    def forward(self, x):
        self.calls.append((self.training, torch.is_grad_enabled(), x.shape[0]))
        return self.drop(self.lin(x))


def test_scoring_uses_eval_mode_without_grad_and_restores_training(samples):
    model = Recorder().train()
    s = sp.Sifter(model, sp.CrossEntropy("x", "y"), sp.Uniform(1.0), micro_batch=64)
    for _ in s(samples[:100]):
        assert model.training
    assert model.calls == [(False, False, 64), (False, False, 36)]
    model.eval()
    list(sp.Sifter(model, sp.CrossEntropy("x", "y"), sp.Uniform(1.0), micro_batch=64)(samples[:10]))
    assert not model.training


def test_padding_keeps_shapes_static_and_is_never_counted(samples):
    model = Recorder()
    s = sp.Sifter(model, sp.CrossEntropy("x", "y"), sp.Uniform(1.0), micro_batch=64, pad_micro_batch=True)
    out = list(s(samples[:100]))
    assert [c[2] for c in model.calls] == [64, 64]
    assert len(out) == 100 and s.stats.seen == 100
    batches = collated(samples[:100], 30)
    model.calls.clear()
    s = sp.Sifter(
        model, sp.CrossEntropy("x", "y"), sp.Uniform(1.0), micro_batch=32, batched=True, pad_micro_batch=True
    )
    assert sum(len(b["__key__"]) for b in s(batches)) == 100
    assert {c[2] for c in model.calls} == {32}


def test_autocast_dtype_reaches_the_scorer(samples):
    seen = []

    def scorer(model, batch):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return batch["loss"].double()

    list(sp.Sifter(None, scorer, sp.Uniform(1.0), autocast=torch.bfloat16)(samples[:10]))
    assert seen == [torch.bfloat16]


def test_oom_split_retries_in_halves(samples):
    calls = []

    def scorer(model, batch):
        n = len(batch["__key__"])
        calls.append(n)
        if n > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch["loss"].double()

    a = output_keys(
        sp.Sifter(None, scorer, sp.TopFraction(0.5), micro_batch=64, on_oom="split")(samples[:64])
    )
    assert calls == [64, 32, 16, 16, 32, 16, 16]
    b = output_keys(sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=64)(samples[:64]))
    assert a == b
    with pytest.raises(sp.ScorerError, match=r"out of memory.*seq 0.*'s000000'.*on_oom='split'"):
        list(sp.Sifter(None, scorer, sp.TopFraction(0.5), micro_batch=64)(samples[:64]))


def test_stats_track_time_and_counts(samples):
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=100)
    it = s(samples)
    next(it)
    assert s.stats.seen == 100 and s.stats.micro_batches == 1
    list(it)
    st = s.stats
    assert st.seen == 600 and st.score_seconds > 0 and st.decide_seconds > 0
    assert st.keep_rate == st.kept / 600
    # two stages that decided alike compare equal, however long each took
    again = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=100)
    list(again(samples))
    assert again.stats == st and again.stats.decide_seconds != st.decide_seconds


def test_epochs_count_passes_unless_set(samples):
    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=100)
    list(s(samples[:10]))
    assert s.epoch == 0
    list(s(samples[:10]))
    assert s.epoch == 1
    s.set_epoch(7)
    list(s(samples[:10]))
    assert s.epoch == 7
    list(s(samples[:10]))
    assert s.epoch == 8


def test_refuses_to_run_in_a_dataloader_worker(samples):
    class Sifted(torch.utils.data.IterableDataset):
        def __iter__(self):
            return sp.Sifter(None, loss_field, sp.Uniform(1.0))(samples)

    loader = torch.utils.data.DataLoader(Sifted(), batch_size=None, num_workers=1)
    with pytest.raises(Exception, match="inside DataLoader worker 0.*stale weights"):
        list(loader)


def test_device_is_the_models_and_a_moved_scorer_output_is_refused(samples):
    s = sp.Sifter(torch.nn.Linear(2, 2), loss_field)
    assert s.device == torch.device("cpu")
    s = sp.Sifter(None, lambda m, b: torch.zeros(len(b["__key__"])), device="meta")
    with pytest.raises(sp.ScorerOutputError, match="losses on cpu.*scores on meta"):
        list(s(samples[:4]))


def test_printed_stats_show_the_keep_rate(samples):
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=64)
    list(s(samples[:128]))
    text = repr(s.stats)
    assert "keep_rate=0.5000" in text and "seen=128" in text and "kept=64" in text


def _zero_losses(model, items):
    return torch.zeros(len(items), dtype=torch.float64)


def test_a_spent_iterator_given_again_warns_that_its_pass_read_nothing():
    import warnings

    def stage():
        return sp.Sifter(None, _zero_losses, sp.Uniform(1.0), micro_batch=4, collate_fn=list, seed=0)

    s = stage()
    spent = iter(range(10))
    assert len(list(s(spent))) == 10
    message = r"pass of epoch 1 read nothing .* range_iterator.* 10 samples"
    with pytest.warns(sp.EmptyPassWarning, match=message):
        assert list(s(spent)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(s(spent)) == []  # once per stage
        # an iterable that starts over, an empty first pass and a pass that reads are all quiet
        again = stage()
        for _ in range(3):
            assert len(list(again(list(range(6))))) == 6
        empty_first = stage()
        assert list(empty_first([])) == []
        assert len(list(empty_first(range(3)))) == 3


def test_an_empty_slice_after_a_checkpoint_at_a_passs_end_is_named_as_such():
    # the slip README's resume example once invited: state["consumed"] of a state taken after the
    # pass ended is the whole pass, and the next pass (a new one) must read the whole source
    data = list(range(8))
    s = sp.Sifter(None, _zero_losses, sp.Uniform(1.0), micro_batch=4, collate_fn=list, seed=0)
    assert list(s(data)) == data
    state = s.state_dict()
    resumed = sp.Sifter(None, _zero_losses, sp.Uniform(1.0), micro_batch=4, collate_fn=list, seed=0)
    resumed.load_state_dict(state)
    assert state["consumed"] == 8 and resumed.resume_from is None
    with pytest.warns(sp.EmptyPassWarning, match=r"\(a list\).*state\['consumed'\].*resume_from is None"):
        assert list(resumed(data[state["consumed"] :])) == []
    again = sp.Sifter(None, _zero_losses, sp.Uniform(1.0), micro_batch=4, collate_fn=list, seed=0)
    again.load_state_dict(state)
    assert list(again(data[again.resume_from or 0 :])) == data  # README's way


def test_a_pass_resumed_at_its_end_reads_nothing_and_does_not_warn():
    import warnings

    s = sp.Sifter(None, _zero_losses, sp.Uniform(1.0), micro_batch=4, collate_fn=list, seed=0)
    data = list(range(8))
    it = s(data)
    got = [next(it) for _ in range(8)]
    state = s.state_dict()
    resumed = sp.Sifter(None, _zero_losses, sp.Uniform(1.0), micro_batch=4, collate_fn=list, seed=0)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rest = list(resumed(data[resumed.consumed :]))
    assert got == data and rest == []


def _index_batches(n, rows=64):
    return (
        {"__key__": torch.arange(i, min(n, i + rows)), "x": torch.zeros(min(rows, n - i), 2)}
        for i in range(0, n, rows)
    )


def test_a_recipe_whose_loop_never_calls_observe_warns_that_it_sifts_nothing():
    n = 256
    s = sp.recipe(None, "cross_entropy", budget=4 * n, batched=True, output_batch=32, seed=0)
    list(s(_index_batches(n)))  # the first pass: its losses may still be handed back after it
    message = r"512 samples have been kept unknown by epoch 1.*observe\("
    with pytest.warns(sp.ScoreMemoryWarning, match=message):
        list(s(_index_batches(n)))
    assert s.stats.unknown == 2 * n and s.stats.observed == 0 and s.stats.dropped == 0


def test_a_recipe_fed_by_observe_or_a_loaded_memory_does_not_warn():
    import warnings

    n = 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fed = sp.recipe(None, "cross_entropy", budget=4 * n, batched=True, output_batch=32, seed=0)
        for epoch in range(3):
            fed.set_epoch(epoch)
            for batch in fed(_index_batches(n)):
                fed.observe(batch["__key__"], torch.rand(len(batch["__key__"])))
        assert fed.stats.dropped > 0
        loaded = sp.recipe(None, "cross_entropy", budget=4 * n, batched=True, output_batch=32, seed=0)
        assert loaded.memory is not None and fed.memory is not None
        loaded.memory.load_state_dict(fed.memory.state_dict())  # losses from elsewhere, no observe
        for epoch in range(3, 5):
            loaded.set_epoch(epoch)
            list(loaded(_index_batches(n)))


def test_a_job_restarted_every_epoch_that_never_observes_is_warned_too():
    # one pass per process: the passes before the checkpoint count
    n = 128
    state = None
    for epoch in range(2):
        s = sp.recipe(None, "cross_entropy", budget=4 * n, batched=True, output_batch=32, seed=0)
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch)
        if epoch == 0:
            list(s(_index_batches(n)))
        else:
            with pytest.warns(sp.ScoreMemoryWarning, match="kept unknown by epoch 1"):
                list(s(_index_batches(n)))
        state = s.state_dict()


def test_a_loop_whose_losses_are_never_finite_is_warned_too():
    """observe() called every step with NaN losses (a masked mean divided by zero, an overflow):
    the memory ignores them, so nothing was ever sifted, and nothing said so (found by review)."""
    n = 128
    s = sp.recipe(None, "cross_entropy", budget=4 * n, batched=True, output_batch=32, seed=0)
    with pytest.warns(sp.ScoreMemoryWarning, match=r"observe\(\) got 256 losses and not one was finite"):
        for epoch in range(2):
            s.set_epoch(epoch)
            for batch in s(_index_batches(n)):
                s.observe(batch["__key__"], torch.full((len(batch["__key__"]),), float("nan")))
    assert s.stats.dropped == 0


def test_samples_read_before_the_source_fails_are_decided_and_handed_on_first():
    """A per-sample micro-batch is read item by item: when the source raises partway, the items
    already read were lost with the error. Now they are decided and handed on, and the error is
    raised at the next read."""
    samples = make_samples(25, seed=3)

    def failing():
        yield from samples
        raise OSError("the source broke after 25 samples")

    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=10)
    out = []
    with pytest.raises(OSError, match="after 25 samples"):
        for x in s(failing()):
            out.append(x["__key__"])
    assert out == [x["__key__"] for x in samples] and s.stats.seen == 25
    # rows waiting for a full output batch too: a short batch, then the error
    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=10, output_batch=8)
    out = []
    with pytest.raises(OSError, match="after 25 samples"):
        for batch in s(failing()):
            out.extend(batch["__key__"])
    assert out == [x["__key__"] for x in samples]


def _read_source(samples, closed):
    """A generator source that records when its pass is closed (its finally runs)."""
    try:
        yield from samples
    finally:
        closed.append(True)


def test_reading_a_pass_after_the_next_call_opened_a_new_one_raises_and_does_not_end_quietly(samples):
    # the second call closes the first pass: its consumer reading on got a normal end of epoch (the
    # rest of the epoch untrained, silently); two streams sharing one Sifter (train and validation
    # zipped) ended after one item
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=32, seed=1)
    closed = []
    first = s(_read_source(samples, closed))
    assert next(first)["__key__"] < "s000032"
    second = s(samples)
    assert closed == [True]  # the first pass let its source go when it was closed, not later
    with pytest.raises(sp.PassClosedError, match=r"sifter\(\.\.\.\) was called again") as err:
        next(first)
    assert "one Sifter per pipeline" in str(err.value)
    with pytest.raises(StopIteration):
        next(first)  # raised once: then an ended iterator
    assert len(list(second)) == 300  # the new pass is whole
    with pytest.raises(sp.PassClosedError):
        list(zip(s(samples), s(samples)))


def test_a_pass_never_read_before_the_next_call_raises_when_read(samples):
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=32, seed=1)
    unread = s(samples)
    newer = s(samples)
    with pytest.raises(sp.PassClosedError, match="called again"):
        next(unread)
    assert len(list(newer)) == 300 and s.stats.seen == 600 and s.epoch == 0  # unread: same epoch


def test_reading_a_pass_after_a_load_or_close_says_which(samples):
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=32, seed=1)
    it = s(samples)
    next(it)
    state = s.state_dict()
    s.load_state_dict(state)
    with pytest.raises(sp.PassClosedError, match="load_state_dict"):
        next(it)
    resumed = s(samples[state["consumed"] :])
    assert len(list(resumed)) == 299  # the load's pass goes on, whole
    it = s(samples)
    next(it)
    s.close()
    with pytest.raises(sp.PassClosedError, match="closed"):
        next(it)


def test_a_call_while_another_thread_reads_the_pass_is_refused_and_changes_nothing(samples):
    import threading

    inside, release = threading.Event(), threading.Event()

    def source():
        for i, sample in enumerate(samples):
            if i == 40:
                inside.set()
                release.wait(30)
            yield sample

    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=32, seed=1)
    it = s(source())
    out = []
    reader = threading.Thread(target=lambda: out.extend(it))
    reader.start()
    assert inside.wait(30)
    try:
        # a raw "ValueError: generator already executing" before, from inside the stage
        with pytest.raises(sp.PassClosedError, match="another thread"):
            s(samples)
    finally:
        release.set()
        reader.join(30)
    assert len(out) == 300 and s.stats.seen == 600 and s.epoch == 0


@pytest.mark.parametrize("call", ["open", "state_dict", "close"])
def test_a_call_back_from_inside_the_pass_says_so_not_another_thread(samples, call):
    # found 2026-12-05 (fourth session): a scorer that called its own Sifter was told that
    # another thread read the pass
    def scorer(model, batch):
        if call == "open":
            s(samples[:4])
        else:
            getattr(s, call)()
        return loss_field(model, batch)

    s = sp.Sifter(None, scorer, sp.TopFraction(0.5), micro_batch=32, seed=1)
    with pytest.raises(sp.ScorerError, match="called back from inside its own running pass") as caught:
        list(s(samples))
    assert isinstance(caught.value.__cause__, sp.PassClosedError)
    assert "another thread" not in str(caught.value)
    assert s.stats.seen == 0


def _zeros(model, batch):
    return torch.zeros(len(batch["__key__"]))


def test_drop_last_needs_output_batch_and_drops_a_short_pass_whole_as_a_dataloader_does():
    with pytest.raises(sp.ConfigError, match="drop_last=True .* needs output_batch"):
        sp.Sifter(None, "cross_entropy", "uniform", batched=True, drop_last=True)
    s = sp.Sifter(None, _zeros, sp.Uniform(1.0), batched=True, output_batch=32, drop_last=True)
    s.drop_last = "yes"  # set after construction: checked before the pass runs
    with pytest.raises(sp.ConfigError, match="drop_last must be True or False"):
        list(s(_index_batches(8)))
    s.drop_last = True
    # 20 rows kept, no full batch: nothing handed on, as DataLoader(drop_last=True) would, and
    # said once (a pass that trains nothing is not silent)
    with pytest.warns(sp.EmptyPassWarning, match=r"kept 20 samples, fewer than output_batch=32"):
        assert list(s(_index_batches(20))) == []
    assert s.stats.unhanded == 20 and s.stats.kept == 20


@pytest.mark.parametrize("fail", ["source", "scorer"])
def test_drop_last_holds_when_a_pass_ends_with_an_error(fail):
    # found by review: a pass ending with an error handed its short batch on first
    def source():
        yield from _index_batches(100)
        if fail == "source":
            raise OSError("shard read failed")

    def scorer(model, batch):
        if fail == "scorer" and int(batch["__key__"][0]) >= 64:
            raise RuntimeError("scorer broke")
        return torch.zeros(len(batch["__key__"]))

    s = sp.Sifter(
        None, scorer, sp.Uniform(1.0), batched=True, micro_batch=None, output_batch=48, drop_last=True
    )
    sizes = []
    with pytest.raises((OSError, sp.ScorerError)):
        for b in s(source()):
            sizes.append(len(b["__key__"]))
    assert set(sizes) == {48} and s.stats.unhanded == s.stats.kept - sum(sizes) > 0


def test_a_short_last_batch_under_cudnn_benchmark_warns_once_to_use_drop_last(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    s = sp.Sifter(None, _zeros, sp.Uniform(1.0), batched=True, output_batch=32)
    with pytest.warns(sp.BatchShapeWarning, match=r"drop_last=True"):
        sizes = [len(b["__key__"]) for b in s(_index_batches(100))]
    assert sizes == [32, 32, 32, 4]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s(_index_batches(100)))  # once per stage
        dropping = sp.Sifter(None, _zeros, sp.Uniform(1.0), batched=True, output_batch=32, drop_last=True)
        assert [len(b["__key__"]) for b in dropping(_index_batches(100))] == [32, 32, 32]
        assert dropping.stats.unhanded == 4
    # batched without output_batch: every batch is the kept part of an input batch, of its own size
    filtered = sp.Sifter(None, _zeros, sp.Uniform(0.5), batched=True, seed=0)
    with pytest.warns(sp.BatchShapeWarning, match=r"output_batch=<the training batch size> and drop_last"):
        sizes = [len(b["__key__"]) for b in filtered(_index_batches(100))]
    assert len(set(sizes)) > 1


def test_drop_last_resumed_from_any_checkpoint_hands_on_what_the_uninterrupted_run_did():
    # found by review: a pass resumed after its last full batch handed its short batch on, since
    # the rule then looked at what the resumed pass alone had handed on
    from torch.utils.data import default_collate

    samples = make_samples(300, seed=8)
    batches = [default_collate(samples[i : i + 50]) for i in range(0, 300, 50)]

    def make():
        return sp.Sifter(
            None, loss_field, sp.Uniform(0.7), micro_batch=None, output_batch=32, batched=True,
            drop_last=True, seed=1,
        )  # fmt: skip

    def run(stage, first_epoch, source, out):
        for epoch in range(first_epoch, 3):
            if epoch != first_epoch or source is None:
                stage.set_epoch(epoch)
            out.extend((epoch, list(b["__key__"])) for b in stage(batches if source is None else source))
            source = None

    ref = make()
    expected: list = []
    run(ref, 0, None, expected)
    assert ref.stats.unhanded > 0
    for cut in range(1, len(expected) + 1):
        stage, got, state = make(), [], None
        for epoch in range(3):
            stage.set_epoch(epoch)
            for b in stage(batches):
                got.append((epoch, list(b["__key__"])))
                if len(got) == cut:
                    state = stage.state_dict()  # taken while the pass is open, as a trainer's
                    break
            if state is not None:
                break
        resumed = make()
        resumed.load_state_dict(state)
        at = resumed.resume_from
        run(resumed, resumed.epoch, batches[at:] if at is not None else None, got)
        assert got == expected, cut
        assert (resumed.stats.kept, resumed.stats.unhanded) == (ref.stats.kept, ref.stats.unhanded), cut
