"""The audit log: one record per decided sample, written in the background, read back exactly."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from tests.common import REPO, loss_field, make_samples, roundtrip
from tests.contract import output_keys

SAMPLES = make_samples(1000, seed=4)


def sift_all(root, samples=SAMPLES, storage_options=None, flush_every=128, writer="process", **kwargs):
    log = sp.AuditLog(
        root, storage_options=storage_options, flush_every=flush_every, run_id="r1", writer=writer
    )
    s = sp.Sifter(
        None,
        loss_field,
        kwargs.pop("policy", sp.RelativeProbabilistic(1.0, 100)),
        micro_batch=32,
        audit=log,
        seed=3,
        **kwargs,
    )
    out = list(s(samples))
    s.close()
    return s, out, log


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_one_record_per_sample_with_the_documented_columns(tmp_path, writer):
    s, out, log = sift_all(str(tmp_path), delay=50, writer=writer)
    table = sp.read_log(str(tmp_path))
    assert table.num_rows == len(SAMPLES) == s.stats.seen
    assert set(sp.COLUMNS) | {"run", "rank"} == set(table.column_names)
    assert table.column("seq").to_pylist() == list(range(len(SAMPLES)))
    assert table.column("key").to_pylist() == [x["__key__"] for x in SAMPLES]
    assert table.column("url").to_pylist() == [x["__url__"] for x in SAMPLES]
    kept_keys = [
        k for k, kept in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()) if kept
    ]
    assert kept_keys == output_keys(out)
    reasons = table.column("reason").to_pylist()
    assert reasons[:50] == ["warmup"] * 50 and set(reasons[50:]) == {"policy"}
    np.testing.assert_allclose(table.column("loss").to_numpy(), [x["loss"] for x in SAMPLES])
    assert set(table.column("run").to_pylist()) == {"r1"} and set(table.column("rank").to_pylist()) == {0}
    assert table.column("micro_batch").to_pylist()[:65] == [0] * 32 + [1] * 32 + [2]
    assert set(table.column("source").to_pylist()) == {"forward"}
    # parts of flush_every records, each with a manifest
    files = sorted(os.listdir(tmp_path / "run=r1" / "rank=0"))
    parts = [f for f in files if f.startswith("part-")]
    manifests = [
        json.loads((tmp_path / "run=r1" / "rank=0" / f).read_text()) for f in files if "_manifest" in f
    ]
    assert len(parts) == len(manifests) == 8  # 7 parts of 128 (sealed at 128..160) and the rest
    assert sum(m["count"] for m in manifests) == 1000
    assert sorted((m["first_seq"], m["last_seq"]) for m in manifests)[0] == (0, 127)
    assert log.stats.parts_written == 8 and log.stats.records == 1000


def test_standard_readers_see_the_hive_layout(tmp_path):
    sift_all(str(tmp_path))
    assert pq.read_table(str(tmp_path)).num_rows == 1000  # pyarrow infers run= and rank=
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(
        f"select run, rank, count(*), sum(kept::int) from read_parquet('{tmp_path}/**/*.parquet', "
        "hive_partitioning=true) group by all"
    ).fetchall()
    assert rows[0][0] == "r1" and rows[0][2] == 1000
    # no pickle, and no pandas metadata, anywhere in a part
    for path in (tmp_path / "run=r1" / "rank=0").glob("part-*.parquet"):
        meta = pq.read_schema(path).metadata or {}
        assert not any(b"pandas" in k or b"pickle" in k for k in meta)


def test_a_kill_between_writing_a_part_and_renaming_it_leaves_nothing_a_reader_globs(tmp_path):
    """A local part is written aside and renamed into place; a SIGKILL between the two left
    ``_tmp-part-....parquet``, which DuckDB's ``**/*.parquet`` read (a truncated one failed the
    query, a whole one counted its records twice: found by review). The leftover now ends in
    ``.partial``: every reader sees exactly the parts that were renamed."""
    script = f"""
        import os, signal
        from fsspec.implementations.local import LocalFileSystem
        import siftpipe as sp
        from tests.common import loss_field, make_samples
        mv, calls = LocalFileSystem.mv, []
        def mv_or_die(self, *args, **kwargs):
            calls.append(args)
            if len(calls) == 6:  # the third part's rename (claim, then part and manifest twice)
                os.kill(os.getpid(), signal.SIGKILL)
            return mv(self, *args, **kwargs)
        LocalFileSystem.mv = mv_or_die
        log = sp.AuditLog({str(tmp_path)!r}, run_id="r1", flush_every=100, writer="thread")
        s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 300), micro_batch=50, audit=log)
        list(s(make_samples(1000, seed=3)))
        """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], check=False, cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == -9, done.stderr
    assert pq.read_table(str(tmp_path)).num_rows == 200  # the two parts renamed into place
    duckdb = pytest.importorskip("duckdb")
    ((count,),) = duckdb.sql(
        f"select count(*) from read_parquet('{tmp_path}/**/*.parquet', hive_partitioning=true)"
    ).fetchall()
    assert count == 200 == sp.read_log(str(tmp_path)).num_rows
    files = os.listdir(tmp_path / "run=r1" / "rank=0")
    assert [f for f in files if f.startswith("_tmp-") and f.endswith(".partial")]  # the leftover


def test_batched_mode_records_each_row(tmp_path):
    batches = [default_collate(SAMPLES[i : i + 100]) for i in range(0, 1000, 100)]
    log = sp.AuditLog(str(tmp_path), flush_every=250, run_id="b")
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.3), micro_batch=None, batched=True, audit=log)
    out = list(s(batches))
    s.close()
    table = sp.read_log(str(tmp_path))
    assert table.column("seq").to_pylist() == list(range(1000))
    assert sum(table.column("kept").to_pylist()) == sum(len(b["__key__"]) for b in out) == 300
    assert table.column("micro_batch").to_pylist()[::100] == list(range(10))


def test_the_log_on_s3(local_s3, bucket):
    root = f"s3://{bucket}/audit"
    s, out, _ = sift_all(root, storage_options=local_s3.storage_options)
    table = sp.read_log(root, local_s3.storage_options)
    assert table.num_rows == 1000 and sum(table.column("kept").to_pylist()) == len(out)
    assert sp.verify_log(root, local_s3.storage_options).ok


def test_missing_keys_are_named_and_key_none_logs_without_keys(tmp_path):
    samples = [{k: v for k, v in x.items() if k != "__key__"} for x in SAMPLES[:10]]
    log = sp.AuditLog(str(tmp_path / "a"))
    with pytest.raises(sp.MissingKeyError, match=r"sample seq 0 has no key field '__key__'.*key=None"):
        list(sp.Sifter(None, loss_field, micro_batch=5, audit=log)(samples))
    log = sp.AuditLog(str(tmp_path / "b"), run_id="nokeys")
    s = sp.Sifter(None, loss_field, micro_batch=5, audit=log, key=None)
    list(s(samples))
    s.close()
    assert sp.read_log(str(tmp_path / "b")).column("key").null_count == 10


def test_resume_continues_the_log_without_gap_or_duplicate(tmp_path):
    root = str(tmp_path / "resumed")
    reference = sift_all(str(tmp_path / "ref"))[0]
    ref_table = sp.read_log(str(tmp_path / "ref"))

    log = sp.AuditLog(root, flush_every=128, run_id="r1")
    first = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 100), micro_batch=32, audit=log, seed=3)
    it = first(SAMPLES)
    for _ in range(150):
        next(it)
    state = roundtrip(first.state_dict())
    for _ in range(100):  # the run goes on past the checkpoint, then dies
        next(it)
    log.flush()
    log.close()

    log2 = sp.AuditLog(root, flush_every=128)
    second = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(1.0, 100), micro_batch=32, audit=log2, seed=3
    )
    second.load_state_dict(state)
    assert log2.run_id == "r1"
    list(second(SAMPLES[state["consumed"] :]))
    second.close()

    table = sp.read_log(root)
    assert table.column("seq").to_pylist() == list(range(1000))
    assert table.column("kept").to_pylist() == ref_table.column("kept").to_pylist()
    assert second.stats.kept == reference.stats.kept
    everything = sp.read_log(root, include_superseded=True)
    assert everything.num_rows > 1000  # the dead attempt's records past the checkpoint are kept, apart
    report = sp.verify_log(root)
    assert report.ok and report.streams[0].superseded == everything.num_rows - 1000
    assert len(report.streams[0].attempts) == 2


def test_verify_finds_a_missing_and_a_truncated_part(tmp_path):
    sift_all(str(tmp_path))
    rank_dir = tmp_path / "run=r1" / "rank=0"
    parts = sorted(rank_dir.glob("part-*.parquet"))
    parts[2].unlink()
    data = parts[4].read_bytes()
    parts[4].write_bytes(data[: len(data) // 2])
    report = sp.verify_log(str(tmp_path))
    assert not report.ok
    text = "\n".join(report.lines())
    assert "manifest found, Parquet object missing" in text and "unreadable part" in text
    assert report.streams[0].gaps  # the records of both parts are missing from the sequence
    with pytest.warns(RuntimeWarning) as caught:
        table = sp.read_log(str(tmp_path))
    said = [str(w.message) for w in caught]
    assert any("unreadable" in m and "the rest of the log was read" in m for m in said)
    # the missing part is said too, with what it held (before: dropped without a word)
    assert any("part 2 of attempt" in m and "no Parquet object" in m and "seq 256..383" in m for m in said)
    assert table.num_rows == 1000 - 2 * 128
    with pytest.raises(sp.AuditError, match="no Parquet object"):
        sp.read_log(str(tmp_path), on_bad_part="raise")
    command = [sys.executable, "-m", "siftpipe", "log", "keys", str(tmp_path)]
    keys = subprocess.run(command, check=False, capture_output=True, text=True)
    assert keys.returncode == 0 and "skipping part 2 of attempt" in keys.stderr
    assert "seq 256..383" in keys.stderr


def test_the_url_column_of_samples_that_carried_none_reads_as_nulls(tmp_path):
    """Samples with no ``__url__`` (in-memory lists): ``read_log(url)["url"].to_numpy()``, as
    README reads ``kept``, raised pyarrow's ``IndexError: cannot do a non-empty take from an
    empty axes`` (found by review, 2026-12-06)."""
    samples = [{k: v for k, v in sample.items() if k != "__url__"} for sample in make_samples(300)]
    sift_all(str(tmp_path), samples=samples, flush_every=64)
    table = sp.read_log(str(tmp_path))
    assert table.num_rows == 300 and table["url"].null_count == 300
    assert len(table["url"].to_numpy(zero_copy_only=False)) == 300  # ('' for null: pyarrow's way)
    assert table["url"].to_pylist() == [None] * 300
    # the column's type is a logged url's, so the tables of two reads concatenate
    with_urls = tmp_path / "with"
    sift_all(str(with_urls), samples=make_samples(100))
    assert sp.read_log(str(with_urls)).schema == table.schema
    assert table["run"].to_numpy(zero_copy_only=False).tolist() == ["r1"] * 300  # (dictionary kept)


@pytest.mark.parametrize("copy_to", ["run=r1/rank=1", "run=r2/rank=0"])
def test_a_stream_folder_copied_under_another_rank_or_run_is_a_problem_not_more_records(tmp_path, copy_to):
    """A single-rank log's rank=0 folder copied to rank=1 (or its run to another run id):
    verify said OK with twice the records and summary counted them twice, though every object
    under the copy names the run and rank that wrote it (found by review, 2026-12-05)."""
    import shutil

    sift_all(str(tmp_path))
    shutil.copytree(tmp_path / "run=r1" / "rank=0", tmp_path / copy_to)
    report = sp.verify_log(str(tmp_path))
    assert not report.ok and [s.ok for s in report.streams] == [True, False]
    copied = report.streams[1]
    assert copied.misplaced and "written by run=r1 rank=0" in copied.misplaced[0]
    assert "misplaced: attempt" in "\n".join(report.lines())
    with pytest.warns(RuntimeWarning, match="written by run=r1 rank=0: copied or moved here"):
        sp.read_log(str(tmp_path))
    with pytest.raises(sp.AuditError, match="copied or moved here"):
        sp.read_log(str(tmp_path), on_bad_part="raise")
    # the original alone reads as before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sp.read_log(str(tmp_path), run="r1", rank=0).num_rows == 1000


def test_a_part_copied_beyond_the_parts_its_end_marker_names_is_warned_by_every_reader(tmp_path):
    """part 1 copied as part N (past the N its closed attempt wrote): verify counted duplicates,
    but read_log, summary, keys and whatif counted its records again without a word (found by
    review, 2026-12-05)."""
    import shutil

    sift_all(str(tmp_path))
    rank_dir = tmp_path / "run=r1" / "rank=0"
    parts = sorted(rank_dir.glob("part-*.parquet"))
    copy = rank_dir / parts[1].name.replace(f"part-{1:08d}-", f"part-{len(parts):08d}-")
    shutil.copy(parts[1], copy)
    assert not sp.verify_log(str(tmp_path)).ok
    with pytest.warns(RuntimeWarning, match=f"part\\(s\\) {len(parts)} of attempt .* lie outside the parts"):
        # and, since it repeats the sequence numbers of part 1, left out (2026-12-05, eighth session)
        assert sp.read_log(str(tmp_path)).num_rows == 1000
    with pytest.raises(sp.AuditError, match="lie outside the parts"):
        sp.read_log(str(tmp_path), on_bad_part="raise")
    for command in (["summary"], ["keys", "--dropped"]):
        done = subprocess.run(
            [sys.executable, "-m", "siftpipe", "log", command[0], str(tmp_path), *command[1:]],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        assert "lie outside the parts its end marker says it wrote" in done.stderr, command


def test_a_part_copied_under_another_attempts_name_is_warned_by_every_reader(tmp_path):
    """part 3 and its manifest copied under a made-up attempt id (a sync tool's conflict copy):
    read as a later attempt of the same job that resumed from seq 0, it cut away the 1000
    records the job decided, and summary, keys and read_log said 128 without a word, though the
    copy's own objects name the attempt that wrote them (found by review, 2026-12-05)."""
    import shutil

    sift_all(str(tmp_path))
    rank_dir = tmp_path / "run=r1" / "rank=0"
    (end,) = rank_dir.glob("_end-*.json")
    attempt = end.name[len("_end-") : -len(".json")]
    for name in (f"part-{3:08d}-{attempt}.parquet", f"_manifest-{3:08d}-{attempt}.json"):
        shutil.copy(rank_dir / name, rank_dir / name.replace(attempt, "ffffffff"))
    report = sp.verify_log(str(tmp_path))
    assert not report.ok and f"written by attempt {attempt}" in report.streams[0].misplaced[0]
    with pytest.warns(RuntimeWarning, match=f"written by attempt {attempt}: copied or moved here"):
        sp.read_log(str(tmp_path))
    with pytest.raises(sp.AuditError, match="copied or moved here"):
        sp.read_log(str(tmp_path), on_bad_part="raise")
    for command in (["summary"], ["keys"]):
        done = subprocess.run(
            [sys.executable, "-m", "siftpipe", "log", command[0], str(tmp_path), *command[1:]],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        assert f"written by attempt {attempt}: copied or moved here" in done.stderr, command
    # the log as written reads as before, with nothing said
    for name in rank_dir.glob("*-ffffffff.*"):
        name.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sp.read_log(str(tmp_path)).num_rows == 1000


def test_a_kill_between_the_last_part_and_its_manifest_loses_nothing_and_verify_says_so(tmp_path):
    """S3 puts are atomic and a part is written before its manifest: a SIGKILL between the two
    leaves a readable last part without manifest. Its records are all there (a note, not a
    problem); a missing manifest anywhere else, or in an attempt that closed, still is one."""
    sift_all(str(tmp_path))
    rank_dir = tmp_path / "run=r1" / "rank=0"
    manifests = sorted(rank_dir.glob("_manifest-*.json"))
    (end,) = rank_dir.glob("_end-*.json")
    manifests[-1].unlink()
    closed = sp.verify_log(str(tmp_path))  # the attempt closed: its manifests must all be there
    assert not closed.ok and "no manifest" in "\n".join(closed.lines())
    end.unlink()  # now it looks killed right after writing its last part
    killed = sp.verify_log(str(tmp_path))
    assert killed.ok and killed.records == 1000, "\n".join(killed.lines())
    assert "killed between writing its last part" in "\n".join(killed.lines())
    manifests[3].unlink()  # a manifest missing in the middle is not what a kill leaves
    middle = sp.verify_log(str(tmp_path))
    assert not middle.ok and len(middle.streams[0].count_mismatches) == 1


def test_filters_by_run_rank_and_kept(tmp_path):
    for run in ("a", "b"):
        log = sp.AuditLog(str(tmp_path), run_id=run, rank=1 if run == "b" else 0, flush_every=300)
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=log)
        list(s(SAMPLES[:500]))
        s.close()
    assert sp.read_log(str(tmp_path)).num_rows == 1000
    assert set(sp.read_log(str(tmp_path), run="b").column("rank").to_pylist()) == {1}
    assert sp.read_log(str(tmp_path), rank=0).num_rows == 500
    dropped = sp.read_log(str(tmp_path), kept=False, columns=["key"])
    assert dropped.column_names == ["key", "run", "rank"]
    assert dropped.num_rows == 1000 - sum(sp.read_log(str(tmp_path)).column("kept").to_pylist())
    # a column name the log does not have is an error naming it (Parquet's reader skipped it,
    # and a typo read as a column never logged; found by review, 2026-12-05)
    with pytest.raises(sp.ConfigError, match=r"names \['los'\].*'loss'"):
        sp.read_log(str(tmp_path), columns=["los", "kept"])
    assert sp.read_log(str(tmp_path), columns="loss").column_names == ["loss", "run", "rank"]


def test_storage_stopping_mid_run_loses_nothing(own_s3):
    bucket = own_s3.new_bucket()
    root = f"s3://{bucket}/log"
    options = {
        **own_s3.storage_options,
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    log = sp.AuditLog(root, storage_options=options, flush_every=64, retry_timeout=120)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=16, audit=log)
    it = s(SAMPLES)
    for _ in range(50):
        next(it)
    log.flush()
    own_s3.stop()  # storage goes away while the run continues
    restart = threading.Timer(3.0, own_s3.start)
    restart.start()
    rest = list(it)
    time.sleep(0.5)
    s.close()  # waits for the retries to catch up
    restart.join()
    assert log.stats.retries > 0
    table = sp.read_log(root, own_s3.storage_options)
    assert table.column("seq").to_pylist() == list(range(1000))
    assert sum(table.column("kept").to_pylist()) == 50 + len(rest)


def test_unwritable_destination_raises_clearly_or_counts_drops(local_s3):
    root = "s3://no-such-bucket-siftpipe/log"
    secret = "sEcReT-tHaT-mUsT-nOt-LeAk-123"
    options = {**local_s3.storage_options, "key": "AKIAWHATEVER", "secret": secret}
    log = sp.AuditLog(root, storage_options=options, flush_every=50, retry_timeout=1.0)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=log)
    with pytest.raises(sp.AuditError) as err:
        list(s(SAMPLES))
        s.close()
    message = str(err.value)
    assert "no-such-bucket-siftpipe" in message and "retries" in message and secret not in message
    assert secret not in repr(log) and "***" in repr(log)

    log = sp.AuditLog(root, storage_options=options, flush_every=100, retry_timeout=0.5, on_full="drop")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(s(SAMPLES[:300]))
        s.close()
    assert len(out) > 0 and log.stats.dropped_records == 300
    assert any("dropped audit part" in str(w.message) and secret not in str(w.message) for w in caught)


