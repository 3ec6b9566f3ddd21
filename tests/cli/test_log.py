"""The `siftpipe log` commands, against a log on the loopback S3 server."""

import json
import warnings

import pytest
import torch

import siftpipe as sp
from siftpipe.cli import main, parse_storage_options
from tests.common import loss_field, make_samples

SAMPLES = make_samples(2000, seed=2)


@pytest.fixture(scope="module")
def s3_log(local_s3):
    bucket = local_s3.new_bucket()
    root = f"s3://{bucket}/sift"
    log = sp.AuditLog(root, storage_options=local_s3.storage_options, run_id="cli", flush_every=500)
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 200), micro_batch=50, delay=100, audit=log)
    kept = [x["__key__"] for x in s(SAMPLES)]
    s.close()
    return root, ["--storage-option", f"endpoint_url={local_s3.endpoint}"], kept


def test_summary_text_and_json(s3_log, capsys):
    root, opts, kept = s3_log
    assert main(["log", "summary", root, *opts]) == 0
    text = capsys.readouterr().out
    assert (
        f"records 2000  kept {len(kept)}" in text and "most-dropped shards" in text and "warmup 100" in text
    )
    assert main(["log", "summary", root, *opts, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["records"] == 2000 and s["kept"] == len(kept) and s["runs"] == ["cli"]
    assert s["loss_kept"]["p50"] > s["loss_dropped"]["p50"]
    assert sum(b["records"] for b in s["keep_rate_over_seq"]) == 2000
    assert s["most_dropped_shards"][0]["dropped"] >= s["most_dropped_shards"][-1]["dropped"]


def test_plot_writes_a_png(s3_log, tmp_path, capsys):
    root, opts, _ = s3_log
    out = tmp_path / "sift.png"
    assert main(["log", "plot", root, *opts, "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    capsys.readouterr()
    # a folder that does not exist: one line naming the path and the fix, not a traceback
    assert main(["log", "plot", root, *opts, "-o", str(tmp_path / "nope" / "sift.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the plot to" in err and "nope" in err
    # the path said is the path written: no suffix means .png, a folder gets sift.png in it
    for given, written in (("noext", "noext.png"), ("folder/", "folder/sift.png"), ("v.svg", "v.svg")):
        (tmp_path / "folder").mkdir(exist_ok=True)
        assert main(["log", "plot", root, *opts, "-o", str(tmp_path / given)]) == 0
        assert capsys.readouterr().out == f"wrote {tmp_path / written}\n"
        assert (tmp_path / written).stat().st_size > 10_000
    # an empty name: refused (it wrote ./.png.png and said "wrote .png": review, 2026-12-06)
    assert main(["log", "plot", root, *opts, "-o", ""]) == 2
    assert "needs a file name" in capsys.readouterr().err
    assert main(["log", "plot", str(tmp_path / "no-log-here"), "-o", ""]) == 2  # before any read
    assert "needs a file name" in capsys.readouterr().err
    # a suffix matplotlib cannot write: one line naming the ones it can, nothing written
    assert main(["log", "plot", root, *opts, "-o", str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no .txt files" in err and ".png" in err
    assert not (tmp_path / "out.txt").exists()


def test_a_url_that_holds_no_log_says_the_likely_reason(s3_log, capsys):
    root, opts, _ = s3_log
    for command in (["summary"], ["keys"], ["verify"]):
        for inside in ("/run=cli", "/run=cli/rank=0/"):
            assert main(["log", command[0], root + inside, *opts]) == 1
            err = capsys.readouterr().err
            assert "points inside a log" in err and "--run/--rank" in err, (command, inside, err)
    assert main(["log", "summary", "s3://no-such-bucket-4c1/sift", *opts]) == 1
    err = capsys.readouterr().err
    assert "the bucket 'no-such-bucket-4c1' does not exist at this endpoint" in err and err.count("\n") == 1
    bucket = root.split("/")[2]
    assert main(["log", "summary", f"s3://{bucket}/elsewhere", *opts]) == 1
    assert "check the URL, the storage options and --run/--rank" in capsys.readouterr().err


def test_keys_kept_and_dropped(s3_log, capsys):
    root, opts, kept = s3_log
    assert main(["log", "keys", root, *opts]) == 0
    assert capsys.readouterr().out.split() == kept
    assert main(["log", "keys", root, *opts, "--dropped"]) == 0
    dropped = capsys.readouterr().out.split()
    assert sorted(dropped + kept) == [x["__key__"] for x in SAMPLES]


def test_whatif_over_betas(s3_log, capsys):
    root, opts, kept = s3_log
    assert main(["log", "whatif", root, *opts, "--beta", "0.5", "1", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rates = [r["keep_rate"] for r in result["results"]]
    assert rates[0] > rates[1] > rates[2]
    assert result["results"][1]["flips"] == 0  # beta 1 and history 200 is the logged policy
    assert main(["log", "whatif", root, *opts, "--top", "0.25"]) == 0
    assert "TopFraction(keep=0.25)" in capsys.readouterr().out


def test_verify_exit_codes(s3_log, local_s3, capsys):
    root, opts, _ = s3_log
    assert main(["log", "verify", root, *opts]) == 0
    assert "OK: 2000 records, seq 0..1999" in capsys.readouterr().out
    fs = local_s3.fs()
    bucket = root.split("/")[2]
    scratch = f"s3://{bucket}/broken"
    for path in fs.find(root):
        fs.copy(path, path.replace("/sift/", "/broken/"))
    victim = sorted(p for p in fs.find(scratch) if p.endswith(".parquet"))[1]
    fs.rm(victim)
    assert main(["log", "verify", scratch, *opts]) == 1
    out = capsys.readouterr().out
    assert "PROBLEMS" in out and "gap: seq 500..999 (500 records) missing" in out


def test_storage_option_parsing():
    assert parse_storage_options(
        ["endpoint_url=http://x:1", "anon=true", "client_kwargs.region_name=eu", "n=3"]
    ) == {"endpoint_url": "http://x:1", "anon": True, "client_kwargs": {"region_name": "eu"}, "n": 3}
    with pytest.raises(sp.ConfigError, match="NAME=VALUE"):
        parse_storage_options(["novalue"])
    # credentials stay text; only plain integers convert; other shapes stay text too
    assert parse_storage_options(
        [
            "secret=000123",
            "password=TRUE",
            "client_kwargs.aws_secret_access_key=42",
            "code=007",
            "x=--5",
            "y=²",
        ]
    ) == {
        "secret": "000123",
        "password": "TRUE",
        "client_kwargs": {"aws_secret_access_key": "42"},
        "code": "007",
        "x": "--5",
        "y": "²",
    }
    assert parse_storage_options(["n=-12", "z=0"]) == {"n": -12, "z": 0}
    # a key given a value and nested keys (either order), an empty part: refused, value unshown
    for pairs in (["a=S3CRETV", "a.b=S3CRETV"], ["a.b=S3CRETV", "a=S3CRETV"], ["a.=S3CRETV"], [".a=S3CRETV"]):
        with pytest.raises(sp.ConfigError, match="storage-option") as caught:
            parse_storage_options(pairs)
        assert "S3CRETV" not in str(caught.value)


def test_a_malformed_storage_option_is_one_line_and_exit_2(capsys):
    assert (
        main(["log", "verify", "/nonexistent", "--storage-option", "a=1", "--storage-option", "a.b=2"]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("siftpipe: error: --storage-option a.b=...") and err.count("\n") == 1


def losses_only(items):
    return {"loss": torch.tensor([x["loss"] for x in items])}


def test_summary_of_samples_without_shard_urls(tmp_path, capsys):
    samples = [{k: v for k, v in x.items() if k != "__url__"} for x in SAMPLES[:300]]
    log = sp.AuditLog(str(tmp_path), run_id="nourl", flush_every=100)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, audit=log)
    kept = len(list(s(samples)))
    s.close()
    assert main(["log", "summary", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"records 300  kept {kept}" in text and "none recorded (the samples carried no __url__)" in text
    assert main(["log", "summary", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["most_dropped_shards"] == []
    # some samples with a URL, some without: only the URLs are listed
    mixed = sp.AuditLog(str(tmp_path / "mixed"), run_id="mixed", flush_every=100)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, audit=mixed, collate_fn=losses_only)
    list(s([x if i % 2 else {**x, "__url__": None} for i, x in enumerate(SAMPLES[:300])]))
    s.close()
    assert main(["log", "summary", str(tmp_path / "mixed"), "--json"]) == 0
    shards = json.loads(capsys.readouterr().out)["most_dropped_shards"]
    assert sum(r["records"] for r in shards) == 150 and None not in [r["url"] for r in shards]


@pytest.mark.parametrize(
    "command",
    [["summary"], ["summary", "--json"], ["keys"], ["keys", "--dropped"], ["whatif"], ["plot"], ["verify"]],
)
def test_a_place_without_a_log_exits_non_zero(tmp_path, local_s3, bucket, capsys, command):
    opts = ["--storage-option", f"endpoint_url={local_s3.endpoint}"]
    for where in (str(tmp_path / "nothing"), f"s3://{bucket}/nothing", "s3://no-such-bucket-for-cli/x"):
        extra = ["-o", str(tmp_path / "x.png")] if command == ["plot"] else []
        assert main(["log", *command, where, *opts, *extra]) != 0, (command, where)
        out = capsys.readouterr()
        assert (
            "no parts found" in out.out
            or "no audit log" in out.err
            or "no records" in out.err
            or ("siftpipe: error:" in out.err)
        ), out


LOG_COMMANDS = [["summary"], ["summary", "--json"], ["keys"], ["keys", "--dropped"], ["verify"], ["whatif"]]


@pytest.mark.parametrize("command", LOG_COMMANDS)
def test_a_closed_pipe_ends_any_log_command_quietly(s3_log, tmp_path, command):
    """`siftpipe log ... | head`: the reader is gone before the first write, or after one line."""
    import os
    import subprocess
    import sys

    root, opts, _ = s3_log
    argv = [sys.executable, "-m", "siftpipe", "log", *command[:1], root, *opts, *command[1:]]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo}
    # a reader that closes its end at once: the first write meets a broken pipe
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, env=env, check=False)
    os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr
    # `head -1`: reads a line, then goes (keys writes far more than a pipe holds)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait() in (0, 141) and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_summary_buckets_are_labelled_with_the_seqs_they_count():
    # found by review: labels came from linspace, rows were counted by integer division, so with
    # 15 records the bucket labelled "seq 0..0" held two records and "seq 1..2" showed seq 1's
    # keep as 0
    import pyarrow as pa

    from siftpipe.audit.summary import summarize

    kept = [i % 3 == 1 for i in range(15)]
    table = pa.table(
        {
            "seq": pa.array(range(15), pa.int64()),
            "kept": kept,
            "loss": [1.0] * 15,
            "reason": ["policy"] * 15,
        }
    )
    buckets = summarize(table)["keep_rate_over_seq"]
    assert sum(b["records"] for b in buckets) == 15
    for b in buckets:
        inside = range(b["seq_from"], b["seq_to"] + 1)
        assert b["records"] == len(inside)
        if inside:
            assert b["keep_rate"] == sum(kept[i] for i in inside) / len(inside)


def test_a_stream_shorter_than_the_buckets_gets_one_bucket_per_seq_and_none_backwards():
    # found by review, 2026-12-06: 4 records printed ten buckets, six empty and backwards
    import pyarrow as pa

    from siftpipe.audit.summary import summarize

    for n in (1, 4, 9, 10, 11):
        table = pa.table(
            {
                "seq": pa.array(range(n), pa.int64()),
                "kept": [True] * n,
                "loss": [1.0] * n,
                "reason": ["policy"] * n,
            }
        )
        buckets = summarize(table)["keep_rate_over_seq"]
        assert len(buckets) == min(10, n)
        assert all(b["seq_from"] <= b["seq_to"] and b["records"] > 0 for b in buckets), buckets
        assert sum(b["records"] for b in buckets) == n


def test_the_mean_loss_of_losses_near_the_float_maximum_is_finite_and_the_json_valid():
    # found by review: the mean's sum overflowed to inf, and `summary --json` printed Infinity
    import pyarrow as pa

    from siftpipe.audit.summary import summarize

    n = 10
    table = pa.table(
        {
            "seq": pa.array(range(n), pa.int64()),
            "kept": [True] * n,
            "loss": [1.5e308] * (n - 1) + [0.5e308],
            "reason": ["policy"] * n,
        }
    )
    mean = summarize(table)["loss_kept"]["mean"]
    assert mean == pytest.approx(1.4e308, rel=1e-12)
    json.loads(json.dumps(summarize(table)), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


def test_keys_holding_line_breaks_are_said_and_listed_whole_with_null(tmp_path, capsys):
    # found by review: a tar member name may hold a newline; `keys` printed such a key as two
    # lines with nothing said
    root = str(tmp_path / "log")
    samples = make_samples(60)
    for i in (3, 17):
        samples[i]["__key__"] = f"two\nlines{i}"
    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=20, seed=1, audit=sp.AuditLog(root))
    list(s(samples))
    s.close()
    assert main(["log", "keys", root]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 62 and "2 key(s) hold a line break" in out.err and "-0" in out.err
    assert main(["log", "keys", "-0", root]) == 0
    out = capsys.readouterr()
    assert out.out.split("\0")[:-1] == [x["__key__"] for x in samples] and not out.err
    # and with -0, a key holding a NUL byte reads as two (found by review, 2026-12-05: nothing said)
    root = str(tmp_path / "nul")
    samples[5]["__key__"] = "a\0b"
    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=20, seed=1, audit=sp.AuditLog(root))
    list(s(samples))
    s.close()
    assert main(["log", "keys", "-0", root]) == 1
    assert "1 key(s) hold a NUL byte" in capsys.readouterr().err


def test_keys_of_a_log_without_keys_says_so_instead_of_printing_none(tmp_path, capsys):
    # found by review: a stage run with key=None logged null keys, printed as the text "None",
    # which a real key "None" could not be told from
    root = str(tmp_path / "nokeys")
    s = sp.Sifter(
        None, loss_field, sp.Uniform(0.5), micro_batch=20, key=None, seed=1, audit=sp.AuditLog(root)
    )
    list(s(SAMPLES[:100]))
    s.close()
    assert main(["log", "keys", root]) == 1
    out = capsys.readouterr()
    # the kept ones, those it would have listed (a count of all records read as wrong: review)
    kept = s.stats.kept
    assert out.out == "" and f"{kept} kept record(s) have no key (the stage ran with key=None)" in out.err


def test_a_run_that_decided_nothing_says_no_records_not_no_log(tmp_path, capsys):
    # noticed in review: a log whose run closed with no record (an empty pass) has an end marker
    # and a claim; keys and whatif said "no audit log" there, summary "no records"
    root = str(tmp_path / "empty")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), audit=sp.AuditLog(root))
    assert list(s([])) == []
    s.close()
    for command in (["summary"], ["keys"], ["whatif"], ["plot", "-o", str(tmp_path / "x.png")]):
        assert main(["log", *command[:1], root, *command[1:]]) == 1
        err = capsys.readouterr().err
        assert "no records" in err and "no audit log" not in err, (command, err)
        assert "wrote no records" in err  # not "check the URL": the URL is right
        # and no log at all is said so (found 2026-12-05, fourth session: summary and plot said
        # "no records" for both)
        nowhere = str(tmp_path / "nothing-here")
        assert main(["log", *command[:1], nowhere, *command[1:]]) == 1
        err = capsys.readouterr().err
        assert "no audit log at" in err and "no records" not in err, (command, err)
    assert main(["log", "verify", root]) == 0  # (its line read "seq None..None"; review, 2026-12-05)
    assert ": OK: 0 records, 1 attempt(s)" in capsys.readouterr().out


def test_a_log_whose_parts_are_all_unreadable_is_not_said_to_have_decided_nothing(tmp_path, capsys):
    # found by review, 2026-12-05: summary and plot said "its runs wrote no records" of a log
    # whose every part is damaged
    root = tmp_path / "damaged"
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, seed=1, audit=sp.AuditLog(str(root)))
    list(s(SAMPLES[:100]))
    s.close()
    parts = list(root.rglob("part-*.parquet"))
    for part in parts:
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    for command in (["summary"], ["plot", "-o", str(tmp_path / "x.png")]):
        with pytest.warns(RuntimeWarning):
            assert main(["log", *command[:1], str(root), *command[1:]]) == 1
        err = capsys.readouterr().err
        assert "no readable record" in err and "wrote no records" not in err, (command, err)
        assert f"list {len(parts)} part(s) and none could be read" in err


def test_an_error_whose_cause_spans_lines_is_one_line(capsys):
    # found 2026-12-05 (fourth session): botocore's parameter check spans two lines
    assert main(["log", "summary", "s3://bad_bucket!!/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("siftpipe: error: ") and err.count("\n") == 1 and "bad_bucket" in err


def test_a_warning_about_the_log_is_printed_once_per_command(tmp_path):
    """whatif lists the log once per policy it replays: a malformed manifest was warned three
    times (found by review, 2026-12-05)."""
    import subprocess
    import sys

    log = sp.AuditLog(str(tmp_path), run_id="t", flush_every=40)
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 500), micro_batch=20, audit=log)
    list(s(make_samples(160)))
    s.close()
    manifest = sorted((tmp_path / "run=t" / "rank=0").glob("_manifest-*.json"))[1]
    manifest.write_text("{not json")
    argv = [sys.executable, "-m", "siftpipe", "log", "whatif", str(tmp_path), "--beta", "0.5", "1", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    said = [line for line in done.stderr.splitlines() if "is unreadable or malformed" in line]
    assert len(said) == 1 and manifest.name in said[0], done.stderr


@pytest.mark.parametrize(
    "policy, samples",
    # one record; and every kept loss beyond the bins' 99.5th percentile (the hardest 2 of 1,000
    # kept: no sample of them inside the bins; a review of the first version found it)
    [(sp.Uniform(1.0), 1), (sp.TopFraction(0.002), 1000)],
    ids=["one_record", "kept_beyond_the_bins"],
)
def test_the_plot_of_a_log_of_one_record_says_no_numpy_warning(tmp_path, policy, samples):
    """A one-record log (and one where nothing was dropped) printed six numpy 'divide by zero'
    lines as siftpipe warnings: histograms of no samples, and of one loss (found by review,
    2026-12-05)."""
    import warnings

    from siftpipe.audit.summary import plot_log

    pytest.importorskip("matplotlib")
    log = sp.AuditLog(str(tmp_path / "log"), run_id="k")
    s = sp.Sifter(None, loss_field, policy, micro_batch=samples, audit=log)
    list(s(make_samples(samples)))
    s.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_log(sp.read_log(str(tmp_path / "log")), str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_whatif_prune_takes_the_logged_window_and_says_its_keep_rate_is_as_decided(tmp_path, capsys):
    """--prune ran PruneEasy with its default window (10,000), not the logged one (100): the
    logged policy re-run showed flips on a whole log (found by review, 2026-12-05)."""
    root = str(tmp_path / "log")
    s = sp.Sifter(
        None, loss_field, sp.PruneEasy(0.5, history=100), micro_batch=20, seed=1, audit=sp.AuditLog(root)
    )
    list(s(make_samples(600)))
    s.close()
    assert main(["log", "whatif", root, "--prune", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "logged keep rate (as decided)" in out
    (row,) = [line for line in out.splitlines() if line.startswith("PruneEasy")]
    assert "history=100" in row and row.split()[-1] == "0"


def test_whatif_replays_each_run_with_its_own_logged_window(tmp_path, capsys):
    """Two runs in one root, each RelativeProbabilistic(1) over its own window (20 and 300):
    whatif replayed both with the first run's window, and the complete log showed 40 flips for
    the logged policy, exit 0, nothing said (found by review, 2026-12-05). Each run is replayed
    with its own window now, and --prune with each run's anneal point."""
    root = str(tmp_path / "log")
    for run, policy in (("a", sp.RelativeProbabilistic(1.0, 20)), ("b", sp.RelativeProbabilistic(1.0, 300))):
        s = sp.Sifter(None, loss_field, policy, micro_batch=16, seed=1, audit=sp.AuditLog(root, run_id=run))
        list(s(make_samples(600)))
        s.close()
    assert main(["log", "whatif", root, "--beta", "1", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["flips"] == 0 and result["samples"] == 1200
    assert "history=20" in result["policy"] and "history=300" in result["policy"]
    for run in ("a", "b"):
        assert main(["log", "whatif", root, "--beta", "1", "--run", run, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["results"][0]["flips"] == 0
    budgets = str(tmp_path / "budgets")
    for run, budget in (("a", 400), ("b", 2000)):
        policy = sp.PruneEasy(0.5, history=100, anneal=int(budget * 0.875))
        s = sp.Sifter(
            None, loss_field, policy, micro_batch=20, seed=1, audit=sp.AuditLog(budgets, run_id=run)
        )
        list(s(make_samples(600)))
        s.close()
    assert main(["log", "whatif", budgets, "--prune", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["flips"] == 0


def test_a_run_or_rank_asked_for_and_absent_is_said_by_every_reader(tmp_path, capsys):
    """summary --run a --run zz printed run a's figures, exit 0, nothing said of zz, where verify
    reports it missing (found by review, 2026-12-05): every reader warns of it now."""
    root = str(tmp_path / "log")
    s = sp.Sifter(
        None, loss_field, sp.Uniform(0.5), micro_batch=20, seed=1, audit=sp.AuditLog(root, run_id="a")
    )
    list(s(make_samples(200)))
    s.close()
    said = "run=zz asked for, and nothing of it is in the log"
    with pytest.warns(RuntimeWarning, match=said):
        assert sp.read_log(root, run=["a", "zz"]).num_rows == 200
    for command in ("summary", "keys", "whatif"):
        with pytest.warns(RuntimeWarning, match=said):
            assert main(["log", command, root, "--run", "a", "--run", "zz"]) == 0, command
    with pytest.warns(RuntimeWarning, match="rank=3 asked for"):
        sp.read_log(root, rank=[0, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert sp.read_log(root, run="a", rank=0).num_rows == 200


def test_a_filter_that_selects_nothing_or_is_not_a_run_or_rank_is_said_not_read_as_empty(tmp_path):
    """read_log(run="typo") gave an empty table (read as "nothing trained"), nothing said;
    rank="0" (from os.environ) selected nothing, np.int64(0) raised a bare TypeError, kept="no"
    read as True; replay and whatif said "check the URL" (found by review, 2026-12-06)."""
    import numpy as np

    root = str(tmp_path / "log")
    for run in ("a", "b"):
        s = sp.Sifter(
            None, loss_field, sp.Uniform(0.5), micro_batch=20, seed=1, audit=sp.AuditLog(root, run_id=run)
        )
        list(s(make_samples(100)))
        s.close()
    held = "holds run='a' rank=0, run='b' rank=0, and none is"
    for kw in ({"run": "typo"}, {"run": ["typo", "zz"]}, {"run": "b", "rank": 1}, {"rank": 2}):
        with pytest.raises(sp.AuditError, match=held):
            sp.read_log(root, **kw)
    with pytest.raises(sp.AuditError, match=held):
        sp.replay(root, run="typo")
    with pytest.raises(sp.AuditError, match=held):
        sp.whatif(root, [sp.Uniform(0.5)], run="typo")
    for bad in ("0", 0.0, True, ["0"]):
        with pytest.raises(sp.ConfigError, match="rank= takes an integer"):
            sp.read_log(root, rank=bad)
    with pytest.raises(sp.ConfigError, match="run= takes a run id"):
        sp.read_log(root, run=7)
    with pytest.raises(sp.ConfigError, match="kept= takes True"):
        sp.read_log(root, kept="no")
    assert sp.read_log(root, rank=np.int64(0)).num_rows == sp.read_log(root, rank=0).num_rows == 200
    # many, in any iterable (the review of the check: arrays, generators, dict keys were refused)
    for ranks in (np.array([0]), (r for r in [0]), range(1), [0, 0]):
        assert sp.read_log(root, rank=ranks).num_rows == 200
    for runs in (np.array(["a"]), {"a": 1}.keys(), ("a",)):
        assert sp.read_log(root, run=runs).num_rows == 100
    assert (
        sp.read_log(root, run="a", kept=np.bool_(True)).num_rows
        == sp.read_log(root, run="a", kept=True).num_rows
    )
    # verify reports what is absent (it does not raise), as before
    report = sp.verify_log(root, run="typo")
    assert not report.ok and report.not_found == ["run=typo"]


def test_summary_prints_epochs_as_runs_of_numbers():
    # a 250-epoch log printed all 250 numbers on one line
    import io

    import pyarrow as pa

    from siftpipe.audit.summary import print_summary, summarize

    epochs = [*range(250), 300, 302, 303]
    n = len(epochs)
    table = pa.table(
        {
            "seq": pa.array(range(n), pa.int64()),
            "epoch": pa.array(epochs, pa.int64()),
            "run": ["r"] * n,
            "rank": pa.array([0] * n, pa.int64()),
            "kept": [i % 2 == 0 for i in range(n)],
            "loss": [1.0] * n,
            "reason": ["policy"] * n,
        }
    )
    out = io.StringIO()
    print_summary(summarize(table), out)
    assert "epochs 0..249, 300, 302..303" in out.getvalue()
