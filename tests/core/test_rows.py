"""siftpipe.core.rows: a group's keys, fields, weights and upstream decisions, per-sample and batched."""

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.core.ledger import Group
from siftpipe.core.rows import (
    attach_weights,
    field_of,
    keys_of,
    upstream_of,
)
from siftpipe.core.vocab import PRE_KEPT, PRE_LOSS, PRE_PROB
from tests.common import roundtrip


def per_sample(n=3):
    return Group([{"__key__": f"k{i}", "__url__": "a.tar", "x": i} for i in range(n)], n, 10, None)


def batched(n=3):
    batch = {"__key__": [f"k{i}" for i in range(n)], "x": torch.arange(n), "id": torch.arange(n) * 7}
    return Group([batch], n, 10, None)


def test_keys_by_field_position_or_callable_in_both_modes():
    assert keys_of(per_sample(), False, "__key__") == ["k0", "k1", "k2"]
    assert keys_of(batched(), True, "__key__") == ["k0", "k1", "k2"]
    assert keys_of(batched(), True, "id") == [0, 7, 14]  # a tensor column becomes plain ints
    assert keys_of(per_sample(), False, lambda s: s["x"] * 2) == [0, 2, 4]
    assert keys_of(batched(), True, lambda b: b["x"].tolist()) == [0, 1, 2]
    tuples = Group([("a", 1), ("b", 2)], 2, 0, None)
    assert keys_of(tuples, False, 0) == ["a", "b"]
    assert keys_of(per_sample(), False, None) is None


def test_a_missing_key_is_none_unless_required_then_it_names_the_sample_and_the_fix():
    group = per_sample()
    del group.items[1]["__key__"]
    assert keys_of(group, False, "__key__") is None
    with pytest.raises(
        sp.MissingKeyError, match=r"sample seq 11 has no key field '__key__'.*the score memory"
    ) as memory_error:
        keys_of(group, False, "__key__", required=True, purpose="the score memory")
    # a score memory refuses key=None: its message must not offer it (found by review); an
    # audit log can do without keys
    assert "key=None" not in str(memory_error.value)
    with pytest.raises(sp.MissingKeyError, match="key=None to log without keys"):
        keys_of(group, False, "__key__", required=True)
    with pytest.raises(sp.MissingKeyError, match=r"input batch at sample seq 10 has no key field 'nope'"):
        keys_of(batched(), True, "nope", required=True)


def test_fields_are_read_where_present():
    assert field_of(per_sample(), False, "__url__") == ["a.tar"] * 3
    assert field_of(per_sample(), False, "__worker__") is None
    assert field_of(batched(), True, "x") == [0, 1, 2]
    assert field_of(batched(), True, "__url__") is None


def test_weights_go_on_kept_rows_as_copies():
    group = per_sample()
    original = [dict(s) for s in group.items]
    group.kept_index = np.array([0, 2])
    group.weight = np.array([2.0, 1.0, 0.5])
    before = list(group.items)
    attach_weights(group, False, "w")
    assert [s.get("w") for s in group.items] == [2.0, None, 0.5]
    assert [dict(s) for s in before] == original  # the caller's samples are untouched
    tuples = Group([("a", 1), ("b", 2)], 2, 0, None)
    tuples.kept_index = np.array([1])
    attach_weights(tuples, False, "w")
    assert tuples.items == [("a", 1), ("b", 2, 1.0)]  # no weight decided: 1
    group = batched()
    group.weight = np.array([2.0, 1.0, 0.5])
    attach_weights(group, True, "__sift_weight__")
    assert group.items[0]["__sift_weight__"].tolist() == [2.0, 1.0, 0.5]
    assert group.items[0]["__sift_weight__"].dtype == torch.float32


def test_upstream_decisions_are_read_only_when_some_row_was_kept_before_decode():
    assert upstream_of(per_sample(), False) is None
    rows = [{PRE_KEPT: k, PRE_LOSS: float(i), PRE_PROB: 0.5} for i, k in enumerate([1, 0, 1])]
    mask, loss, prob = upstream_of(Group(rows, 3, 0, None), False)
    assert mask.tolist() == [True, False, True] and loss.tolist() == [0.0, 1.0, 2.0]
    assert prob.tolist() == [0.5] * 3
    none_kept = [{**r, PRE_KEPT: 0} for r in rows]
    assert upstream_of(Group(none_kept, 3, 0, None), False) is None
    batch = {PRE_KEPT: torch.tensor([0, 1]), PRE_LOSS: torch.tensor([1.0, 2.0]), PRE_PROB: torch.ones(2)}
    mask, loss, _ = upstream_of(Group([batch], 2, 0, None), True)
    assert mask.tolist() == [False, True] and loss.tolist() == [1.0, 2.0]