def test_run_id_and_unknown_state(tmp_path):
    log = sp.AuditLog(str(tmp_path), run_id="x")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, audit=log)
    list(s(SAMPLES[:20]))
    state = s.state_dict()
    s.close()
    other = sp.Sifter(
        None, loss_field, sp.Uniform(0.5), micro_batch=10, audit=sp.AuditLog(str(tmp_path), run_id="y")
    )
    with pytest.raises(sp.ResumeError, match="run 'x'.*run_id='y'"):
        other.load_state_dict(state)
    plain = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10)
    list(plain(SAMPLES[:20]))
    with pytest.raises(sp.ResumeError, match="without an audit log"):
        sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, audit=str(tmp_path)).load_state_dict(
            plain.state_dict()
        )


def test_model_version_and_epoch_are_recorded(tmp_path):
    log = sp.AuditLog(str(tmp_path), run_id="v", flush_every=1000)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, audit=log)
    for step, _ in enumerate(s(SAMPLES[:50])):
        s.model_version = step
    list(s(SAMPLES[:50]))
    s.close()
    table = sp.read_log(str(tmp_path))
    assert table.column("epoch").to_pylist() == [0] * 50 + [1] * 50
    versions = table.column("model_version").to_pylist()
    assert versions[0] == -1 and versions == sorted(versions[:50]) + versions[50:]
    assert torch.tensor(versions[50:]).unique().numel() == 1


