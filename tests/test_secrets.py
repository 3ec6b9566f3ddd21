"""Credentials never appear in records, manifests, errors, warnings or reprs."""

import logging
import os
import warnings

import pytest
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