def test_a_list_of_python_ints_is_read_as_one_integer_array_and_names_the_same_samples():
    from siftpipe.core.memory import FEEDBACK
    from siftpipe.core.rows import integer_keys, memory_keys

    got = memory_keys([3, 1, 2])
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.tolist() == [3, 1, 2]
    # only exact ints: True is the key "True", not 1; a float, a str or a 65-bit int stay a list
    for keys in ([1, True], [1, 2.0], [1, "2"], [2**64, 1], []):
        assert integer_keys(keys) is None and memory_keys(keys) == list(keys)
    # the memory finds them as it finds the same indices in a tensor or as strings
    memory = sp.ScoreMemory(100)
    memory.update_keys(memory_keys([7, 8, 9]), np.array([1.0, 2.0, 3.0], dtype=np.float32), 0, FEEDBACK)
    assert memory.lookup_keys(memory_keys(torch.tensor([9, 7])), 1)[0].tolist() == [3.0, 1.0]
    assert memory.lookup_keys(["8", "9"], 1)[0].tolist() == [2.0, 3.0]
    assert np.isnan(memory.lookup_keys([True], 1)[0]).all()


@pytest.mark.parametrize(
    "batch, message",
    [
        ({"x": torch.zeros(8, 2), "__key__": [f"k{i}" for i in range(6)]}, r"8 rows .* '__key__' has 6"),
        ({"__key__": [f"k{i}" for i in range(10)], "x": torch.zeros(8, 2)}, r"10 rows .* 'x' has 8"),
        ({"x": torch.zeros(8, 2), "y": torch.zeros(6)}, r"8 rows .* 'y' has 6"),
        ((torch.zeros(8, 2), {"y": np.zeros(7)}), r"8 rows .* position 1\['y'\] has 7"),
    ],
)
def test_a_batch_whose_fields_disagree_on_its_rows_is_an_error_naming_the_field(batch, message):
    """Keys longer than the rows were dropped silently, shorter ones failed with an IndexError
    after deciding, a short label column was blamed on the scorer (found by review)."""
    s = sp.Sifter(None, lambda m, b: torch.zeros(8, dtype=torch.float64), sp.Uniform(1.0), batched=True)
    with pytest.raises(sp.BatchError, match=r"input batch at sample seq 0 holds " + message):
        list(s([batch]))
    assert s.stats.seen == 0  # nothing decided


def test_fields_that_are_not_per_row_pass_the_row_check():
    batch = {
        "x": torch.zeros(4, 2),
        "scale": torch.tensor(2.0),
        "__key__": ["a", "b", "c", "d"],
        "name": "run",
    }
    s = sp.Sifter(None, lambda m, b: torch.ones(4, dtype=torch.float64), sp.Uniform(1.0), batched=True)
    out = list(s([batch]))
    assert out[0]["__key__"] == ["a", "b", "c", "d"] and out[0]["name"] == "run"


@pytest.mark.parametrize("tags", [False, True])
def test_a_field_holding_one_dict_per_sample_is_taken_row_by_row(tags):
    """WebDataset collates a `json` field to a list of one dict per sample (so do detection
    labels): it was read as a list of columns, so kept rows came out with every sample's dict
    (misaligned, silently), or, with a list inside the dicts, a BatchError blaming the collate_fn
    (found by review). A list of dicts that is a field holds rows; the batch itself, collated
    from (dict, ...) tuples, still holds columns."""

    def batches():
        for i in range(6):
            yield {
                "__key__": [f"{i}-{j}" for j in range(8)],
                "x": torch.arange(8, dtype=torch.float64) + i,
                "json": [{"id": f"{i}-{j}", **({"tags": ["a", "b", "c"]} if tags else {})} for j in range(8)],
            }

    s = sp.Sifter(None, lambda m, b: b["x"], sp.Uniform(0.5), batched=True, micro_batch=None, output_batch=5)
    out = list(s(batches()))
    assert sum(len(b["__key__"]) for b in out) == s.stats.kept < 48
    for b in out:
        assert [d["id"] for d in b["json"]] == b["__key__"]
    columns = [torch.zeros(8, 2), {"y": torch.arange(8)}]  # a (tensor, dict) sample collated
    t = sp.Sifter(None, lambda m, b: b[1]["y"].double(), sp.Uniform(1.0), batched=True, key=None)
    assert torch.equal(next(iter(t([columns])))[1]["y"], torch.arange(8))


