"""Credentials never appear in records, manifests, errors, warnings or reprs."""

import logging
import os
import warnings

import pytest
import torch
from conftest import loss_field, make_samples
from s3util import CREDENTIALS

import siftpipe as sp

SECRET = "sIfTpIpE-sToRaGe-OpTiOn-SeCrEt-42"
TOKEN = "tOkEn-FoR-tHe-SeSsIoN-0123456789"


def secrets():
    return [SECRET, TOKEN, CREDENTIALS["AWS_SECRET_ACCESS_KEY"], CREDENTIALS["AWS_ACCESS_KEY_ID"]]


def assert_clean(text, where):
    for secret in secrets():
        assert secret not in text, f"a credential leaked into {where}"


def test_no_credentials_anywhere(local_s3, bucket, caplog, monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG, logger="siftpipe")
    options = {**local_s3.storage_options, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": SECRET}
    root = f"s3://{bucket}/audit"
    log = sp.AuditLog(root, storage_options=options, flush_every=100)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=25, audit=log)
    list(s(make_samples(400)))
    s.close()
    texts = {"repr(AuditLog)": repr(log), "repr(Sifter)": repr(s), "stats": repr(log.stats)}
    fs = local_s3.fs()
    for path in fs.find(f"{bucket}/audit"):
        texts[path] = fs.cat(path).decode("latin-1")
    assert any("_manifest" in p for p in texts) and any(p.endswith(".parquet") for p in texts)
    table = sp.read_log(root, options)
    texts["records"] = str(table.to_pylist())

    # errors and warnings from a destination that fails
    bad = sp.AuditLog(
        "s3://no-such-bucket-for-secrets/x",
        storage_options=options,
        flush_every=10,
        retry_timeout=0.3,
        on_full="drop",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, audit=bad)
        list(t(make_samples(30)))
        t.close()
    texts["warnings"] = "\n".join(str(w.message) for w in caught)
    assert "dropped audit part" in texts["warnings"]
    failing = sp.AuditLog(
        "s3://no-such-bucket-for-secrets/y", storage_options=options, flush_every=10, retry_timeout=0.3
    )
    t = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, audit=failing)
    with pytest.raises(sp.AuditError) as err:
        list(t(make_samples(30)))
        t.close()
    texts["error"] = str(err.value) + repr(err.value)
    with pytest.raises(sp.AuditError) as err:
        sp.read_log(
            f"s3://{bucket}/audit",
            {
                **options,
                "endpoint_url": "http://127.0.0.1:9",
                "config_kwargs": {"retries": {"max_attempts": 1}},
            },
        )
    texts["read error"] = str(err.value)
    texts["log"] = caplog.text
    for where, text in texts.items():
        assert_clean(text, where)
    assert os.environ["AWS_SESSION_TOKEN"] == TOKEN


PASSWORD = "pAsSwOrD-iN-tHe-UrL-77"
SIGNATURE = "sIgNaTuRe0123456789abcdefABCDEF"


def ones(model, batch):
    return torch.ones(len(batch), dtype=torch.float64)