def test_a_normal_exit_flushes_what_was_never_closed(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "log")
    code = (
        "import sys; sys.path.insert(0, '.')\n"
        "import siftpipe as sp\n"
        "from tests.common import loss_field, make_samples\n"
        f"log = sp.AuditLog({root!r}, run_id='exit', flush_every=100_000)\n"
        "s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=log)\n"
        "kept = sum(1 for _ in s(make_samples(777)))\n"
        "print(kept)\n"  # no close(): the interpreter's exit must flush the 777 buffered records
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd()
    )
    table = sp.read_log(root)
    assert table.num_rows == 777 and sum(table.column("kept").to_pylist()) == int(out.stdout)
    assert sp.verify_log(root).streams[0].attempts[0]["ended"]


def test_the_writer_process_loads_neither_torch_nor_webdataset():
    """The writer process starts with only the modules it needs (about 40 MiB and 0.2 s, where
    importing siftpipe.errors drags in webdataset and torch: about 220 MiB and 1.5 s per log)."""
    import subprocess
    import sys

    from siftpipe.audit import wire
    from siftpipe.audit.log import _BOOT

    here = os.path.dirname(os.path.dirname(os.path.abspath(wire.__file__)))  # the package's root
    boot = _BOOT.split("replies = ")[0] + (
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'webdataset', 'siftpipe'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", boot, here], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_writer_process_finds_the_packages_the_trainer_found_on_its_own_path(tmp_path):
    """A trainer that reaches siftpipe and its packages through ``sys.path.insert`` (a notebook, a
    ``pip --target`` folder): the writer process, a fresh interpreter, did not, and its error
    blamed the URL ("no filesystem for this URL's protocol ... No module named 'fsspec'"; found
    by review, 2026-12-06). Run here on the interpreter under this virtual environment, whose
    own site-packages hold none of them."""
    import site
    import subprocess
    import sys

    base = os.path.join(sys.base_prefix, "bin", "python3")
    if sys.prefix == sys.base_prefix or not os.path.exists(base):
        pytest.skip("needs a virtual environment over a base interpreter")
    here = os.path.dirname(os.path.dirname(os.path.abspath(sp.__file__)))
    script = (
        "import sys\n"
        f"sys.path[:0] = {[here, *site.getsitepackages()]!r}\n"
        "import siftpipe as sp\n"
        f"log = sp.AuditLog({str(tmp_path)!r}, run_id='r', writer='process')\n"
        "s = sp.Sifter(None, lambda m, b: b['loss'].double(), sp.Uniform(0.5), micro_batch=8, audit=log)\n"
        "import torch\n"
        "out = list(s([{'__key__': f'k{i}', 'loss': torch.tensor(1.0)} for i in range(40)]))\n"
        "s.close()\n"
        "print(sp.read_log(" + repr(str(tmp_path)) + ").num_rows, len(out))\n"
    )
    out = subprocess.run([base, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows, kept = map(int, out.stdout.split())
    assert rows == 40 and 0 < kept < 40


def test_a_storage_option_the_writer_process_cannot_receive_is_refused_by_name(tmp_path):
    """It once killed the writer's sender thread, and the stage waited for its claim forever."""

    class Session:
        def __repr__(self):
            return "Session(token='SECRET-123')"

    with pytest.raises(sp.AuditError, match=r"storage option 'client_kwargs.session' is a Session") as err:
        sp.AuditLog(str(tmp_path), storage_options={"client_kwargs": {"session": Session()}})
    assert "SECRET" not in str(err.value) and "writer='thread'" in str(err.value)
    # the thread writer keeps the object in this process
    log = sp.AuditLog(str(tmp_path), storage_options={"auto_mkdir": True}, writer="thread")
    log.close()


def test_a_message_the_writer_process_cannot_receive_is_reported_not_lost():
    from siftpipe.audit.log import _framed

    pieces, why = _framed({"op": "write", "bad": object()})
    assert pieces is None and "could not be encoded" in why
    pieces, why = _framed({"op": "close"})
    assert why is None and pieces


@pytest.mark.parametrize("batched", [False, True])
def test_keys_built_from_a_presigned_url_reach_the_log_without_its_signature(tmp_path, batched):
    """key=sp.shard_key over samples whose __url__ is presigned (webdataset's own reader leaves
    the signature there): the url column was redacted and the key column held the signature in
    clear (found by review, 2026-12-05). Keys stay one per sample, and the same for the shard
    however it is signed (a new signature each epoch made every key new to the memory)."""
    url = "https://h/x-000.tar?versionId=7&X-Amz-Date=20261205T1&X-Amz-Signature=SEKRET123&X-Amz-Security-Token=TOKEN456"
    samples = [{"__key__": f"{i:06d}", "__url__": url, "loss": float(i)} for i in range(40)]
    data = [default_collate(samples[i : i + 8]) for i in range(0, 40, 8)] if batched else samples
    root = str(tmp_path / "log")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=8, key=sp.shard_key, batched=batched,
                  audit=sp.AuditLog(root, flush_every=1000))  # fmt: skip
    list(s(data))
    s.close()
    keys = sp.read_log(root).column("key").to_pylist()
    assert len(keys) == 40 and len(set(keys)) == 40
    assert not any("SEKRET123" in k or "TOKEN456" in k for k in keys), keys[0]
    assert keys[0] == "https://h/x-000.tar?versionId=7/000000"  # what names the object stays
    resigned = {**samples[0], "__url__": url.replace("SEKRET123", "OTHER789").replace("T1", "T2")}
    assert sp.shard_key(resigned) == sp.shard_key(samples[0])


class _SiftedSamples(torch.utils.data.IterableDataset):
    """A dataset that sifts inside itself (what a DataLoader worker must never do)."""

    def __init__(self, sifter, samples):
        self.sifter, self.samples = sifter, samples

    def __iter__(self):
        return iter(self.sifter(self.samples))


def test_an_audit_log_pickled_into_another_process_is_refused_naming_the_fix(tmp_path):
    """A spawn DataLoader worker given a dataset holding a Sifter with an audit log failed with a
    bare "cannot pickle '_thread.RLock' object", naming neither siftpipe nor the fix (found by
    review, 2026-12-05)."""
    import copy
    import pickle

    log = sp.AuditLog(str(tmp_path / "log"), writer="thread")
    sifter = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=8, audit=log)
    for copying in (pickle.dumps, copy.deepcopy):
        with pytest.raises(sp.AuditError, match="cannot be pickled or copied.*Sift in the training process"):
            copying(sifter)
    loader = torch.utils.data.DataLoader(
        _SiftedSamples(sifter, make_samples(16)),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    with pytest.raises(sp.AuditError, match="DataLoader worker"):
        list(loader)
    assert list(sifter(make_samples(16)))  # the log itself goes on, in its own process
    log.close()
