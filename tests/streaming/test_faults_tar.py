"""Real tar shards with real damage: bytes flipped, cut short, garbage, empty, gzip broken.

The rule for every case: the reader hands on an exact prefix of the shard's samples, and if that
prefix is not the whole shard it raises a ``ShardError`` (kind ``corrupt``) naming the shard and
the last sample handed on, or the handler skips the shard and counts it. Never a silently
shorter shard. Damage inside a member's payload is invisible to tar (it has no checksum on data)
and surfaces, if at all, when the field is decoded (see test_faults_samples.py)."""

from __future__ import annotations

import gzip
import tarfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import siftpipe as sp
from siftpipe.errors import ShardWarning
from siftpipe.streaming.opener import (
    ShardOpener,
    ShardReader,
    reset_shard_stats,
    shard_stats,
    warn_and_continue,
)
from siftpipe.streaming.shards import synthetic_classification, write_shards

N = 12  # samples in the shard: small, so that hypothesis can afford many reads


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("tar")
    written = write_shards(
        synthetic_classification(N, dim=4), str(root / "good"), samples_per_shard=N, progress=False
    )
    data = Path(written.urls[0]).read_bytes()
    with tarfile.open(written.urls[0]) as tf:
        headers = [m.offset for m in tf.getmembers()]
        end = max(m.offset_data + ((m.size + 511) // 512) * 512 for m in tf.getmembers())
    return {
        "data": data,
        "headers": headers,
        "end": end,
        "keys": [f"{i:09d}" for i in range(N)],
        "root": root,
    }


def read(path: Path) -> tuple[list[str], BaseException | None]:
    keys: list[str] = []
    try:
        for sample in ShardReader(ShardOpener())([str(path)]):
            keys.append(sample["__key__"])
    except sp.ShardError as exc:
        return keys, exc
    return keys, None


def check_prefix_or_error(shard, damaged: bytes, path: Path) -> tuple[list[str], BaseException | None]:
    path.write_bytes(damaged)
    keys, err = read(path)
    assert keys == shard["keys"][: len(keys)], "samples out of order or altered keys"
    if len(keys) < N:
        assert err is not None, f"the shard silently ended after {len(keys)} of {N} samples"
    if err is not None:
        assert err.kind == "corrupt" and err.url == str(path), err
        assert str(path) in str(err)
        if keys:
            assert repr(keys[-1]) in str(err), "the error must name the last sample handed on"
    return keys, err


def test_a_corrupt_header_in_the_middle_is_an_error_not_a_short_shard(shard, tmp_path):
    # found by this file: stream-mode tarfile ends an archive quietly at a header whose checksum
    # fails, and the reader used to hand on half the shard as if it were complete
    data = bytearray(shard["data"])
    middle = shard["headers"][len(shard["headers"]) // 2]
    data[middle + 130] ^= 0x55  # a byte of the mode/uid/size fields: the checksum no longer matches
    keys, err = check_prefix_or_error(shard, bytes(data), tmp_path / "flip-000000.tar")
    assert err is not None and 0 < len(keys) < N
    assert "header" in str(err) and "corrupt" in str(err)


@pytest.mark.parametrize("header", [1, 6, 11, 23])
def test_a_zero_block_between_members_is_an_error_not_the_archives_end(shard, tmp_path, header):
    # found by review: one zero block (half an end-of-archive marker) before a member's header
    # ended the archive for tarfile, and the shard was read as complete with the rest lost
    at = shard["headers"][header]
    damaged = shard["data"][:at] + b"\0" * 512 + shard["data"][at:]
    keys, err = check_prefix_or_error(shard, damaged, tmp_path / "zero-000000.tar")
    assert err is not None and len(keys) < N
    assert "lone zero block" in str(err)


def test_a_gzip_shard_of_several_members_reads_whole(shard, tmp_path):
    # parallel gzip writers (pigz, bgzip) write several gzip members: a valid gzip file, which
    # tarfile's stream mode read as its first member and then called truncated
    data = shard["data"]
    cut = shard["headers"][5] + 100  # inside a member: the tar stream is split anywhere
    path = tmp_path / "multi-000000.tar.gz"
    path.write_bytes(gzip.compress(data[:cut]) + gzip.compress(data[cut:]))
    assert read(path) == (shard["keys"], None)
    path.write_bytes(gzip.compress(data[:cut]) + gzip.compress(data[cut:])[:-40])  # the last cut
    keys, err = check_prefix_or_error(shard, path.read_bytes(), path)
    assert err is not None and "gzip stream is corrupt or cut short" in str(err)


@pytest.mark.parametrize("cut", [1, 4, 8])
def test_a_gzip_shard_cut_in_its_trailer_is_corrupt_not_read_as_whole(shard, tmp_path, cut):
    """The last bytes of a .tar.gz (the gzip trailer: CRC and length) cut off: the reader stopped
    at the tar's end-of-archive blocks and never reached them, so the shard was read as whole,
    unchecked, where `gzip -t` refuses it (found by review, 2026-12-05). The member is read to
    its end now: corrupt, the last sample withheld as with a CRC error found earlier."""
    path = tmp_path / "trailer-000000.tar.gz"
    path.write_bytes(gzip.compress(shard["data"])[:-cut])
    keys, err = check_prefix_or_error(shard, path.read_bytes(), path)
    assert err is not None and "gzip stream is corrupt or cut short" in str(err)
    assert keys == shard["keys"][:-1]
    whole = tmp_path / "whole-000000.tar.gz"
    whole.write_bytes(gzip.compress(shard["data"]))
    assert read(whole) == (shard["keys"], None)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 10**9), mask=st.integers(1, 255))
def test_any_flipped_byte_gives_a_prefix_and_an_error_or_every_sample(shard, tmp_path, position, mask):
    data = bytearray(shard["data"])
    at = position % shard["end"]  # within the members; the zero padding after them is not read
    data[at] ^= mask
    keys, err = check_prefix_or_error(shard, bytes(data), tmp_path / "flip-000000.tar")
    header = next((h for h in shard["headers"] if h <= at < h + 512), None)
    if header is not None and not 148 <= at - header < 156:
        # every header byte but the checksum field's own counts in the checksum (a flip there
        # may leave the number it holds unchanged, e.g. its terminator)
        assert err is not None, "a damaged tar header must be an error"
    elif header is not None:
        assert err is not None or keys == shard["keys"]
    else:
        assert keys == shard["keys"] and err is None  # payload damage: invisible to tar


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10**9))
def test_a_shard_cut_at_any_byte_gives_a_prefix_and_an_error(shard, tmp_path, cut):
    at = cut % shard["end"]  # everything before the end-of-archive marker
    keys, err = check_prefix_or_error(shard, shard["data"][:at], tmp_path / "cut-000000.tar")
    assert err is not None, f"a shard cut at byte {at} of {len(shard['data'])} read as complete"