def test_a_field_holding_one_tensor_or_list_per_sample_of_different_sizes_is_taken_row_by_row():
    """Detection boxes or token lists from a collate_fn of one's own (a list of one tensor, or
    list, per sample) were read as default_collate's columns: a BatchError blaming the collate_fn,
    or, where each held as many rows as the batch, every sample's value cut to the kept rows
    silently (found by review, 2026-12-05). Different sizes now mark the field as one per row,
    through micro-batches, re-batching and a checkpoint that holds rows waiting for a batch."""

    def batches():
        for i in range(6):
            yield {
                "__key__": [f"{i}-{j}" for j in range(8)],
                "x": torch.arange(8, dtype=torch.float64) + i,
                "boxes": [torch.full((j % 3 + 1, 4), float(10 * i + j)) for j in range(8)],
                "tokens": [list(range(j + 1)) for j in range(8)],
                "size": [torch.tensor(10 * i + j) for j in range(8)],  # 0-d: one per row too
            }

    def check(out):
        for b in out:
            ids = [10 * int(k.split("-")[0]) + int(k.split("-")[1]) for k in b["__key__"]]
            assert [int(t[0, 0]) for t in b["boxes"]] == ids
            assert [t.shape[0] for t in b["boxes"]] == [i % 10 % 3 + 1 for i in ids]
            assert [len(t) for t in b["tokens"]] == [i % 10 + 1 for i in ids]
            assert [int(t) for t in b["size"]] == ids

    def make():
        return sp.Sifter(
            None, lambda m, b: b["x"], sp.Uniform(0.5), batched=True, micro_batch=3, output_batch=5, seed=1
        )

    s = make()
    whole = list(s(batches()))
    check(whole)
    assert sum(len(b["__key__"]) for b in whole) == s.stats.kept < 48
    # a checkpoint between output batches holds kept rows that wait for the next one
    s2 = make()
    it = s2(batches())
    head = [next(it), next(it)]
    state = roundtrip(s2.state_dict())
    s3 = make()
    s3.load_state_dict(state)
    rest = list(s3(list(batches())[s3.resume_from :]))
    check(head + rest)
    assert [b["__key__"] for b in head + rest] == [b["__key__"] for b in whole]


