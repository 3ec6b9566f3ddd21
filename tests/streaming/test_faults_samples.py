"""Odd samples in well-formed shards: a field that cannot be decoded, a missing field. The same
handler choice as for shards: an error naming the shard, the sample and the field (default), or
skipped with a warning and counted."""

from __future__ import annotations

import io
import pickle
import warnings

import numpy as np
import pytest
import torch
import webdataset as wds
from torchdata.nodes import Loader

import siftpipe as sp
from siftpipe.adapters.nodes import ShardSource, SiftNode
from siftpipe.adapters.webdataset import (
    WebDataset,
    describe_error,
    reraise_exception,
    warn_and_continue,
)
from siftpipe.errors import ShardWarning
from siftpipe.streaming.shards import decode_sample, write_shards


def npy(array):
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    samples = [
        {"__key__": f"k{i:02d}", "x.npy": npy(np.full(3, i, np.float32)), "cls": i % 2} for i in range(8)
    ]
    del samples[2]["cls"]
    samples[5]["x.npy"] = b"\x93NUMPY but not really"
    root = tmp_path_factory.mktemp("odd")
    return write_shards(samples, str(root / "odd"), samples_per_shard=8, progress=False).urls[0]


def keys(items):
    return [x["__key__"] if isinstance(x, dict) else x[0] for x in items]


def test_an_undecodable_field_names_the_shard_sample_field_and_fix(odd):
    with pytest.raises(sp.SampleError) as err:
        list(WebDataset(odd, shardshuffle=False).decode())
    e = err.value
    assert isinstance(e, sp.ShardError) and (e.kind, e.key, e.field, e.url) == (
        "corrupt",
        "k05",
        "x.npy",
        odd,
    )
    text = str(e)
    assert "decoding field 'x.npy' of sample 'k05'" in text and odd in text
    assert "ValueError" in text and "handler=warn_and_continue" in text
    clone = pickle.loads(pickle.dumps(e))  # how DataLoader workers would send it
    assert type(clone) is type(e) and isinstance(clone, sp.SampleError)
    assert (clone.key, clone.field, str(clone)) == ("k05", "x.npy", text)


def test_a_missing_field_names_the_field_and_what_the_sample_has(odd):
    with pytest.raises(sp.SampleError) as err:
        list(WebDataset(odd, shardshuffle=False).to_tuple("__key__", "x.npy", "cls"))
    e = err.value
    assert (e.kind, e.key, e.field) == ("missing_field", "k02", "cls")
    assert "sample 'k02'" in str(e) and "has no field 'cls' (it has ['x.npy'])" in str(e) and odd in str(e)
    # webdataset's alternatives and missing_is_error=False keep their meaning
    got = list(WebDataset(odd, shardshuffle=False).to_tuple("__key__", "cls;x.npy"))
    assert len(got) == 8 and got[2][1] == npy(np.full(3, 2, np.float32))
    got = list(WebDataset(odd, shardshuffle=False).to_tuple("__key__", "cls", missing_is_error=False))
    assert got[2] == ("k02", None) and len(got) == 8


def test_the_steps_handlers_skip_bad_samples_warn_naming_them_and_count(odd):
    dataset = (
        WebDataset(odd, shardshuffle=False)
        .decode(handler=warn_and_continue)
        .to_tuple("__key__", "x.npy", "cls", handler=warn_and_continue)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(dataset)
    assert keys(out) == ["k00", "k01", "k03", "k04", "k06", "k07"]
    messages = [str(w.message) for w in caught if issubclass(w.category, ShardWarning)]
    assert len(messages) == 2
    assert "'k02'" in messages[0] and "'cls'" in messages[0] and odd in messages[0]
    assert "'k05'" in messages[1] and "'x.npy'" in messages[1] and odd in messages[1]
    stats = dataset.shard_stats()
    assert stats.samples_skipped == 2 and stats.samples == 8 and stats.skipped == 0 and stats.completed == 1


def test_a_handler_given_to_one_call_applies_to_that_call(odd):
    dataset = WebDataset(odd, shardshuffle=False).decode(handler=warn_and_continue)
    with pytest.warns(ShardWarning, match="k05"):
        assert len(list(dataset)) == 7
    with pytest.raises(sp.SampleError, match="k02"):
        list(dataset.to_tuple("__key__", "cls"))  # the dataset's own handler: raise


def test_the_datasets_handler_is_for_shards_and_decode_re_raises_as_in_webdataset(odd):
    # found by review (2026-12-05): the dataset's handler was the default of .decode() and
    # .to_tuple(): a webdataset user's handler=warn_and_continue, meant for bad shards, skipped
    # every sample that failed to decode, where webdataset 1.0.2 raises
    for cls, error in ((WebDataset, sp.SampleError), (wds.WebDataset, wds.DecodingError)):
        with pytest.raises(error):
            list(cls(odd, shardshuffle=False, handler=warn_and_continue).decode())
    with pytest.raises(sp.SampleError, match="k02"):
        list(WebDataset(odd, shardshuffle=False, handler=warn_and_continue).to_tuple("__key__", "cls"))


def test_the_sifter_counts_what_the_pipeline_skipped(odd):
    dataset = (
        WebDataset(odd, shardshuffle=False)
        .decode(handler=warn_and_continue)
        .to_tuple("__key__", "x.npy", "cls", handler=warn_and_continue)
    )

    def scorer(model, batch):
        return batch[1].sum(1).double()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardWarning)
        chain = dataset.sift(None, scorer, sp.Uniform(1.0), micro_batch=4, key=0)
        assert len(list(chain)) == 6
    assert chain.sifter.stats.samples_skipped == 2 and chain.sifter.stats.seen == 6


def test_webdatasets_own_decoding_error_is_described_not_blank(odd):
    # wds.WebDataset with siftpipe's handlers: webdataset's DecodingError carries no message
    dataset = wds.WebDataset(odd, shardshuffle=False).decode(handler=warn_and_continue)
    with pytest.warns(ShardWarning) as caught:
        assert len(list(dataset)) == 7
    # (the first ShardWarning: a ResourceWarning of a file webdataset left open may come first)
    text = next(str(w.message) for w in caught if issubclass(w.category, ShardWarning))
    assert (
        "DecodingError" in text
        and "sample 'k05'" in text
        and "field 'x.npy'" in text
        and "ValueError" in text
    )
    assert describe_error(ValueError()) == "ValueError"
    with pytest.raises(wds.autodecode.DecodingError):
        list(wds.WebDataset(odd, shardshuffle=False).decode(handler=reraise_exception))


def test_decode_sample_names_the_field_too(odd):
    with pytest.raises(
        sp.ShardError, match=r"sample 'k05' from .*odd-000000\.tar: field 'x\.npy' is not valid \.npy"
    ):
        list(WebDataset(odd, shardshuffle=False).map(decode_sample))


def ones(model, batch):
    return torch.ones(len(batch), dtype=torch.float64)


def test_a_shard_source_below_a_sift_node_counts_skipped_shards_in_the_sifter(odd, tmp_path):
    bad = tmp_path / "bad-000000.tar"
    bad.write_bytes(b"not a tar archive at all" * 100)
    source = ShardSource([odd, str(bad), odd], handler=warn_and_continue)
    sifter = sp.Sifter(None, ones, sp.Uniform(1.0), micro_batch=4, collate_fn=list)
    with pytest.warns(ShardWarning, match="bad-000000"):
        out = list(Loader(SiftNode(source, sifter)))
    assert len(out) == 16
    assert sifter.stats.shards_skipped == 1 and source.shard_stats().skipped_urls == (f"{bad} (corrupt)",)
