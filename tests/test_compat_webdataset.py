"""siftpipe.webdataset as a drop-in for webdataset 1.0.2, checked against webdataset itself: the
exception classes its users catch, its URL schemes, the metadata fields of a sample, and the order
of samples over many configurations. Where siftpipe differs on purpose (credentials redacted in
``__url__``, shards read through fsspec) the test says so."""

from __future__ import annotations

import io
import pickle
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from torch.utils.data import DataLoader

import siftpipe as sp
from siftpipe.shards import synthetic_classification, write_shards
from siftpipe.webdataset import WebDataset

N, PER_SHARD = 60, 10
ALL_KEYS = [f"{i:09d}" for i in range(N)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    return write_shards(
        synthetic_classification(N, dim=3), str(root / "train"), samples_per_shard=PER_SHARD, progress=False
    )


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """One shard whose sample 'k1' lacks its label and whose sample 'k2' holds a broken .npy."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(2, np.float32))
    samples = [{"__key__": f"k{i}", "x.npy": buf.getvalue(), "cls": i} for i in range(4)]
    del samples[1]["cls"]
    samples[2]["x.npy"] = b"\x93NUMPY but not really"
    root = tmp_path_factory.mktemp("odd")
    return write_shards(samples, str(root / "odd"), samples_per_shard=4, progress=False).urls[0]


def raised(dataset) -> BaseException:
    """The error that iterating ``dataset`` raises (the test fails if it raises none)."""
    with pytest.raises(Exception) as caught:
        list(dataset)
    return caught.value


# ---------------------------------------------------------------------------------- exceptions


def test_a_missing_local_shard_is_a_file_not_found_error_as_in_webdataset(tmp_path):
    url = str(tmp_path / "nope-000000.tar")
    theirs = raised(wds.WebDataset(url, shardshuffle=False))
    ours = raised(WebDataset(url, shardshuffle=False))
    assert isinstance(theirs, FileNotFoundError)
    assert isinstance(ours, FileNotFoundError) and isinstance(ours, OSError)
    assert isinstance(ours, sp.ShardError) and ours.kind == "missing" and ours.url == url
    assert "no such object" in str(ours)  # siftpipe's message, unchanged


def test_a_missing_s3_object_or_bucket_is_a_file_not_found_error(local_s3, bucket):
    options = {"endpoint_url": local_s3.endpoint}
    for url, kind in [
        (f"s3://{bucket}/nope-000000.tar", "missing"),
        ("s3://siftpipe-no-such-bucket/x-000000.tar", "missing_bucket"),
    ]:
        err = raised(WebDataset(url, shardshuffle=False, storage_options=options, retries=0))
        assert isinstance(err, FileNotFoundError) and isinstance(err, sp.ShardError) and err.kind == kind


def test_a_truncated_shard_is_a_tar_read_error_as_in_webdataset(shards, tmp_path):
    cut = tmp_path / "cut-000000.tar"
    cut.write_bytes(Path(shards.urls[0]).read_bytes()[:3000])
    assert isinstance(raised(wds.WebDataset(str(cut), shardshuffle=False)), tarfile.ReadError)
    ours = raised(WebDataset(str(cut), shardshuffle=False))
    assert isinstance(ours, tarfile.ReadError) and isinstance(ours, sp.ShardError) and ours.kind == "corrupt"


def test_a_missing_to_tuple_field_is_a_value_error_as_in_webdataset(odd):
    with pytest.raises(ValueError):
        list(wds.WebDataset(odd, shardshuffle=False).to_tuple("x.npy", "cls"))
    err = raised(WebDataset(odd, shardshuffle=False).to_tuple("x.npy", "cls"))
    assert isinstance(err, ValueError) and isinstance(err, sp.SampleError)
    assert (err.kind, err.key, err.field) == ("missing_field", "k1", "cls")
    assert "has no field 'cls'" in str(err)


def test_a_failing_decoder_is_webdatasets_decoding_error(odd):
    decoding_error = wds.autodecode.DecodingError
    theirs = raised(wds.WebDataset(odd, shardshuffle=False).decode())
    assert isinstance(theirs, decoding_error) and theirs.k == "x.npy"
    ours = raised(WebDataset(odd, shardshuffle=False).decode())
    assert isinstance(ours, decoding_error) and isinstance(ours, sp.SampleError)
    assert (ours.k, ours.key, ours.field, ours.kind) == ("x.npy", "k2", "x.npy", "corrupt")
    assert "decoding field 'x.npy' of sample 'k2'" in str(ours)

    def failing(key, data):
        raise ValueError("nothing")

    ours = raised(WebDataset(odd, shardshuffle=False).decode(failing))
    assert isinstance(ours, decoding_error) and isinstance(ours.__cause__, ValueError)


@pytest.mark.parametrize(
    "kind,builtin",
    [
        ("missing", FileNotFoundError),
        ("missing_bucket", FileNotFoundError),
        ("denied", PermissionError),
        ("no_credentials", PermissionError),
        ("transient", OSError),
        ("command", OSError),
        ("corrupt", tarfile.ReadError),
    ],
)
def test_every_shard_error_kind_is_what_webdataset_users_catch_and_pickles(kind, builtin):
    err = sp.ShardError("reading shard s3://b/x.tar failed", url="s3://b/x.tar", key="k", kind=kind)
    assert isinstance(err, builtin) and isinstance(err, sp.ShardError) and isinstance(err, sp.SiftError)
    assert str(err) == "reading shard s3://b/x.tar failed" and err.args == (str(err),)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is type(err) and (clone.url, clone.key, clone.kind) == ("s3://b/x.tar", "k", kind)
    # a DataLoader worker's error reaches the training process as type(err)(message): the class
    # keeps the webdataset-compatible base and a kind
    rebuilt = type(err)(str(err))
    assert isinstance(rebuilt, builtin) and rebuilt.kind is not None


def test_other_kinds_stay_plain_shard_errors_and_sample_errors_pickle():
    assert type(sp.ShardError("x", kind="other")) is sp.ShardError
    assert type(sp.ShardError("x")) is sp.ShardError
    err = sp.SampleError("bad field", url="u", key="k", kind="corrupt", field="x.npy")
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is type(err) and (clone.field, clone.k, clone.kind) == ("x.npy", "x.npy", "corrupt")
    assert isinstance(sp.SampleError("m", kind="missing_field"), ValueError)


def test_a_missing_shard_in_a_dataloader_worker_still_is_a_file_not_found_error(tmp_path):
    url = str(tmp_path / "nope-000000.tar")
    it = iter(DataLoader(WebDataset([url, url], shardshuffle=False), batch_size=None, num_workers=2))
    try:
        with pytest.raises(FileNotFoundError, match=r"nope-000000\.tar") as caught:
            next(it)
    finally:
        it._shutdown_workers()
    assert isinstance(caught.value, sp.ShardError) and caught.value.kind == "missing"


def test_webdatasets_handlers_skip_siftpipes_errors(shards, tmp_path):
    url = str(tmp_path / "nope-000000.tar")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(WebDataset([url, shards.urls[0]], shardshuffle=False, handler=wds.warn_and_continue))
    assert [s["__key__"] for s in got] == ALL_KEYS[:PER_SHARD]


# ---------------------------------------------------------------------------------- metadata fields


def test_local_samples_carry_webdatasets_metadata_fields(shards, tmp_path, monkeypatch):
    relative = Path(shards.urls[1]).relative_to(Path(shards.urls[1]).parents[1])
    monkeypatch.chdir(Path(shards.urls[1]).parents[1])
    for url in [shards.urls[0], f"file://{shards.urls[0]}", str(relative)]:
        theirs = list(wds.WebDataset(url, shardshuffle=False))
        ours = list(WebDataset(url, shardshuffle=False))
        assert ours == theirs, url  # every field, __key__, __url__ and __local_path__ included
        assert {k for k in ours[0] if k.startswith("__")} == {"__key__", "__url__", "__local_path__"}
        assert ours[0]["__url__"] == url and Path(ours[0]["__local_path__"]).resolve().exists()


def test_shard_source_samples_carry_the_same_metadata_fields(shards):
    from torchdata.nodes import Loader

    from siftpipe.nodes import ShardSource

    theirs = list(wds.WebDataset(shards.urls, shardshuffle=False))
    assert list(Loader(ShardSource(shards.urls))) == theirs


def test_remote_samples_have_no_local_path(local_s3, bucket):
    options = {"endpoint_url": local_s3.endpoint}
    remote = write_shards(
        synthetic_classification(4), f"s3://{bucket}/t", storage_options=options, progress=False
    )
    sample = next(iter(WebDataset(remote.urls, shardshuffle=False, storage_options=options)))
    assert sample["__url__"] == remote.urls[0] and "__local_path__" not in sample


# ---------------------------------------------------------------------------------- URL schemes


def _prefix(shards) -> str:
    return shards.urls[0][: -len("-000000.tar")]


@pytest.mark.parametrize(
    "spec",
    [
        "brace pattern",
        "list of paths",
        "file:// list",
        "pipe:cat pattern",
        "single path",
        "two brace ranges",
    ],
)
def test_every_url_form_gives_webdatasets_samples(shards, spec):
    prefix = _prefix(shards)
    urls = {
        "brace pattern": f"{prefix}-{{000000..000005}}.tar",
        "list of paths": list(shards.urls),
        "file:// list": [f"file://{u}" for u in shards.urls],
        "pipe:cat pattern": f"pipe:cat {prefix}-{{000000..000005}}.tar",
        "single path": shards.urls[2],
        "two brace ranges": f"{prefix}-{{000000..000001}}.tar::{prefix}-{{000004..000005}}.tar",
    }[spec]
    theirs = list(wds.WebDataset(urls, shardshuffle=False))
    ours = list(WebDataset(urls, shardshuffle=False))
    assert ours == theirs and len(ours) > 0
