"""Writing shards: formats without pickle, naming, atomic writes, S3, the CLI, the synthetic set."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

import siftpipe as sp
from siftpipe.adapters.webdataset import WebDataset
from siftpipe.cli import main
from siftpipe.streaming.opener import ShardOpener, ShardReader
from siftpipe.streaming.shards import (
    decode_sample,
    encode_sample,
    existing_shards,
    remove_shards,
    synthetic_arrays,
    synthetic_classification,
    write_shards,
)


def read_all(urls, **options):
    return [decode_sample(s) for s in ShardReader(ShardOpener(options or None))(urls)]


def test_dict_samples_round_trip_with_plain_formats(tmp_path):
    samples = [
        {
            "__key__": f"k{i:03d}",
            "image.npy": np.full((2, 3), i, dtype=np.uint8),
            "feat": torch.arange(4, dtype=torch.float32) * i,  # tensor without extension -> .npy
            "cls": i % 3,
            "caption.txt": f"sample {i}",
            "meta.json": {"i": i, "tags": ["a"]},
            "raw.bin": bytes([i]),
            "loss": float(i) / 2,  # float without extension -> .npy
        }
        for i in range(25)
    ]
    written = write_shards(samples, str(tmp_path / "ds" / "part"), samples_per_shard=10, progress=False)
    assert written.counts == [10, 10, 5] and written.samples == 25
    assert written.pattern == f"{tmp_path}/ds/part-{{000000..000002}}.tar"
    assert [os.path.basename(u) for u in written.urls] == [f"part-00000{i}.tar" for i in range(3)]
    back = read_all(written.urls)
    assert [s["__key__"] for s in back] == [s["__key__"] for s in samples]
    s = back[7]
    assert s["image.npy"].dtype == np.uint8 and (s["image.npy"] == 7).all()
    assert s["feat.npy"].tolist() == [0.0, 7.0, 14.0, 21.0]
    assert s["cls"] == 1 and s["caption.txt"] == "sample 7" and s["meta.json"] == {"i": 7, "tags": ["a"]}
    assert s["raw.bin"] == b"\x07" and float(s["loss.npy"]) == 3.5
    assert not any(k.endswith(".tmp") or ".partial" in k for k in os.listdir(tmp_path / "ds"))


def test_shards_hold_no_pickle_and_webdataset_decodes_them_the_same(tmp_path):
    written = write_shards(
        synthetic_classification(30, dim=4), str(tmp_path / "s"), samples_per_shard=30, progress=False
    )
    with tarfile.open(written.urls[0]) as tar:
        names = tar.getnames()
        for member in tar:
            data = tar.extractfile(member).read()
            if member.name.endswith(".npy"):
                np.load(io.BytesIO(data), allow_pickle=False)  # raises on object (pickled) arrays
            assert b"\x80\x04\x95" not in data[:16]  # no pickle protocol header
    assert {n.split(".", 1)[1] for n in names} == {"x.npy", "cls", "hard.cls"}
    ours = read_all(written.urls)
    theirs = list(wds.WebDataset(written.urls, shardshuffle=False).decode())
    for a, b in zip(ours, theirs):
        assert a["__key__"] == b["__key__"] and a["cls"] == b["cls"]
        np.testing.assert_array_equal(a["x.npy"], b["x.npy"])


def test_arrays_are_written_as_x_npy_and_y_cls(tmp_path):
    x = torch.randn(12, 3)
    y = torch.arange(12) % 4
    written = write_shards((x, y), str(tmp_path / "arr"), samples_per_shard=5, progress=False)
    back = read_all(written.urls)
    assert written.counts == [5, 5, 2]
    assert [s["__key__"] for s in back] == [f"{i:09d}" for i in range(12)]
    np.testing.assert_array_equal(np.stack([s["x.npy"] for s in back]), x.numpy())
    assert [s["y.cls"] for s in back] == y.tolist()
    written = write_shards((x.numpy(), x.numpy()[:, 0]), str(tmp_path / "reg"), progress=False)
    assert read_all(written.urls)[3]["y.npy"] == pytest.approx(float(x[3, 0]))


def test_same_samples_give_byte_identical_shards(tmp_path):
    a = write_shards(synthetic_classification(20), str(tmp_path / "a"), progress=False)
    b = write_shards(synthetic_classification(20), str(tmp_path / "b"), progress=False)
    assert Path(a.urls[0]).read_bytes() == Path(b.urls[0]).read_bytes()


@pytest.mark.parametrize(
    "sample,match",
    [
        ({"__key__": "a.b", "x.npy": np.zeros(2)}, r"key 'a\.b' cannot name tar members.*dot-free"),
        ({"__key__": "k", "obj.npy": np.array([object()], dtype=object)}, r"field 'obj\.npy'.*no pickle"),
        ({"__key__": "k", "label.cls": 1.5}, r"field 'label\.cls'.*not an integer"),
        ({"__key__": "k", "thing.xyz": object()}, r"no encoder for \.xyz.*no pickle"),
        ({"__key__": "k"}, r"sample 'k' has no fields"),
        ({"__key__": "k", "x": np.zeros(1), "x.npy": np.zeros(1)}, r"two fields are stored as 'x\.npy'"),
        # found by review, 2026-12-05: written, then read back as other samples or none
        ({"__key__": "k", "a/b.txt": "x"}, r"field 'a/b\.txt': a field name cannot hold '/', NUL"),
        ({"__key__": "__a__/b", "cls": 1}, r"readers skip the member __a__/b\.cls as metadata"),
        ({"__key__": "a\0b", "cls": 1}, r"no NUL character"),
        ({"__key__": "k", "txt\0junk": "x"}, r"cannot hold '/', NUL"),
        ({"__key__": "k\udcff", "cls": 1}, r"not valid Unicode text"),
        ({"__key__": "k", "t\udcffxt": "x"}, r"cannot hold '/', NUL or a lone surrogate"),
        ({"__key__": "k" * 70_000, "cls": 1}, r"at most 65536 bytes"),
        ({"__key__": "k", "a.TXT": "x", "a.txt": "y"}, r"two fields are stored as 'a\.txt'"),
    ],
)
def test_unstorable_samples_name_the_sample_field_and_fix(sample, match):
    with pytest.raises(sp.ConfigError, match=match):
        encode_sample(sample)


def test_keys_of_any_length_and_script_are_written_as_webdataset_reads_them(tmp_path):
    # found by review, 2026-12-05: a key over 100 characters failed with tarfile's bare
    # "name is too long" (USTAR), where webdataset's TarWriter writes it
    keys = ["k" * 150, "d/" * 60 + "x" * 120, "ключ-ü", "plain"]
    shards = write_shards(
        [{"__key__": k, "cls": i} for i, k in enumerate(keys)], str(tmp_path / "t"), progress=False
    )
    for read in (wds.WebDataset, WebDataset):
        got = [(s["__key__"], s["cls"]) for s in read(shards.urls, shardshuffle=False)]
        assert got == [(k, str(i).encode()) for i, k in enumerate(keys)], read
    # two adjacent samples of one key would be read as one with two members per field: refused
    with pytest.raises(sp.ConfigError, match=r"samples 1 and 2 have the same key 'b'"):
        write_shards([{"__key__": k, "cls": 0} for k in "abb"], str(tmp_path / "dup"), progress=False)


def test_a_failure_mid_write_leaves_no_partial_shard(tmp_path):
    def samples():
        yield from synthetic_classification(15)
        yield {"__key__": "bad", "thing.xyz": object()}

    with pytest.raises(sp.ConfigError):
        write_shards(samples(), str(tmp_path / "p"), samples_per_shard=10, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["p-000000.tar"]  # the finished first shard only


def test_bad_prefixes_and_sizes_are_config_errors(tmp_path):
    with pytest.raises(sp.ConfigError, match="without their suffix"):
        write_shards([], str(tmp_path / "x.tar"), progress=False)
    with pytest.raises(sp.ConfigError, match="samples_per_shard"):
        write_shards([], str(tmp_path / "x"), samples_per_shard=0, progress=False)
    with pytest.raises(sp.ConfigError, match="dataset is empty"):
        write_shards([], str(tmp_path / "x"), progress=False)


def test_writing_to_s3_and_to_a_missing_bucket(local_s3, bucket):
    options = {"endpoint_url": local_s3.endpoint}
    written = write_shards(
        synthetic_classification(50),
        f"s3://{bucket}/d/train",
        samples_per_shard=20,
        storage_options=options,
        progress=False,
    )
    assert written.urls[0] == f"s3://{bucket}/d/train-000000.tar" and written.counts == [20, 20, 10]
    assert len(read_all(written.urls, **options)) == 50
    with pytest.raises(
        sp.ShardError, match=r"writing shard s3://no-such-bucket-w/t-000000\.tar failed.*bucket"
    ):
        write_shards(
            synthetic_classification(5),
            "s3://no-such-bucket-w/t",
            storage_options=options,
            retries=0,
            progress=False,
        )


def test_synthetic_data_has_an_easy_majority_and_a_hard_tail():
    x, y, hard = synthetic_arrays(4000, dim=8, classes=4, hard_fraction=0.1, seed=3)
    assert x.shape == (4000, 8) and x.dtype == np.float32 and set(np.unique(y)) == {0, 1, 2, 3}
    assert 0.08 < hard.mean() < 0.12
    # a nearest-centre rule (what a model learns first) gets the easy samples right, not the hard
    centres = np.stack([x[(y == c) & ~hard].mean(0) for c in range(4)])
    pred = np.argmin(((x[:, None, :] - centres[None]) ** 2).sum(-1), axis=1)
    assert (pred[~hard] == y[~hard]).mean() > 0.99
    assert (pred[hard] == y[hard]).mean() < 0.9
    again = synthetic_arrays(4000, dim=8, classes=4, hard_fraction=0.1, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((x, y, hard), again))
    first = next(synthetic_classification(1, dim=8))
    assert sorted(first) == ["__key__", "cls", "hard.cls", "x.npy"]


def test_cli_writes_shards_to_the_loopback_s3(local_s3, bucket, capsys):
    code = main(
        [
            "shards",
            "write",
            f"s3://{bucket}/cli/train",
            "--samples",
            "250",
            "--per-shard",
            "100",
            "--dim",
            "6",
            "--quiet",
            "--storage-option",
            f"endpoint_url={local_s3.endpoint}",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {
        "pattern": f"s3://{bucket}/cli/train-{{000000..000002}}.tar",
        "shards": 3,
        "samples": 250,
        "samples_per_shard": 100,
    }
    back = read_all(wds.shardlists.expand_urls(summary["pattern"]), endpoint_url=local_s3.endpoint)
    assert len(back) == 250 and back[0]["x.npy"].shape == (6,)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_prefix_holding_shards_is_refused_or_replaced_whole_never_mixed(where, tmp_path, request, capsys):
    """Found by review (2026-12-05): a smaller dataset written over a larger one replaced its
    first shards and left its last ones beside them; a reader of the prefix read both mixed."""
    options: list[str] = []
    if where == "s3":
        local_s3, bucket = request.getfixturevalue("local_s3"), request.getfixturevalue("bucket")
        prefix, options = f"s3://{bucket}/mixed/t", ["--storage-option", f"endpoint_url={local_s3.endpoint}"]
    else:
        prefix = str(tmp_path / "mixed" / "t")
    write = ["shards", "write", prefix, "--per-shard", "10", "--quiet", *options]
    assert main([*write, "--samples", "50"]) == 0
    storage = {"endpoint_url": local_s3.endpoint} if where == "s3" else None
    assert existing_shards(prefix, storage) == [f"{prefix}-{i:06d}.tar" for i in range(5)]
    capsys.readouterr()
    assert main([*write, "--samples", "20", "--seed", "1"]) == 2
    assert "already holds 5 shard(s)" in capsys.readouterr().err
    assert len(existing_shards(prefix, storage)) == 5  # nothing written
    assert main([*write, "--samples", "20", "--seed", "1", "--overwrite"]) == 0
    assert existing_shards(prefix, storage) == [f"{prefix}-{i:06d}.tar" for i in range(2)]
    # the library's default keeps what it does not write over, as before
    write_shards(synthetic_classification(50), prefix, samples_per_shard=10, progress=False,
                 storage_options=storage)  # fmt: skip
    write_shards(synthetic_classification(10), prefix, samples_per_shard=10, progress=False,
                 storage_options=storage)  # fmt: skip
    assert len(existing_shards(prefix, storage)) == 5
    # a prefix holding glob characters is a name, not a pattern (the review of the fix: exp[1]
    # found none of its shards, and t? another dataset's)
    if where == "local":
        odd = str(tmp_path / "exp[1]" / "t?")
        write_shards(synthetic_classification(30), odd, samples_per_shard=10, progress=False)
        write_shards(synthetic_classification(30), str(tmp_path / "exp[1]" / "ta"), samples_per_shard=10,
                     progress=False)  # fmt: skip
        assert existing_shards(odd) == [f"{odd}-{i:06d}.tar" for i in range(3)]
        write_shards(
            synthetic_classification(10), odd, samples_per_shard=10, progress=False, existing="replace"
        )
        assert existing_shards(odd) == [f"{odd}-000000.tar"]
        assert len(existing_shards(str(tmp_path / "exp[1]" / "ta"))) == 3
    # a prefix at a filesystem's root (the review of the fix: memory://train found none)
    if where == "local":
        write_shards(synthetic_classification(20), "memory://train", samples_per_shard=10, progress=False)
        assert existing_shards("memory://train") == [f"memory://train-{i:06d}.tar" for i in range(2)]
        remove_shards(existing_shards("memory://train"))
    with pytest.raises(sp.ConfigError, match="existing must be"):
        write_shards(synthetic_classification(10), prefix, existing="drop", progress=False)  # type: ignore[arg-type]


def test_writing_where_the_listing_is_refused_gives_one_line_that_names_the_fix():
    """shards write (and demo --store) list the prefix for shards already there before they
    write; refused credentials there ended in a raw botocore traceback (found by review,
    2026-12-05). It is the write's ShardError now, naming the fix and no secret."""
    from tests.faults import AuthS3

    key, secret = "AKIASIFTPIPELISTING1", "lIsTiNg/SeCrEt+KeY/ab12cd34ef56gh78ij90"
    server = AuthS3()
    try:
        options = ["--storage-option", f"endpoint_url={server.endpoint}",
                   "--storage-option", f"key={key}", "--storage-option", f"secret={secret}"]  # fmt: skip
        with pytest.raises(SystemExit) as exited:  # (its message is what the process prints)
            main(["shards", "write", "s3://secured-bucket/t", "--samples", "10", "--quiet", *options])
        storage = {"endpoint_url": server.endpoint, "key": key, "secret": secret}
        with pytest.raises(sp.ShardError, match="listing shards at s3://secured-bucket/t failed") as caught:
            existing_shards("s3://secured-bucket/t", storage)
    finally:
        server.stop()
    err = str(exited.value.code)
    assert "\n" not in err and "Traceback" not in err
    assert "listing shards at s3://secured-bucket/t failed" in err and "check the credentials" in err
    assert caught.value.kind == "denied"
    assert secret not in err and secret not in str(caught.value)
    # retried as the write is: write_shards' retries= counts for it (the review of the fix: 5, always)
    refusing = {"endpoint_url": "http://127.0.0.1:9", "key": key, "secret": secret,
                "config_kwargs": {"retries": {"total_max_attempts": 1}}}  # fmt: skip
    with pytest.raises(sp.ShardError, match=r"listing shards at .* after 1 attempt\(s\)"):
        write_shards(synthetic_classification(10), "s3://refusing/t", storage_options=refusing,
                     existing="refuse", retries=0, progress=False)  # fmt: skip


