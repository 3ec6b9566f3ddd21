"""A scorer that raises: the error names the micro-batch and its keys, in every mode; out of
memory with on_oom="split" re-scores in halves and decides exactly as if memory had sufficed,
with padding and in batched mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import siftpipe as sp
from tests.common import loss_field, make_samples
from tests.contract import output_keys, signature

SAMPLES = make_samples(100, seed=2)


def rows(batch):
    return len(batch["__key__"])


def test_a_scorer_error_in_batched_mode_names_the_chunk_and_its_keys():
    batches = [default_collate(SAMPLES[i : i + 40]) for i in range(0, 100, 40)]
    calls = []

    def scorer(model, batch):
        calls.append(rows(batch))
        if len(calls) == 2:
            raise ValueError("shape mismatch in layer 3")
        return batch["loss"].double()

    s = sp.Sifter(None, scorer, sp.Uniform(0.5), batched=True, micro_batch=16)
    with pytest.raises(
        sp.ScorerError,
        match=r"ValueError: shape mismatch in layer 3 on the micro-batch of 16 samples at seq 16 "
        r"\(keys \['s000016', 's000017', 's000018', 's000019', \.\.\. 12 more\]\)",
    ):
        list(s(batches))
    assert s.stats.seen == 0  # nothing of the failed batch was decided


def test_out_of_memory_on_a_single_sample_names_it_and_the_ways_out():
    def scorer(model, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    s = sp.Sifter(None, scorer, sp.Uniform(0.5), micro_batch=8, on_oom="split")
    with pytest.raises(sp.ScorerError) as err:
        list(s(SAMPLES))
    text = str(err.value)
    assert "OutOfMemoryError" in text and "micro-batch of 1 samples at seq 0" in text and "'s000000'" in text
    assert "on_oom='split'" in text and "lower micro_batch" in text
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 90),
    micro_batch=st.integers(1, 40),
    limit=st.integers(1, 40),
    batched=st.booleans(),
    pad=st.booleans(),
    whole=st.booleans(),
)
def test_split_on_out_of_memory_decides_exactly_as_without_it(n, micro_batch, limit, batched, pad, whole):
    data = SAMPLES[:n]
    source = (
        [default_collate(data[i : i + micro_batch]) for i in range(0, n, micro_batch)] if batched else data
    )
    chunk = None if (batched and whole) else micro_batch
    seen_rows = []

    def tight(model, batch):
        seen_rows.append(rows(batch))
        if rows(batch) > limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch["loss"].double()

    def make(scorer, **kw):
        return sp.Sifter(
            None,
            scorer,
            sp.RelativeProbabilistic(1.0, 50),
            batched=batched,
            micro_batch=chunk,
            pad_micro_batch=pad and chunk is not None,
            output_batch=7,
            seed=3,
            **kw,
        )

    expected = list(make(loss_field)(source))
    s = make(tight, on_oom="split")
    got = list(s(source))
    assert [signature(b) for b in got] == [signature(b) for b in expected]
    assert s.stats.seen == n and s.stats.kept == len(output_keys(got))
    assert min(seen_rows) >= 1 and max(r for r in seen_rows if r <= limit) <= limit


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_rows_kept_before_a_scoring_error_are_handed_on_before_it(failure, tmp_path):
    """Rows kept, recorded as kept, and waiting for a full output batch were lost when a later
    micro-batch's scoring failed (found by review: the log said 8 kept, none reached training).
    Now they come out as a short batch, then the error, as on a source's error."""
    calls = []

    def scorer(model, batch):
        calls.append(1)
        if len(calls) == 3:
            if failure == "raises":
                raise RuntimeError("CUDA error: device-side assert")
            return batch["loss"].double() * float("nan")
        return batch["loss"].double()

    s = sp.Sifter(None, scorer, sp.Uniform(1.0), micro_batch=4, output_batch=16, audit=str(tmp_path))
    got = []
    error = sp.ScorerError if failure == "raises" else sp.NonFiniteLossError
    with pytest.raises(error):
        for batch in s(SAMPLES):
            got.extend(batch["__key__"])
    s.close()
    assert got == [x["__key__"] for x in SAMPLES[:8]]
    log = sp.read_log(str(tmp_path), kept=True)
    assert log.column("key").to_pylist() == got  # what the log says was kept was handed on


@pytest.mark.parametrize("failure", ["nan", "raises"])
@pytest.mark.parametrize("memory", [False, True])
def test_the_state_after_a_failed_group_loads_and_counts_only_decided_rows(failure, memory):
    # found by review (2026-12-05): scoring forwards were counted before the group was decided;
    # a NaN raised (on_nan="raise", the default) or a scorer error left scored > seen, and the
    # stage's own state_dict() was refused by load_state_dict() as "damaged"
    samples = make_samples(12, seed=3)
    calls = []

    def scorer(model, batch):
        calls.append(len(batch["__key__"]))
        losses = batch["loss"].double().clone()
        if len(calls) == 3:
            if failure == "raises":
                raise RuntimeError("a transient fault")
            losses[1] = float("nan")
        return losses

    def make():
        return sp.Sifter(
            None, scorer, sp.Uniform(0.5), micro_batch=4, memory=sp.ScoreMemory(100) if memory else None
        )

    sifter = make()
    error = sp.NonFiniteLossError if failure == "nan" else sp.ScorerError
    with pytest.raises(error):
        for _ in sifter(samples):
            pass
    stats = sifter.stats
    assert stats.seen == 8 and stats.scored == 8 and stats.kept + stats.dropped == 8
    again = make()
    again.load_state_dict(sifter.state_dict())  # refused as damaged before
    assert again.stats.seen == 8 and again.stats.scored == 8