def test_no_credentials_on_the_streaming_side(local_s3, bucket, caplog, monkeypatch, tmp_path):
    """WebDataset, WebLoader (with workers), ShardSource, SiftNode, ShardOpener, PreDecodeFilter,
    Replay and LogReport: reprs, errors, warnings, logs, shard stats, audit records and manifests."""
    import pickle
    import traceback

    from torch.utils.data import default_collate
    from torchdata.nodes import Loader

    from siftpipe.nodes import ShardSource, SiftNode
    from siftpipe.shards import synthetic_classification, write_shards
    from siftpipe.webdataset import WebDataset, WebLoader, warn_and_continue

    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG, logger="siftpipe")
    options = {
        **local_s3.storage_options,
        "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "secret": SECRET,
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }
    shards = write_shards(
        synthetic_classification(80, dim=4),
        f"s3://{bucket}/s",
        samples_per_shard=20,
        storage_options=options,
        progress=False,
    )
    urls = [*shards.urls[:2], f"s3://{bucket}/s-000077.tar", *shards.urls[2:]]  # one missing
    texts: dict[str, str] = {}

    def dataset(handler=warn_and_continue):
        return (
            WebDataset(urls, shardshuffle=False, handler=handler, storage_options=options, retries=0)
            .decode()
            .to_tuple("__key__", "x.npy", "cls", "__url__")
            .batched(10, collation_fn=default_collate)
        )

    def scorer(model, batch):
        return batch[1].pow(2).sum(1).double()

    log = sp.AuditLog(str(tmp_path / "audit"), run_id="secrets", flush_every=20)
    sifter = sp.Sifter(None, scorer, sp.Uniform(0.5), batched=True, micro_batch=None, key=0, audit=log)
    data = dataset()
    loader = WebLoader(data, batch_size=None, num_workers=2).sift(sifter)
    assert len([b for b in loader]) > 0
    sifter.close()
    texts["repr(WebDataset)"] = repr(data)
    texts["repr(WebLoader)"] = repr(loader)
    texts["loader.shard_stats()"] = repr(loader.shard_stats())
    texts["sifter.shard_stats()"] = repr(sifter.shard_stats()) + repr(sifter.stats) + repr(sifter)
    assert sifter.stats.shards_skipped == 1
    for path in sorted((tmp_path / "audit").rglob("*")):
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode("latin-1")
    texts["records"] = str(sp.read_log(str(tmp_path / "audit")).to_pylist())
    report = sp.verify_log(str(tmp_path / "audit"))
    texts["LogReport"] = repr(report) + "\n".join(report.lines())
    replay = sp.replay(str(tmp_path / "audit"))
    texts["repr(Replay)"] = repr(replay)
    try:
        list(replay([{"__key__": "stranger", "__url__": urls[0]}]))
    except sp.AuditError as exc:
        texts["replay error"] = str(exc)

    # the same failures in this process: warnings, errors, their pickles and tracebacks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(dataset())
    texts["warnings"] = "\n".join(str(w.message) for w in caught)
    assert "s-000077.tar" in texts["warnings"]
    try:
        list(dataset(sp.webdataset.reraise_exception))
    except sp.ShardError as exc:
        texts["error"] = "".join(traceback.format_exception(exc)) + repr(pickle.loads(pickle.dumps(exc)))
    assert "s-000077.tar" in texts["error"]

    # a signed URL and a password in a URL: never shown, never handed on
    signed = (
        f"https://reader:{PASSWORD}@127.0.0.1:9/x-000000.tar?X-Amz-Signature={SIGNATURE}&X-Amz-Credential=c"
    )
    source = ShardSource(
        [signed, *shards.urls], storage_options=options, handler=warn_and_continue, retries=0
    )
    node = SiftNode(
        source,
        sp.Sifter(None, ones, sp.Uniform(1.0), micro_batch=8, collate_fn=list),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(Loader(node))
    assert len(out) == 80
    texts["samples' urls"] = str([s["__url__"] for s in out])
    texts["source warnings"] = "\n".join(str(w.message) for w in caught)
    texts["repr(ShardSource)"] = repr(source) + repr(source.shard_stats()) + repr(source.opener)
    texts["repr(SiftNode)"] = repr(node) + repr(node.sifter.stats) + repr(node.get_state())
    texts["repr(ShardOpener)"] = repr(data.opener) + repr(data.opener.counts)
    texts["repr(PreDecodeFilter)"] = repr(sp.PreDecodeFilter(signed, storage_options=options))
    texts["log"] = caplog.text
    assert "x-000000.tar" in texts["source warnings"]
    for where, text in texts.items():
        assert_clean(text, where)
        for secret in (PASSWORD, SIGNATURE):
            assert secret not in text, f"a credential leaked into {where}"