def test_a_field_of_as_many_values_of_as_many_rows_as_the_batch_is_said_to_be_ambiguous():
    """Columns (a tuple field collated) or one value per sample: when every value holds as many
    rows as the batch and there are as many values, the shapes cannot tell; it is read as columns
    and said (found by review, 2026-12-05: cut silently)."""
    import warnings

    square = {
        "__key__": ["a", "b", "c"],
        "x": torch.arange(3.0),
        "boxes": [torch.zeros(3, 4) for _ in range(3)],
    }
    s = sp.Sifter(None, lambda m, b: b["x"].double(), sp.Uniform(1.0), batched=True, micro_batch=None)
    with pytest.warns(sp.BatchShapeWarning, match=r"'boxes' is a list of 3 tensors .* of 3 rows each"):
        list(s([square]))
    collated = {"__key__": ["a", "b", "c"], "x": torch.arange(3.0), "pair": [torch.zeros(3), torch.ones(3)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = list(s([collated]))
    assert torch.equal(out[0]["pair"][1], torch.ones(3))


@pytest.mark.parametrize("boxes_first", [False, True])
def test_per_row_lists_are_cut_the_same_whatever_the_other_fields_and_after_a_resume(boxes_first):
    """Found by review (2026-12-05): a list of 0-d tensors or of (h, w) pairs was cut to the kept
    rows only when another field was ragged, else handed on whole (6 labels for 4 keys); a
    resume re-read marked them regardless; a ragged field first in the batch gave its first
    entry's size as the batch's. Now each such list is one entry per row in every case."""

    def batches(ragged):
        for i in range(4):
            fields = {
                "__key__": [f"{i}-{j}" for j in range(6)],
                "x": torch.arange(6, dtype=torch.float64) + i,
                "label": [torch.tensor(10 * i + j) for j in range(6)],
                "hw": [(10 * i + j, 1) for j in range(6)],
            }
            if ragged:
                boxes = {"boxes": [torch.full((j % 4 + 1, 4), float(10 * i + j)) for j in range(6)]}
                fields = {**boxes, **fields} if boxes_first else {**fields, **boxes}
            yield fields

    def make():
        return sp.Sifter(
            None, lambda m, b: b["x"], sp.Uniform(0.5), batched=True, micro_batch=None, output_batch=4, seed=3
        )

    for ragged in (False, True):
        whole = list(make()(batches(ragged)))
        for b in whole:
            ids = [10 * int(k.split("-")[0]) + int(k.split("-")[1]) for k in b["__key__"]]
            assert [int(t) for t in b["label"]] == ids and [h for h, _ in b["hw"]] == ids
            if ragged:
                assert [int(t[0, 0]) for t in b["boxes"]] == ids
        s = make()
        it = s(batches(ragged))
        head = [next(it)]
        state = roundtrip(s.state_dict())
        again = make()
        again.load_state_dict(state)
        rest = list(again(list(batches(ragged))[again.resume_from :]))
        assert [b["__key__"] for b in head + rest] == [b["__key__"] for b in whole]
        assert [len(b["label"]) for b in head + rest] == [len(b["__key__"]) for b in whole]


@pytest.mark.parametrize("n", [3, 4])
def test_default_collates_nested_columns_stay_columns(n):
    """Found by review (2026-12-05): a sample field holding a list of pairs, collated by
    default_collate into [[t(n), t(n)], ...], was refused, or (with as many samples as pairs)
    marked one per row and its points cut instead of its samples."""
    samples = [
        {"__key__": f"k{i}", "x": float(i), "pts": [(i, 100 + i)] * 3, "tag": ("a", f"b{i}")}
        for i in range(n)
    ]
    batch = default_collate(samples)
    s = sp.Sifter(None, lambda m, b: b["x"].double(), sp.TopFraction(0.5), batched=True, micro_batch=None)
    out = next(iter(s([batch])))
    kept = [int(k[1:]) for k in out["__key__"]]
    assert len(out["pts"]) == 3 and all(
        p[0].tolist() == kept and p[1].tolist() == [100 + i for i in kept] for p in out["pts"]
    )
    assert list(out["tag"][1]) == [f"b{i}" for i in kept]


def test_webdatasets_collated_pairs_are_one_per_row_and_never_cut_inside():
    """webdataset's default collation keeps each sample's (h, w) tuple as it is: in a batch of 4
    they are one entry per row; in a batch of 2, where the shapes cannot tell, they are said to
    be ambiguous and never cut inside a pair (found by review, 2026-12-05)."""
    from webdataset.filters import default_collation_fn

    def batch(ids):
        return default_collation_fn([{"__key__": f"k{i}", "x": float(i), "hw": (i, 100 + i)} for i in ids])

    s = sp.Sifter(
        None,
        lambda m, b: torch.as_tensor(b["x"], dtype=torch.float64),
        sp.TopFraction(0.5),
        batched=True,
        micro_batch=None,
    )
    out = next(iter(s([batch(range(4))])))
    assert [tuple(p) for p in out["hw"]] == [(int(k[1:]), 100 + int(k[1:])) for k in out["__key__"]]
    with pytest.warns(sp.BatchShapeWarning):
        out = next(iter(s([batch([4, 5])])))
    assert all(len(p) == 2 for p in out["hw"])  # whole pairs, whatever the reading


def test_a_list_that_is_neither_columns_nor_one_per_row_is_refused_saying_so():
    # found by a last review (2026-12-05): a dict batch was told such a field "is taken row by
    # row" in the very error that refused it
    batch = {"__key__": ["a", "b", "c"], "x": torch.arange(3.0), "hw": [(1, 2), (3, 4)]}
    s = sp.Sifter(None, lambda m, b: b["x"].double(), sp.Uniform(1.0), batched=True, micro_batch=None)
    with pytest.raises(
        sp.BatchError, match=r"'hw' is a list whose entries are not columns.*check the collate_fn"
    ):
        list(s([batch]))
    pair = (torch.arange(3.0), [torch.tensor(1.0)] * 3)
    t = sp.Sifter(None, lambda m, b: b[0].double(), sp.Uniform(1.0), batched=True, micro_batch=None, key=None)
    with pytest.raises(sp.BatchError, match="use a dict batch"):
        list(t([pair]))


@pytest.mark.parametrize(
    "second, says",
    [
        ({"x": torch.ones(4, 3)}, r"'x' holds \(\d+, 2\) torch.float32 in one input batch and \(\d+, 3\)"),
        ({"x": None}, r"field\(s\) \['x'\] of one input batch are missing from another"),
    ],
    ids=["shape", "missing"],
)
def test_input_batches_that_cannot_be_joined_for_output_batch_name_the_field(second, says):
    """Re-batched kept rows (output_batch) of input batches whose fields differ: a raw torch
    RuntimeError or KeyError naming neither batch nor field (found by review, 2026-12-05)."""

    def batch(i, **fields):
        out = {
            "__key__": [f"k{i}_{j}" for j in range(4)],
            "x": torch.ones(4, 2),
            "loss": torch.rand(4).double(),
        }
        out.update(fields)
        return {k: v for k, v in out.items() if v is not None}

    s = sp.Sifter(
        None, lambda m, b: b["loss"], sp.Uniform(1.0), batched=True, micro_batch=None, output_batch=6
    )
    with pytest.raises(sp.BatchError, match=says):
        list(s([batch(0), batch(1, **second)]))


def test_a_join_error_blames_the_field_that_differs_not_a_column_of_strings():
    """A review of the join error: a tuple of strings (one per row: any count joins) was blamed
    for another field's shape."""
    from siftpipe.core.batch import concat

    a = {"__key__": ("a", "b"), "x": torch.ones(2, 3)}
    b = {"__key__": ("c",), "x": torch.ones(1, 4)}
    with pytest.raises(sp.BatchError, match=r"'x' holds \(2, 3\)"):
        concat([a, b])
    assert concat([a, {"__key__": ("c",), "x": torch.ones(1, 3)}])["__key__"] == ("a", "b", "c")


def test_batches_of_one_row_with_a_per_row_list_field_join_row_by_row():
    """Batch size 1 and a collate_fn keeping each sample's token tensor in a list: a batch whose
    tensor has one token reads as default_collate's column (the same for one row), the others,
    per row; joined by output_batch after a column batch, the tokens of three rows came out as
    one tensor, the other rows' entries missing, nothing said (found by review, 2026-12-05)."""
    lengths = [2, 1, 3, 1, 2, 1]
    batches = [
        {"__key__": [f"k{i}"], "loss": torch.tensor([1.0]), "tok": [torch.arange(10 * i, 10 * i + n)]}
        for i, n in enumerate(lengths)
    ]
    given = {b["__key__"][0]: b["tok"][0] for b in batches}
    stage = sp.Sifter(None, lambda m, b: b["loss"], sp.Uniform(1.0), batched=True, micro_batch=None,
                      output_batch=3, seed=0)  # fmt: skip
    out = list(stage(batches))
    assert [len(b["__key__"]) for b in out] == [3, 3]
    for batch in out:
        assert len(batch["tok"]) == 3
        for key, tokens in zip(batch["__key__"], batch["tok"]):
            assert torch.equal(tokens, given[key])


@pytest.mark.parametrize("output_batch", [20, 48, 32])
def test_rows_held_for_the_next_output_batch_survive_a_source_reusing_its_batch_memory(output_batch):
    """A source that writes each batch into one buffer (a staging ring, FFCV, DALI): the rows of
    a fully kept batch held over for the next output batch pointed into it and were overwritten
    by the next read, handed on twice and others never (found by review, 2026-12-05)."""
    rows, count = 32, 8
    buffer = torch.empty(rows, 1)

    def source():
        for j in range(count):
            buffer.copy_(torch.arange(j * rows, (j + 1) * rows, dtype=torch.float32)[:, None])
            yield {"x": buffer, "__key__": [f"k{i}" for i in range(j * rows, (j + 1) * rows)]}

    s = sp.Sifter(
        None, lambda m, b: torch.ones(len(b["x"])), sp.Uniform(1.0), batched=True, output_batch=output_batch
    )
    got, keys = [], []
    for out in s(source()):  # each output batch used at once, as a training step does
        got += [int(v) for v in out["x"][:, 0].tolist()]
        keys += out["__key__"]
    assert got == list(range(rows * count))
    assert keys == [f"k{i}" for i in got]


@pytest.mark.parametrize("output_batch", [None, 12])
def test_a_tuple_field_of_one_value_per_row_is_cut_to_the_kept_rows(output_batch):
    """A collate_fn built on zip(*samples) gives a field of ints, floats, Nones, 0-d tensors or
    dicts as a tuple: it was read as columns and handed on uncut, every row's value beside the
    kept rows (and with output_batch, the first batch's tuple beside 12 rows), nothing said
    (found by review, 2026-12-05)."""
    kinds = {
        "ints": lambda i: i,
        "floats": lambda i: i / 2,
        "maybe": lambda i: None if i % 3 == 0 else f"s{i}",
        "zero_d": torch.tensor,
        "dicts": lambda i: {"id": i},
    }

    def collate(rows):
        return {
            "x": torch.tensor(rows, dtype=torch.float32)[:, None],
            **{k: tuple(map(f, rows)) for k, f in kinds.items()},
        }

    batches = [collate(list(range(j, j + 8))) for j in range(0, 24, 8)]
    s = sp.Sifter(
        None,
        lambda m, b: b["x"][:, 0],
        sp.TopFraction(0.5),
        batched=True,
        output_batch=output_batch,
        key=None,
    )
    out = list(s(batches))
    rows = [int(v) for b in out for v in b["x"][:, 0].tolist()]
    assert rows == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    for name, f in kinds.items():
        got = [v for b in out for v in b[name]]
        assert all(isinstance(b[name], tuple) for b in out)
        expected = [f(i) for i in rows]
        assert [int(v) if name == "zero_d" else v for v in got] == expected, name
    # a top-level tuple batch holding such a tuple
    s = sp.Sifter(None, lambda m, b: b[0][:, 0], sp.TopFraction(0.5), batched=True, key=None)
    ((x, ids),) = s([(torch.arange(6.0)[:, None], tuple(range(6)))])
    assert x[:, 0].tolist() == [3.0, 4.0, 5.0] and ids == (3, 4, 5)


def test_a_batch_wide_tuple_stays_whole_and_a_mappings_row_tuple_is_cut():
    """The review of the tuple fix (2026-12-05): a batch-wide constant ("size": (224, 224)) was read
    per row and refused (or, in a batch of 2 rows, cut); a tuple field of a BatchEncoding or
    UserDict batch was still handed on uncut."""
    from collections import UserDict

    def scorer(m, b):
        return b["x"][:, 0]

    s = sp.Sifter(None, scorer, sp.TopFraction(0.5), batched=True, key=None)
    four = {"x": torch.arange(4.0)[:, None], "size": (224, 224), "ids": (0, 1, 2, 3)}
    (out,) = list(s([four]))
    assert out["size"] == (224, 224) and out["ids"] == (2, 3)
    for kind in (UserDict, dict):
        batch = kind({"x": torch.arange(4.0)[:, None], "ids": (10, 11, 12, 13), "meta": {"n": (5, 6, 7, 8)}})
        (out,) = list(sp.Sifter(None, scorer, sp.TopFraction(0.5), batched=True, key=None)([batch]))
        assert type(out) is kind and out["ids"] == (12, 13) and out["meta"]["n"] == (7, 8)


@pytest.mark.parametrize("output_batch", [None, 3])
def test_row_tuples_in_named_and_nested_tuples_and_tuples_of_pairs_are_cut_to_the_kept_rows(output_batch):
    """The review of the tuple fix (2026-12-06): only a mapping's fields and a plain tuple batch's
    entries were marked, and never a tuple of (h, w) pairs: a namedtuple batch's ids, a
    ``(x, {"ids": ...})`` batch's, a tuple nested in a tuple batch and a ``zip(*samples)``
    field of pairs were handed on whole beside the kept rows (with output_batch, the first
    batch's beside every output batch's rows), nothing said."""
    import collections

    NT = collections.namedtuple("NT", "x ids")

    def scorer(m, b):
        x = b.x if isinstance(b, NT) else b[0] if isinstance(b, tuple) else b["x"]
        return x[:, 0]

    def shapes(j):
        x = torch.arange(4.0 * j, 4.0 * j + 4)[:, None]
        ids = tuple(range(4 * j, 4 * j + 4))
        return {
            "namedtuple": NT(x, ids),
            "dict in tuple": (x, {"ids": ids}),
            "tuple in tuple": (x, (torch.tensor(ids), ids)),
            "namedtuple field": {"x": x, "meta": NT(torch.tensor(ids), ids)},
            "pairs": {"x": x, "ids": tuple((i, i) for i in ids)},
        }

    for name in shapes(0):
        s = sp.Sifter(None, scorer, sp.TopFraction(0.5), batched=True, key=None, output_batch=output_batch)
        out = list(s([shapes(j)[name] for j in range(3)]))
        kept = [2, 3, 6, 7, 10, 11]
        if name == "namedtuple":
            got = [(int(b.x[i, 0]), b.ids[i]) for b in out for i in range(len(b.x))]
            assert all(isinstance(b, NT) and len(b.ids) == len(b.x) for b in out), name
        elif name == "dict in tuple":
            got = [(int(b[0][i, 0]), b[1]["ids"][i]) for b in out for i in range(len(b[0]))]
        elif name == "tuple in tuple":
            got = [(int(b[0][i, 0]), b[1][1][i]) for b in out for i in range(len(b[0]))]
            assert [int(v) for b in out for v in b[1][0]] == kept
        elif name == "namedtuple field":
            got = [(int(b["x"][i, 0]), b["meta"].ids[i]) for b in out for i in range(len(b["x"]))]
            assert all(isinstance(b["meta"], NT) for b in out)
        else:
            got = [(int(b["x"][i, 0]), b["ids"][i][0]) for b in out for i in range(len(b["x"]))]
        assert got == [(k, k) for k in kept], name
        assert sum(len(scorer(None, b)) for b in out) == len(kept), name


def test_a_tuple_of_pairs_as_long_as_the_pairs_is_read_per_row_and_warned_about():
    """Two rows of (h, w) pairs look like two fields of one value per row too: read per row, as
    the same field is in batches of other sizes, and said. The first version read them as
    columns, and output_batch joining such a batch (an epoch's short last batch) with others
    misaligned every later row (the review of the fix, 2026-12-06)."""
    batch = {"x": torch.arange(2.0)[:, None], "sizes": ((0, 0), (1, 1))}
    s = sp.Sifter(None, lambda m, b: b["x"][:, 0], sp.TopFraction(0.5), batched=True, key=None)
    with pytest.warns(sp.BatchShapeWarning, match=r"\['sizes'\] is a tuple of 2 tuples of 2 entries"):
        (out,) = list(s([batch]))
    assert out["sizes"] == ((1, 1),)

    def batch_of(first, rows):
        ids = range(first, first + rows)
        return {
            "x": torch.tensor([float(i) for i in ids])[:, None],
            "sizes": tuple((100 + i, 200 + i) for i in ids),
        }

    s = sp.Sifter(
        None, lambda m, b: b["x"][:, 0], sp.TopFraction(0.5), batched=True, key=None, output_batch=4
    )
    with pytest.warns(sp.BatchShapeWarning):
        out = list(s([batch_of(0, 3), batch_of(3, 2), batch_of(5, 3), batch_of(8, 2)]))
    for b in out:
        rows = [int(v) for v in b["x"][:, 0]]
        assert list(b["sizes"]) == [(100 + i, 200 + i) for i in rows], b


def test_a_field_read_per_row_in_one_batch_and_as_columns_in_another_is_not_joined_silently():
    """A dict field holding a tuple of per-row tuples, one per field ((ids, labels)): in a batch
    of 2 rows it reads per row (square, warned), in a batch of 3 as columns. Joined by
    output_batch, the rows misaligned, nothing said: a BatchError names the field now."""

    def batch_of(first, rows):
        ids = tuple(range(first, first + rows))
        return {"x": torch.tensor([float(i) for i in ids])[:, None], "meta": (ids, tuple(i % 2 for i in ids))}

    s = sp.Sifter(None, lambda m, b: b["x"][:, 0], sp.Uniform(1.0), batched=True, key=None, output_batch=5)
    with (
        pytest.warns(sp.BatchShapeWarning),
        pytest.raises(
            sp.BatchError,
            match=r"'meta' is read as one entry per row in one input batch and as one tuple per field",
        ),
    ):
        list(s([batch_of(0, 3), batch_of(3, 2)]))