@pytest.mark.parametrize("kwargs", [{"output_batch": 5}, {"output_batch": 5, "drop_last": True}, {}])
def test_consumed_after_a_failed_pass_stands_after_the_groups_decided(kwargs):
    # found by review (2026-12-05): after a NaN ended the pass, consumed said 4 (the rows handed
    # on with the error not counted) or 12 (the group that failed, never decided, counted)
    samples = make_samples(12, seed=5)

    def scorer(model, batch):
        losses = batch["loss"].double().clone()
        if "s000008" in list(batch["__key__"]):  # the third micro-batch: s000008..s000011
            losses[1] = float("nan")
        return losses

    s = sp.Sifter(None, scorer, sp.Uniform(1.0), micro_batch=4, **kwargs)
    with pytest.raises(sp.NonFiniteLossError):
        for _ in s(samples):
            pass
    assert s.stats.seen == 8 and s.consumed == 8


def test_a_group_that_fails_after_it_was_counted_has_its_kept_rows_counted_unhanded(tmp_path):
    # found by review (2026-12-05): a group counted (seen, kept) whose audit keys then failed was
    # taken off the pending list with the groups never decided: its kept rows neither handed on
    # nor counted unhanded
    samples = make_samples(12, seed=5)

    def key(sample):
        if sample["__key__"] == "s000009":
            raise ValueError("no key for s000009")
        return sample["__key__"]

    s = sp.Sifter(
        None,
        lambda m, b: b["loss"].double(),
        sp.Uniform(1.0),
        micro_batch=4,
        output_batch=5,
        key=key,
        audit=sp.AuditLog(str(tmp_path / "log"), run_id="k"),
    )
    handed = 0
    with pytest.raises(Exception, match="no key for s000009"):
        for batch in s(samples):
            handed += len(batch["__key__"])
    stats = s.stats
    assert stats.kept == handed + stats.unhanded
    s.close()


def test_one_sample_without_its_key_is_named_in_the_error_not_every_sample():
    """One of eight samples lacked '__key__' (no memory, no audit log): the collate error said
    "no sample keys: samples carry no key field" and advised a collate_fn, and a NaN error said
    the same though seven had keys (found by review, 2026-12-05)."""
    model = torch.nn.Linear(4, 3)

    def ce(m, b):
        return torch.nn.functional.cross_entropy(m(b["x"]), b["y"], reduction="none")

    data = [{"x": torch.randn(4), "y": torch.tensor(i % 3), "__key__": f"k{i}"} for i in range(8)]
    del data[2]["__key__"]
    with pytest.raises(
        sp.ScorerError, match=r"\['k0', 'k1', None, 'k3'\].*sample seq 2 has no key while others do"
    ):
        list(sp.Sifter(model, ce, micro_batch=4, seed=0)(data))

    def nan(m, b):
        return torch.full((len(b["x"]),), float("nan"))

    # a failure the missing key did not cause (ragged tensors; default_collate takes the first
    # sample's fields, so it never looked for the key): the usual advice
    ragged = [dict(d, x=torch.randn(3 if i == 0 else 4)) for i, d in enumerate(data)]
    del ragged[0]["__key__"]
    with pytest.raises(sp.ScorerError, match="give the Sifter a collate_fn") as caught:
        list(sp.Sifter(model, ce, micro_batch=4, seed=0)(ragged))
    assert "has no key" not in str(caught.value)

    xs = lambda items: {"x": torch.stack([s["x"] for s in items])}  # noqa: E731
    with pytest.raises(sp.NonFiniteLossError, match=r"keys \['k0', 'k1', None, 'k3'\]"):
        list(sp.Sifter(model, nan, micro_batch=4, seed=0, collate_fn=xs)(data))


def test_a_batch_of_numpy_arrays_given_to_a_model_says_to_convert_them():
    """A collated batch of numpy arrays scored by a model: torch's "linear(): argument 'input'
    must be Tensor, not numpy.ndarray" named neither the field nor the fix (found by review,
    2026-12-05)."""
    import numpy as np

    model = torch.nn.Linear(3, 4)
    batch = {"__key__": [f"k{i}" for i in range(5)], "x": np.random.randn(5, 3).astype(np.float32),
             "y": np.random.randint(0, 4, 5)}  # fmt: skip
    s = sp.Sifter(model, sp.CrossEntropy("x", "y"), sp.Uniform(0.5), batched=True, micro_batch=None)
    with pytest.raises(sp.ScorerError, match=r"numpy arrays where the model takes tensors.*torch.as_tensor"):
        list(s([batch]))