def test_cli_errors_name_the_problem(local_s3):
    with pytest.raises(SystemExit, match=r"bucket 'no-such-cli-bucket' does not exist"):
        main(
            [
                "shards",
                "write",
                "s3://no-such-cli-bucket/t",
                "--samples",
                "5",
                "--quiet",
                "--storage-option",
                f"endpoint_url={local_s3.endpoint}",
            ]
        )


def test_cli_usage_errors_exit_2_unmangled_and_a_failed_write_1(local_s3, capsys):
    # found by review: a malformed --storage-option and --samples 0 exited 1 in `shards write`
    # (2 in `log`), and the redactor turned the message's own KEY=VALUE into KEY=***
    write = ["shards", "write", "/tmp/x/t", "--quiet"]
    assert main([*write, "--samples", "3", "--storage-option", "novalue"]) == 2
    err = capsys.readouterr().err
    assert "takes NAME=VALUE" in err and "***" not in err
    assert main([*write, "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err
    # a negative seed was numpy's traceback and exit 1 (found by review, 2026-12-05)
    assert main([*write, "--samples", "3", "--seed", "-1"]) == 2
    assert "--seed must be >= 0" in capsys.readouterr().err
    assert main(["log", "verify", "/nonexistent", "--storage-option", "novalue"]) == 2
    assert "takes NAME=VALUE" in capsys.readouterr().err
    # named by their flags, before any work: the library's errors named its parameters
    # (samples_per_shard, "need n >= 0, dim >= 2") after a progress bar had started (review,
    # 2026-12-06)
    for flag, value in (("--per-shard", "0"), ("--dim", "1"), ("--classes", "1"), ("--hard-fraction", "2")):
        assert main(["shards", "write", "/tmp/x/t", "--samples", "3", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"siftpipe: error: shards write: {flag} must be") and err.count("\n") == 1, err
    for flag, value in (("--top", "2.0"), ("--uniform", "0"), ("--prune", "1.5"), ("--beta", "-1")):
        assert main(["log", "whatif", "/nonexistent", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"siftpipe: error: log whatif: {flag} {float(value)}: "), err


def test_a_local_destination_that_cannot_be_made_is_a_shard_error_naming_it(tmp_path, capsys):
    # found 2026-12-04: a folder that could not be created gave a raw FileNotFoundError /
    # NotADirectoryError traceback from `siftpipe shards write`, naming no shard and no fix
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    with pytest.raises(sp.ShardError, match=r"cannot write shard .*a_file/sub/t-000000\.tar") as caught:
        write_shards(synthetic_classification(5), str(blocker / "sub" / "t"), progress=False)
    assert "folder can be created" in str(caught.value)
    assert caught.value.url.endswith("a_file/sub/t-000000.tar")
    with pytest.raises(SystemExit, match="cannot write shard"):
        main(["shards", "write", str(blocker / "sub" / "t"), "--samples", "5", "--quiet"])


def test_a_failed_write_gives_no_readers_advice(local_s3):
    # found by review (2026-12-05): a write that failed (an endpoint that does not answer) ended
    # with "pass handler=warn_and_continue to skip shards that cannot be read": no fix for a write
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    with pytest.raises(sp.ShardError, match=r"writing shard s3://some-bucket/t-000000\.tar failed") as caught:
        write_shards(
            synthetic_classification(5),
            "s3://some-bucket/t",
            storage_options={
                "endpoint_url": dead,
                "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
            },
            retries=0,
            progress=False,
        )
    assert "warn_and_continue" not in str(caught.value)


def test_an_error_of_the_callers_own_samples_comes_back_as_it_was(tmp_path):
    # found by review (2026-12-05): an input file the caller's generator could not open came
    # back as a ShardError blaming the destination, no longer a FileNotFoundError
    def samples():
        yield from synthetic_classification(3)
        open(tmp_path / "no-such-input.jpg", "rb")  # noqa: SIM115

    with pytest.raises(FileNotFoundError, match="no-such-input.jpg") as caught:
        write_shards(samples(), str(tmp_path / "out" / "t"), progress=False)
    assert not isinstance(caught.value, sp.ShardError)
    assert not list((tmp_path / "out").glob("*"))  # nothing partial left


def test_a_shard_that_cannot_be_opened_gets_a_readers_advice_not_a_writers(tmp_path):
    """Opening a directory given as a shard, or a rename_files that raised, said "check the
    destination URL": the advice of a failed write (found by review, 2026-12-05)."""
    from siftpipe.streaming.opener import ShardOpener, ShardReader, reraise_exception

    folder = tmp_path / "adir.tar"
    folder.mkdir()
    with pytest.raises(sp.ShardError) as caught:
        list(ShardReader(ShardOpener(), reraise_exception)([str(folder)]))
    text = str(caught.value)
    assert "opening shard" in text and "destination" not in text and "warn_and_continue" in text


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_replace_interrupted_or_failing_leaves_the_old_dataset_whole_or_says_which_is_which(
    where, tmp_path, request
):
    """Found by review (2026-12-05): each new shard replaced the old one of its number as it was
    written, so a Ctrl-C (or a failing destination) during --overwrite left two datasets mixed at
    the prefix, nothing said; and old shards that could not be removed gave a raw traceback."""
    import fsspec

    if where == "s3":
        local_s3, bucket = request.getfixturevalue("local_s3"), request.getfixturevalue("bucket")
        prefix, storage = f"s3://{bucket}/swap/t", {"endpoint_url": local_s3.endpoint}
    else:
        prefix, storage = str(tmp_path / "swap" / "t"), None
    fs, _ = fsspec.core.url_to_fs(prefix, **(storage or {}))

    def contents():
        return [fs.cat(fs._strip_protocol(u)) for u in existing_shards(prefix, storage)]

    def files():
        return sorted(fs.ls(fs._strip_protocol(prefix).rpartition("/")[0], detail=False))

    write_shards(synthetic_classification(50, seed=0), prefix, samples_per_shard=10, progress=False,
                 storage_options=storage)  # fmt: skip
    old, listed = contents(), files()

    def interrupted():
        for i, sample in enumerate(synthetic_classification(50, seed=1)):
            if i == 25:
                raise KeyboardInterrupt
            yield sample

    with pytest.raises(KeyboardInterrupt):
        write_shards(interrupted(), prefix, samples_per_shard=10, progress=False, storage_options=storage,
                     existing="replace")  # fmt: skip
    assert contents() == old and files() == listed  # whole, no staged file left
    write_shards(synthetic_classification(20, seed=1), prefix, samples_per_shard=10, progress=False,
                 storage_options=storage, existing="replace")  # fmt: skip
    new = contents()
    assert len(new) == 2 and new[0] != old[0]
    if where == "local":
        # a shard that cannot be replaced (a folder at its path): which shards are which, said
        write_shards(synthetic_classification(50, seed=0), prefix, samples_per_shard=10, progress=False,
                     existing="replace")  # fmt: skip
        os.remove(f"{prefix}-000002.tar")
        os.mkdir(f"{prefix}-000002.tar")
        said = "stopped at shard 2.*shards 0 to 1 hold the new dataset, shards 2 to 4 the earlier one, "
        with pytest.raises(sp.ShardError, match=said):
            write_shards(synthetic_classification(50, seed=1), prefix, samples_per_shard=10, progress=False,
                         existing="replace")  # fmt: skip
        assert not [f for f in files() if ".partial-" in f]
        # old shards that cannot be removed: a ShardError naming them, not a traceback
        os.rmdir(f"{prefix}-000002.tar")
        write_shards(synthetic_classification(50, seed=0), prefix, samples_per_shard=10, progress=False,
                     existing="replace")  # fmt: skip
        os.remove(f"{prefix}-000004.tar")
        os.mkdir(f"{prefix}-000004.tar")
        open(f"{prefix}-000004.tar/x", "w").close()
        with pytest.raises(
            sp.ShardError, match="new shards are written, but removing.*000004.tar.*left beside"
        ):
            write_shards(synthetic_classification(20, seed=1), prefix, samples_per_shard=10, progress=False,
                         existing="replace")  # fmt: skip


def test_removing_a_shard_already_gone_counts_as_removed(tmp_path):
    """remove_shards of a shard another process (a lifecycle rule) removed first said the new
    shards were written and asked the user to delete the shard that was not there (found by
    review, 2026-12-06)."""
    shards = write_shards(
        synthetic_classification(30), str(tmp_path / "t"), samples_per_shard=10, progress=False
    )
    os.remove(shards.urls[1])
    remove_shards(shards.urls)
    assert existing_shards(str(tmp_path / "t")) == []
    os.mkdir(shards.urls[0])  # one that cannot be removed: named, with no word of a write
    open(os.path.join(shards.urls[0], "x"), "w").close()
    with pytest.raises(sp.ShardError, match=r"removing shard .*t-000000.tar failed.*1 shard\(s\)") as caught:
        remove_shards([shards.urls[0]])
    assert "written" not in str(caught.value)