@pytest.mark.parametrize(
    "name,damage",
    [
        ("empty", lambda d: b""),
        ("garbage", lambda d: bytes(range(256)) * 40),
        ("zeros", lambda d: b"\0" * 1024),  # an end-of-archive marker only: an empty shard, no error
        ("gzip-cut", lambda d: gzip.compress(d)[: len(gzip.compress(d)) // 2]),
        ("gzip-flipped", lambda d: _flip(gzip.compress(d), 40)),
    ],
)
def test_damaged_archives_of_every_kind(shard, tmp_path, name, damage):
    ext = ".tar.gz" if name.startswith("gzip") else ".tar"
    path = tmp_path / f"{name}-000000{ext}"
    if name == "zeros":  # a well-formed empty archive: no samples, no error (WebDataset's empty_check
        path.write_bytes(damage(shard["data"]))  # catches a pipeline that yields nothing at all)
        assert read(path) == ([], None)
        return
    keys, err = check_prefix_or_error(shard, damage(shard["data"]), path)
    assert err is not None and err.kind == "corrupt"
    assert "handler=warn_and_continue" in str(err)  # the message names the way out


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


def test_the_handler_skips_damaged_shards_counts_and_names_each(shard, tmp_path):
    good = tmp_path / "good-000000.tar"
    good.write_bytes(shard["data"])
    cut = tmp_path / "cut-000001.tar"
    cut.write_bytes(shard["data"][: len(shard["data"]) // 3])
    flipped = bytearray(shard["data"])
    flipped[shard["headers"][5] + 100] ^= 1
    bad = tmp_path / "flip-000002.tar"
    bad.write_bytes(bytes(flipped))
    head_of_cut, _ = read(cut)
    head_of_bad, _ = read(bad)
    opener = ShardOpener()
    reset_shard_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(ShardReader(opener, warn_and_continue)([str(cut), str(good), str(bad), str(good)]))
    messages = [str(w.message) for w in caught if issubclass(w.category, ShardWarning)]
    assert len(messages) == 2 and "cut-000001.tar" in messages[0] and "flip-000002.tar" in messages[1]
    # the handler in use is not suggested again (it read "... or pass handler=warn_and_continue")
    assert all("handler=warn_and_continue" not in m and m.endswith("rewrite the shard") for m in messages)
    # what the damaged shards gave before the damage was handed on (documented), then every good sample
    assert [s["__key__"] for s in out] == head_of_cut + shard["keys"] + head_of_bad + shard["keys"]
    assert shard_stats().skipped == 2 and opener.stats().skipped == 2
    assert sorted(opener.stats().skipped_urls) == sorted([f"{bad} (corrupt)", f"{cut} (corrupt)"])
