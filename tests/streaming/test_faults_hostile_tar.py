"""Hostile tar members, crafted byte by byte: sizes that lie, names that climb out, links and
devices, thousands of members of one key, non-UTF-8 names, extended headers and gzip bombs.

The rule: the reader never holds more than the limits say (``max_member_bytes``,
``max_sample_bytes``, 1 MiB per extended header), never ends a shard quietly, and every refusal is
a ``ShardError`` naming the shard and the member, which the usual handlers skip and count. What a
member name says is only ever a key: nothing is written anywhere."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tracemalloc
import warnings
from pathlib import Path

import pytest
import webdataset as wds
from torchdata.nodes import Loader

import siftpipe as sp
from siftpipe.adapters.nodes import ShardSource
from siftpipe.adapters.webdataset import WebDataset, warn_and_continue
from siftpipe.errors import ShardWarning
from siftpipe.streaming.opener import ShardOpener, ShardReader, iter_tar_samples
from tests.tally import tried

pytestmark = pytest.mark.adversarial
ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


# ---------------------------------------------------------------------------------- crafting


def header(
    name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, linkname: str = "", **patch: bytes
) -> bytes:
    """One 512-byte GNU tar header; ``patch`` overwrites fields by offset (``at148=b"..."``)."""
    info = tarfile.TarInfo(name)
    info.size = size if kind in (tarfile.REGTYPE, tarfile.AREGTYPE) and size >= 0 else 0
    info.type = kind
    info.linkname = linkname
    raw = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")[-512:])
    if size != info.size:
        raw[124:136] = _number(size, 12)
    for key, value in patch.items():
        at = int(key[2:])
        raw[at : at + len(value)] = value
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw)
    return bytes(raw)


def _number(n: int, width: int) -> bytes:
    if 0 <= n < 8 ** (width - 1):
        return b"%0*o\0" % (width - 1, n)
    return bytes([0xFF if n < 0 else 0x80]) + (n % 256 ** (width - 1)).to_bytes(width - 1, "big")


def member(name: str, data: bytes = b"", **kw) -> bytes:
    return header(name, len(data), **kw) + data + b"\0" * (-len(data) % 512)


def archive(*parts: bytes, end: bool = True) -> bytes:
    return b"".join(parts) + (b"\0" * 1024 if end else b"")


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def read(url: str, **kw) -> tuple[list[dict], sp.ShardError | None]:
    got: list[dict] = []
    try:
        got.extend(ShardReader(ShardOpener(), **kw)([url]))
    except sp.ShardError as exc:
        return got, exc
    return got, None


GOOD = member("k0.txt", b"first") + member("k0.cls", b"1")
AFTER = member("k9.txt", b"last")


# ---------------------------------------------------------------------------------- size limits


def test_a_member_claiming_a_gibibyte_fails_its_shard_before_it_is_read(tmp_path):
    # a .tar.gz of a few KiB whose header claims 1 GiB: only the header is ever looked at
    import gzip

    data = gzip.compress(archive(GOOD, header("k1.big", GiB) + b"\0" * 4096, end=False))
    url = write(tmp_path / "bomb-000000.tar.gz", data)
    got, err = read(url)
    assert [s["__key__"] for s in got] == ["k0"], "the samples before it are handed on"
    assert err is not None and err.kind == "too_large" and type(err) is sp.ShardError
    text = str(err)
    assert url in text and "'k1.big'" in text and f"{GiB} bytes" in text
    assert f"max_member_bytes={256 * 2**20}" in text and "handler=warn_and_continue" in text
    assert "after sample 'k0'" in text or "last sample read: 'k0'" in text
    tried("hostile tar members tried")


def test_the_limits_are_settable_and_checked(tmp_path):
    url = write(tmp_path / "two-000000.tar", archive(GOOD, member("k1.bin", b"x" * 3000), AFTER))
    assert [s["__key__"] for s in read(url, max_member_bytes=None)[0]] == ["k0", "k1", "k9"]
    got, err = read(url, max_member_bytes=2999)
    assert [s["__key__"] for s in got] == ["k0"] and err is not None and "max_member_bytes=2999" in str(err)
    assert read(url, max_member_bytes=3000)[1] is None
    for bad in (0, -1, 1.5, "1", True):
        with pytest.raises(sp.ConfigError, match="must be a number of bytes >= 1, or None"):
            WebDataset(url, shardshuffle=False, max_member_bytes=bad)
        with pytest.raises(sp.ConfigError, match="max_sample_bytes must be a number of bytes"):
            ShardSource(url, max_sample_bytes=bad)
    tried("hostile tar members tried", 3)


def test_every_adapter_applies_the_limit_and_the_handler_skips_the_shard(tmp_path):
    big = write(tmp_path / "big-000001.tar", archive(member("b0.bin", b"y" * 5000)))
    good = write(tmp_path / "good-000000.tar", archive(GOOD, AFTER))
    dataset = WebDataset(
        [good, big, good], shardshuffle=False, max_member_bytes=4096, handler=warn_and_continue
    )
    with pytest.warns(ShardWarning, match=r"big-000001\.tar.*'b0\.bin' holds 5000 bytes"):
        assert [s["__key__"] for s in dataset] == ["k0", "k9", "k0", "k9"]
    assert dataset.shard_stats().skipped == 1 and dataset.shard_stats().skipped_urls == (
        f"{big} (too_large)",
    )
    with pytest.raises(sp.ShardError, match=r"'b0\.bin' holds 5000 bytes, more than max_member_bytes=4096"):
        list(Loader(ShardSource([good, big], max_member_bytes=4096)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardWarning)
        source = ShardSource([big, good], max_member_bytes=4096, handler=warn_and_continue)
        assert [s["__key__"] for s in Loader(source)] == ["k0", "k9"]
    tried("hostile tar members tried", 3)


def test_a_gzip_bomb_leaves_the_reader_small(tmp_path):
    # the case found: a 4.7 MB .tar.gz holding a 1 GiB member drove the reader to 2.3 GiB; here a
    # real 300 MiB member of zeros (1.4 MB compressed), read in a fresh process that reports its
    # peak memory before and after
    path = tmp_path / "bomb-000000.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=1) as tf:
        tf.addfile(_info("k0.txt", 3), io.BytesIO(b"abc"))
        tf.addfile(_info("k1.big", 300 * 2**20), io.BufferedReader(_Zeros(300 * 2**20)))
    assert path.stat().st_size < 4 * 2**20
    code = (
        "import json, resource, sys, siftpipe as sp\n"
        "from siftpipe.webdataset import WebDataset\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    keys = [s['__key__'] for s in WebDataset(sys.argv[1], shardshuffle=False)]\n"
        "    kind = None\n"
        "except sp.ShardError as exc:\n"
        "    kind = exc.kind\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'kind': kind, 'grew_kib': after - before}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["kind"] == "too_large"
    assert out["grew_kib"] < 64 * 1024, f"the reader grew by {out['grew_kib']} KiB reading a gzip bomb"
    tried("hostile tar members tried")


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


def test_thousands_of_members_of_one_key_are_bounded_by_the_sample_limit(tmp_path):
    many = archive(*[member(f"k0.f{i:05d}") for i in range(3000)], AFTER)
    url = write(tmp_path / "many-000000.tar", many)
    got, err = read(url)  # under the default limit: one sample with 3000 fields, as in webdataset
    assert err is None and len(got[0]) == 3000 + 3 and got == list(wds.WebDataset(url, shardshuffle=False))
    got, err = read(url, max_sample_bytes=512 * 1000)
    assert got == [] and err is not None and err.kind == "too_large"
    assert "sample 'k0' holds more than max_sample_bytes=512000 bytes at member 'k0.f01000'" in str(err)
    tried("hostile tar members tried", 2)


def test_extended_headers_larger_than_a_mebibyte_are_refused_before_they_are_read(tmp_path):
    import gzip

    for kind in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.XGLTYPE):
        claimed = 64 * 2**20
        data = gzip.compress(archive(GOOD, header("././@LongLink", claimed, kind) + b"\0" * claimed))
        url = write(tmp_path / "ext-000000.tar.gz", data)
        got, err = read(url)
        assert got == []  # k0 is withheld: the header after it is refused, so k0 may not be whole
        assert err is not None and err.kind == "too_large" and "extended header" in str(err)
        assert f"{claimed} bytes" in str(err) and url in str(err)
    tried("hostile tar members tried", 3)


def test_a_sparse_member_is_held_to_its_real_size(tmp_path):
    # a GNU sparse member stores 512 bytes and claims a real size of 1 TiB
    sparse = header(
        "k1.bin",
        512,
        tarfile.GNUTYPE_SPARSE,
        at386=_number(0, 12) + _number(512, 12),
        at483=_number(2**40, 12),
    )
    url = write(tmp_path / "sparse-000000.tar", archive(GOOD, sparse + b"z" * 512, AFTER))
    got, err = read(url)
    assert [s["__key__"] for s in got] == ["k0"]
    assert err is not None and err.kind == "too_large" and f"{2**40} bytes" in str(err)
    tried("hostile tar members tried")


# ---------------------------------------------------------------------------------- lying headers


def test_a_negative_size_is_a_corrupt_shard_not_a_quiet_end(tmp_path):
    url = write(tmp_path / "neg-000000.tar", archive(GOOD, header("k1.txt", -1000) + b"x" * 512, AFTER))
    got, err = read(url)
    assert got == [], "k0 is withheld (the header after it is unreadable): never a shorter shard"
    assert err is not None and err.kind == "corrupt" and "negative size" in str(err)
    assert isinstance(err, tarfile.ReadError)
    tried("hostile tar members tried")


@pytest.mark.parametrize(
    "field,value",
    [("size", b"zzzzzzzzzzz\0"), ("mode", b"zzzzzzz\0"), ("mtime", b"9" * 12)],
)
def test_garbage_number_fields_are_a_corrupt_shard(tmp_path, field, value):
    at = {"size": 124, "mode": 100, "mtime": 136}[field]
    url = write(
        tmp_path / "junk-000000.tar",
        archive(GOOD, header("k1.txt", 4, **{f"at{at}": value}) + b"abcd" + b"\0" * 508, AFTER),
    )
    got, err = read(url)
    assert got == []  # k0 withheld: the header after it cannot be read
    assert err is not None and err.kind == "corrupt" and "a number field holds garbage" in str(err), err
    tried("hostile tar members tried")


def test_a_tar_truncated_inside_a_header_is_an_error(tmp_path):
    data = archive(GOOD, member("k1.txt", b"abc"), AFTER)
    cut = len(GOOD) + 512 + 512 + 200  # 200 bytes into k9's header
    url = write(tmp_path / "cut-000000.tar", data[:cut])
    got, err = read(url)
    assert [s["__key__"] for s in got] == ["k0"], "k1 is not handed on as if the shard were whole"
    assert err is not None and err.kind == "corrupt"
    tried("hostile tar members tried")


def test_a_name_that_is_not_utf8_is_refused_naming_it(tmp_path):
    url = write(tmp_path / "latin-000000.tar", archive(GOOD, member("k\udcff1.txt", b"x"), AFTER))
    got, err = read(url)
    assert [s["__key__"] for s in got] == ["k0"]
    assert err is not None and err.kind == "corrupt" and r"b'k\xff1.txt'" in str(err) and "UTF-8" in str(err)
    # a handler that goes on skips that member alone, as any one member's fault: the rest of the
    # shard is read (it was lost with it until 2026-12-05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (webdataset's handler warns with a UserWarning)
        opener = ShardOpener()
        got = list(ShardReader(opener, handler=wds.warn_and_continue)([url]))
    assert [s["__key__"] for s in got] == ["k0", "k9"]
    assert (opener.stats().members_skipped, opener.stats().skipped) == (1, 0)
    tried("hostile tar members tried")


def test_a_checkpoint_just_before_a_skipped_non_utf8_member_resumes(tmp_path):
    # found by review, 2026-12-05: the skipped member was taken for the next sample's start, so
    # the state expected its key there and the resume was refused as "shard changed"
    from siftpipe.nodes import ShardSource

    names = ["k0.txt", "k1.txt", "k\udcff2.txt", "k3.txt", "k4.txt"]
    url = write(tmp_path / "skip-000000.tar", archive(*[member(n, b"data") for n in names]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = [s["__key__"] for s in ShardSource([url], handler=wds.warn_and_continue)]
        assert whole == ["k0", "k1", "k3", "k4"]
        for cut in range(len(whole) + 1):
            first = ShardSource([url], handler=wds.warn_and_continue)
            first.reset(None)
            got = [next(first)["__key__"] for _ in range(cut)]
            state = first.get_state()
            again = ShardSource([url], handler=wds.warn_and_continue)
            again.reset(state)
            assert got + [s["__key__"] for s in again] == whole, cut
    # without a handler the sample before it is still handed on whole, then the error
    got, err = read(url)
    assert [s["__key__"] for s in got] == ["k0", "k1"] and err is not None and err.kind == "corrupt"
    tried("hostile tar members tried")


def test_a_resume_that_skips_by_count_does_not_ask_again_about_a_member_skipped_before(tmp_path):
    # found by review, 2026-12-05: a compressed shard is re-read from its start and the samples
    # handed on before skipped by count; the bad member among them went to the handler again
    # (a second warning) and was counted skipped twice
    import gzip

    names = ["k0.txt", "k1.txt", "k\udcff2.txt", "k3.txt", "k4.txt"]
    url = str(tmp_path / "skip-000000.tar.gz")
    Path(url).write_bytes(gzip.compress(archive(*[member(n, b"data") for n in names])))
    asked: list[str] = []

    def handler(exc: Exception) -> bool:
        asked.append(str(exc))
        return True

    for cut, asked_again in [(0, 1), (1, 1), (2, 1), (3, 0), (4, 0)]:
        first = ShardSource([url], handler=handler)
        first.reset(None)
        got = [next(first)["__key__"] for _ in range(cut)]
        state = first.get_state()
        assert state["offset"] is None or state["sample"] == 0  # compressed: resumed by count
        asked.clear()
        again = ShardSource([url], handler=handler)
        again.reset(state)
        assert got + [s["__key__"] for s in again] == ["k0", "k1", "k3", "k4"], cut
        assert len(asked) == asked_again, (cut, asked)
        assert again.opener.stats().members_skipped == asked_again, cut
    tried("hostile tar members tried")


# ---------------------------------------------------------------------------------- names and kinds


def test_names_that_climb_out_are_keys_like_any_other_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = ["../../escape.txt", "/etc/absolute.txt", "a/../../b.txt", "./dot/k.txt", "..txt"]
    url = write(tmp_path / "names-000000.tar", archive(*[member(n, b"data") for n in names]))
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    ours = list(WebDataset(url, shardshuffle=False))
    assert ours == list(wds.WebDataset(url, shardshuffle=False))
    # '..txt' has no base name before its first dot: skipped, as webdataset skips it
    assert [s["__key__"] for s in ours] == ["../../escape", "/etc/absolute", "a/../../b", "./dot/k"]
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["names-000000.tar"]
    tried("hostile tar members tried", len(names))


def test_links_devices_directories_and_names_without_extension_are_skipped_as_webdataset_does(tmp_path):
    parts = [
        GOOD,
        header("k0.lnk", kind=tarfile.SYMTYPE, linkname="/etc/passwd"),
        header("k0.hard", kind=tarfile.LNKTYPE, linkname="k0.txt"),
        header("dev.chr", kind=tarfile.CHRTYPE),
        header("dev.blk", kind=tarfile.BLKTYPE),
        header("pipe.fifo", kind=tarfile.FIFOTYPE),
        header("somedir/", kind=tarfile.DIRTYPE),
        member("noextension", b"orphan"),
        member("dir.d/noext", b"orphan"),
        member("__meta__", b"skipped"),
        AFTER,
    ]
    url = write(tmp_path / "kinds-000000.tar", archive(*parts))
    ours = list(WebDataset(url, shardshuffle=False))
    assert ours == list(wds.WebDataset(url, shardshuffle=False))
    assert [sorted(k for k in s if not k.startswith("__")) for s in ours] == [["cls", "txt"], ["txt"]]
    tried("hostile tar members tried", len(parts) - 2)


def test_many_skipped_members_do_not_pile_up_in_memory(tmp_path):
    # stream-mode tarfile keeps every TarInfo it reads unless told not to; 20,000 links that are
    # skipped would otherwise all stay in memory until the shard ends
    links = [header(f"l{i:06d}.lnk", kind=tarfile.SYMTYPE, linkname="x") for i in range(20_000)]
    url = write(tmp_path / "links-000000.tar", archive(GOOD, *links, AFTER))
    with open(url, "rb") as f:
        tracemalloc.start()
        try:
            keys = [s["__key__"] for s, _, _ in iter_tar_samples(f, url)]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert keys == ["k0", "k9"]
    assert peak < 2 * 2**20, f"reading held {peak} bytes at its peak"
    tried("hostile tar members tried")  # one shard of 20,000 hostile members


def test_duplicate_and_scattered_members(tmp_path):
    dup = write(tmp_path / "dup-000000.tar", archive(GOOD, member("k0.txt", b"again")))
    got, err = read(dup)
    assert (
        got == [] and err is not None and err.kind == "corrupt" and "two members with field 'txt'" in str(err)
    )
    # a key whose members are not adjacent makes two samples, as in webdataset
    scattered = write(
        tmp_path / "apart-000000.tar", archive(member("a.x", b"1"), member("b.x", b"2"), member("a.y", b"3"))
    )
    assert [s["__key__"] for s in read(scattered)[0]] == ["a", "b", "a"]
    assert read(scattered)[0] == list(wds.WebDataset(scattered, shardshuffle=False))
    tried("hostile tar members tried", 2)


# ---------------------------------------------------------------------------------- on S3


def test_hostile_and_damaged_shards_on_the_loopback_s3_server(local_s3, bucket):
    import gzip

    fs = local_s3.fs()
    # name: (bytes, kind, the samples handed on before the error)
    cases = {
        "big-000000.tar.gz": (
            gzip.compress(archive(GOOD, header("k1.big", GiB) + b"\0" * 4096, end=False)),
            "too_large",
            ["k0"],
        ),
        "neg-000000.tar": (archive(GOOD, header("k1.txt", -5) + b"\0" * 512, AFTER), "corrupt", []),
        "cut-000000.tar": (
            archive(GOOD, member("k1.txt", b"abc"), AFTER)[: len(GOOD) + 700],
            "corrupt",
            ["k0"],
        ),
        "ext-000000.tar": (
            archive(GOOD, header("x", 8 * 2**20, tarfile.XHDTYPE) + b"\0" * 8 * 2**20),
            "too_large",
            [],
        ),
        "gz-000000.tar.gz": (gzip.compress(archive(GOOD, AFTER))[:-20], "corrupt", []),
    }
    options = {"endpoint_url": local_s3.endpoint}
    handed_on: list[str] = []
    for name, (data, kind, before) in cases.items():
        fs.pipe(f"{bucket}/{name}", data)
        url = f"s3://{bucket}/{name}"
        got: list[str] = []
        with pytest.raises(sp.ShardError) as caught:
            got.extend(s["__key__"] for s in WebDataset(url, shardshuffle=False, storage_options=options))
        assert caught.value.kind == kind and url in str(caught.value), (name, caught.value)
        assert got == before, name
        handed_on += before
    urls = [f"s3://{bucket}/{name}" for name in cases]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardWarning)
        dataset = WebDataset(urls, shardshuffle=False, storage_options=options, handler=warn_and_continue)
        assert [s["__key__"] for s in dataset] == handed_on
    assert dataset.shard_stats().skipped == len(cases)
    tried("hostile tar members tried", len(cases))
