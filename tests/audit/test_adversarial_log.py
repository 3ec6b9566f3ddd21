"""The adversarial suite for the audit log: try to make it lie, and check that ``verify_log`` says
OK only when it is true.

Concurrent writers (two processes, one root, default and shared run ids), storage outages in the
middle of a run (the real loopback S3 server stopped and started again), SIGKILL of a training
script at random points and resume from its last checkpoint, and a grep of everything written or
printed for planted credentials. Each test counts what it tried (tests/tally.py).
"""

from __future__ import annotations

import base64
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import siftpipe as sp
from tests.common import REPO, loss_field, make_samples
from tests.tally import tried

pytestmark = pytest.mark.adversarial


def env(**extra):
    return {**os.environ, "PYTHONPATH": REPO, **extra}


# ------------------------------------------------------------------ concurrent writers

WRITER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import siftpipe as sp
    from tests.common import loss_field, make_samples

    root, endpoint, run_id, go, seed = sys.argv[1:6]
    options = {{"endpoint_url": endpoint}} if endpoint != "-" else None
    log = sp.AuditLog(root, storage_options=options, run_id=None if run_id == "-" else run_id,
                      flush_every=40)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, audit=log, seed=int(seed))
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        kept = [x["__key__"] for x in s(make_samples(160, seed=int(seed)))]
        s.close()
    except sp.AuditError as exc:
        print("refused", exc, flush=True)
        sys.exit(3)
    print("wrote", log.run_id, log.attempt, len(kept), flush=True)
    """
)


def race(tmp_path, root, endpoint, run_id, n, extra_env=None):
    """``n`` writer processes released together; (exit code, output) of each."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(repo=REPO))
    go = tmp_path / f"go-{os.urandom(4).hex()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), root, endpoint, run_id, str(go), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(**(extra_env or {})),
        )
        for seed in range(n)
    ]
    go.write_text("go")
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append((p.returncode, stdout + stderr))
    return out


@pytest.mark.parametrize("where", ["local", "s3"])
def test_concurrent_writers_never_make_the_log_lie(tmp_path, own_s3, where):
    rounds = 2 if where == "s3" else 3
    for round_ in range(rounds):
        if where == "s3":
            root, endpoint = f"s3://{own_s3.new_bucket()}/log", own_s3.endpoint
            options = own_s3.storage_options
        else:
            root, endpoint, options = str(tmp_path / f"log{round_}"), "-", None
        # default run ids, under torchrun without --rdzv-id: every job its own run
        results = race(tmp_path, root, endpoint, "-", 3, {"TORCHELASTIC_RUN_ID": "none"})
        assert [c for c, _ in results] == [0, 0, 0], results
        report = sp.verify_log(root, options)
        assert report.ok and len({s.run for s in report.streams}) == 3, report.lines()
        assert [s.records for s in report.streams] == [160] * 3
        assert all(s.superseded == 0 for s in report.streams)
        tried("concurrent writers tried", 3)
        # one explicit run id for all: at most one job writes, the others are refused; a
        # writer that went on has all its records and nobody else's
        shared = f"{root}-shared"
        results = race(tmp_path, shared, endpoint, "shared", 3)
        codes = [c for c, _ in results]
        assert set(codes) <= {0, 3} and codes.count(0) <= 1, results
        assert all("collides" in out for c, out in results if c == 3), results
        table = sp.read_log(shared, options, include_superseded=True)
        assert table.num_rows == 160 * codes.count(0)
        if codes.count(0):
            report = sp.verify_log(shared, options)
            assert report.ok and report.streams[0].records == 160 and not report.streams[0].collisions
            winner = next(out for c, out in results if c == 0).split()[2]
            assert {a["attempt"] for a in report.streams[0].attempts} == {winner}
        tried("concurrent writers tried", 3)


# ------------------------------------------------------------------ storage outages


def outage(server, seconds):
    """Stop the S3 server now and start it again after ``seconds``: the timer that will."""
    server.stop()
    timer = threading.Timer(seconds, server.start)
    timer.start()
    return timer


def test_storage_outages_mid_run_are_retried_and_lose_nothing(own_s3):
    rng = random.Random(11)
    samples = make_samples(1200, seed=9)
    reference = [
        x["__key__"] for x in sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, seed=4)(samples)
    ]
    outages = 0
    for writer in ("process", "thread"):
        root = f"s3://{own_s3.new_bucket()}/log"
        options = {
            **own_s3.storage_options,
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}},
        }
        log = sp.AuditLog(root, storage_options=options, flush_every=60, retry_timeout=180, writer=writer)
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, audit=log, seed=4)
        restarts = [outage(own_s3, rng.uniform(1, 2))]  # down before the run: the claim waits
        outages += 1
        at = sorted(rng.sample(range(100, 1100), 3))
        kept = []
        for x in s(samples):
            kept.append(x["__key__"])
            if at and s.stats.seen >= at[0]:
                at.pop(0)
                restarts[-1].join()  # one outage at a time
                restarts.append(outage(own_s3, rng.uniform(1, 3)))
                outages += 1
        s.close()  # waits for the retries to catch up
        for timer in restarts:
            timer.join()
        assert kept == reference
        assert log.stats.retries > 0 and log.stats.unwritten_records == log.stats.dropped_records == 0
        report = sp.verify_log(root, own_s3.storage_options)
        assert report.ok and report.records == len(samples), report.lines()
        table = sp.read_log(root, own_s3.storage_options)
        assert table.column("seq").to_pylist() == list(range(len(samples)))
        logged = [k for k, kp in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()) if kp]
        assert logged == reference
        tried("records checked", len(samples))
    tried("outages survived", outages)


# ------------------------------------------------------------------ SIGKILL at random points

TOTAL = 2400
TRAIN = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {repo!r})
    import siftpipe as sp
    from tests.common import loss_field, make_samples

    root, endpoint, ckpt, writer = sys.argv[1:5]
    samples = make_samples({total}, seed=5)
    log = sp.AuditLog(root, storage_options={{"endpoint_url": endpoint}}, run_id="kills",
                      flush_every=70, writer=writer)
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 300), micro_batch=30, audit=log,
                  seed=7)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        s.load_state_dict(state)
        start = state["consumed"]
        print("resumed", state["counts"]["seen"], flush=True)
    for i, x in enumerate(s(samples[start:])):
        if i % 97 == 96:
            torch.save(s.state_dict(), ckpt + ".tmp")
            log.flush()  # the checkpoint's records are durable before the checkpoint is
            os.replace(ckpt + ".tmp", ckpt)
            print("checkpoint", s.stats.seen, flush=True)
        time.sleep(0.0005)
    s.close()
    print("finished", flush=True)
    """
)


def reference_kept():
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 300), micro_batch=30, seed=7)
    return [x["__key__"] for x in s(make_samples(TOTAL, seed=5))]


def run_until_killed(script, args, rng):
    """Run the training script; SIGKILL it after a random number of checkpoints and a random
    extra moment. Returns (seen at its last checkpoint, or None; whether it finished)."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env()
    )
    wanted = rng.randint(1, 4)
    last, count = None, 0
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("checkpoint"):
            last, count = int(line.split()[1]), count + 1
            if count >= wanted:
                # anywhere from right after the checkpoint to deep into the next stretch
                threading.Event().wait(rng.uniform(0, 0.4))
                os.kill(proc.pid, signal.SIGKILL)
                break
        if line.startswith("finished"):
            break
    proc.wait(timeout=120)
    return last, proc.returncode == 0


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_sigkill_at_random_points_then_resume_leaves_one_record_per_sample(own_s3, tmp_path, writer):
    rng = random.Random(1000 + len(writer))
    root = f"s3://{own_s3.new_bucket()}/log"
    options = own_s3.storage_options
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(repo=REPO, total=TOTAL))
    ckpt = str(tmp_path / "sift.pt")
    args = [root, own_s3.endpoint, ckpt, writer]
    kills = 0
    for _ in range(12):
        checkpoint, finished = run_until_killed(script, args, rng)
        if finished:
            break
        kills += 1
        if checkpoint is None:
            continue
        # everything decided before the last checkpoint is in the log, exactly once
        table = sp.read_log(root, options, columns=["seq"])
        seqs = [q for q in table.column("seq").to_pylist() if q < checkpoint]
        lost = checkpoint - len(set(seqs))
        assert lost == 0 and len(seqs) == len(set(seqs)), (checkpoint, lost)
        tried("records checked", checkpoint)
        tried("records lost", lost)
    else:
        pytest.fail("the training script never finished")
    assert kills >= 2
    report = sp.verify_log(root, options)
    (stream,) = report.streams
    assert report.ok, "\n".join(report.lines())
    assert stream.records == TOTAL and (stream.first_seq, stream.last_seq) == (0, TOTAL - 1)
    assert not stream.collisions and len({a.get("origin") for a in stream.attempts}) == 1
    table = sp.read_log(root, options)
    keys = table.column("key").to_pylist()
    assert keys == [x["__key__"] for x in make_samples(TOTAL, seed=5)]  # each sample once, in order
    kept = [k for k, kp in zip(keys, table.column("kept").to_pylist()) if kp]
    assert kept == reference_kept()  # and decided as an uninterrupted run decides
    tried("kills survived", kills)
    tried("records checked", TOTAL)
    tried("records lost", 0)


# ------------------------------------------------------------------ planted credentials

PLANTED = {
    "storage option secret": "pLaNtEd-OpTiOn-SeCrEt-0001",
    "session token": "pLaNtEd-SeSsIoN-tOkEn-0002",
    "basic-auth password": "pLaNtEd-BaSiC-pAsS-0003",
    "S3 presigned signature": "pLaNtEdAmZsIgNaTuRe0004abcdef",
    "S3 security token": "pLaNtEd/SeCuRiTy+ToKeN=0005",
    "GCS signature": "0123456789abcdef0123456789abcdef0123pLaNtEd0006",
    "GCS access token": "ya29.pLaNtEd-AcCeSs-0007",
    "Azure SAS sig": "pLaNtEd+SaS/SiG=0008",
    "Azure account key": "pLaNtEdAcCoUnTkEy0009==",
    "user-only token": "pLaNtEdGhToKeN0010",
}


def planted_urls():
    from urllib.parse import quote

    p = PLANTED
    return [
        f"http://reader:{p['basic-auth password']}@shards.internal:8080/a-000000.tar",
        "https://bkt.s3.amazonaws.com/a-000001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20260101"
        f"&X-Amz-Security-Token={quote(p['S3 security token'], safe='')}"
        f"&X-Amz-Signature={p['S3 presigned signature']}",
        "https://storage.googleapis.com/bkt/a-000002.tar?X-Goog-Algorithm=GOOG4-RSA-SHA256"
        f"&X-Goog-Signature={p['GCS signature']}",
        f"https://storage.googleapis.com/bkt/a-000003.tar?access_token={p['GCS access token']}",
        "https://acct.blob.core.windows.net/c/a-000004.tar?sv=2022-11-02&sp=r"
        f"&sig={quote(p['Azure SAS sig'], safe='')}",
        f"https://{p['user-only token']}@github.com/org/a-000005.tar",
    ]


def test_no_planted_credential_in_anything_written_or_printed(own_s3, tmp_path, capsys, monkeypatch):
    from urllib.parse import quote

    import pyarrow.parquet as pq

    from siftpipe.cli import main

    monkeypatch.setenv("AWS_SESSION_TOKEN", PLANTED["session token"])
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", f"AccountName=a;AccountKey={PLANTED['Azure account key']}"
    )
    bucket = own_s3.new_bucket()
    root = f"s3://{bucket}/log"
    options = {
        **own_s3.storage_options,
        "key": "AKIAPLANTEDKEY000000",
        "secret": PLANTED["storage option secret"],
    }
    urls = planted_urls()
    samples = [{**x, "__url__": urls[i % len(urls)]} for i, x in enumerate(make_samples(600, seed=2))]
    texts: dict[str, str] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = sp.AuditLog(root, storage_options=options, flush_every=100)
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=25, audit=log, seed=3)
        kept = [x["__key__"] for x in s(samples)]
        s.close()
        texts["repr(AuditLog)"] = repr(log) + repr(log.stats) + repr(s)
        # a destination that fails, and one that is refused, with the same credentials
        for bad in (
            "s3://no-such-bucket-planted/x",
            f"s3://AKIA:{PLANTED['Azure account key']}@b/x",
            "nope://x",
        ):
            try:
                t = sp.Sifter(
                    None,
                    loss_field,
                    sp.Uniform(0.5),
                    micro_batch=25,
                    audit=sp.AuditLog(bad, storage_options=options),
                )
                t(samples)
            except sp.AuditError as exc:
                texts[f"error {bad[:12]}"] = str(exc) + repr(exc)
        table = sp.read_log(root, options)
        texts["read_log"] = str(table.to_pylist())
        report = sp.verify_log(root, options)
        assert report.ok
        texts["verify_log"] = repr(report) + "\n".join(report.lines())
        replay = sp.replay(root, options)
        assert [x["__key__"] for x in replay(samples)] == kept
        texts["repr(Replay)"] = repr(replay)
    texts["warnings"] = "\n".join(str(w.message) for w in caught)
    # every object in the bucket, raw and (for Parquet) decoded
    fs = own_s3.fs()
    for path in fs.find(bucket):
        data = fs.cat_file(path)
        texts[path] = data.decode("latin-1")
        if path.endswith(".parquet"):
            import io

            texts[path + " (decoded)"] = str(pq.read_table(io.BytesIO(data)).to_pylist())
    assert any("_claim-" in p for p in texts) and any("_manifest-" in p for p in texts)
    # the command line, given the credentials as options, and the ways it can fail
    opts = [
        "--storage-option",
        f"endpoint_url={own_s3.endpoint}",
        "--storage-option",
        "key=AKIAPLANTEDKEY000000",
        "--storage-option",
        f"secret={PLANTED['storage option secret']}",
    ]
    for command in (
        ["summary"],
        ["summary", "--json"],
        ["keys", "--dropped"],
        ["verify"],
        ["whatif", "--uniform", "0.5"],
        ["plot", "-o", str(tmp_path / "p.png")],
    ):
        code = main(["log", command[0], root, *opts, *command[1:]])
        out = capsys.readouterr()
        assert code == 0, out.err
        texts[f"siftpipe log {' '.join(command)}"] = out.out + out.err
    for argv in (
        ["log", "summary", "s3://no-such-bucket-planted/x", *opts],
        ["log", "verify", f"s3://AKIA:{PLANTED['Azure account key']}@b/x", *opts],
        ["log", "keys", root, "--storage-option", PLANTED["session token"]],
    ):
        try:
            code = main(argv)
        except SystemExit as exc:
            texts[" ".join(argv[:2]) + " exit"] = str(exc)
        out = capsys.readouterr()
        texts[" ".join(argv[:3])] = out.out + out.err
    assert "reader:***@shards.internal:8080/a-000000.tar" in texts["siftpipe log summary"]
    leaks = []
    for name, secret in PLANTED.items():
        for form in {secret, quote(secret, safe=""), base64.b64encode(secret.encode()).decode()}:
            leaks += [(name, where) for where, text in texts.items() if form in text]
        tried("credential shapes tried")
    assert not leaks, leaks


RESUMER = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {repo!r})
    import siftpipe as sp
    from tests.common import loss_field, make_samples

    root, ckpt, go = sys.argv[1:4]
    state = torch.load(ckpt, weights_only=True)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, seed=4,
                  audit=sp.AuditLog(root, flush_every=40))
    s.load_state_dict(state)
    open(go + ".ready-" + str(os.getpid()), "w").close()  # loaded: its attempt has started
    while not os.path.exists(go):
        time.sleep(0.001)
    for x in s(make_samples(400, seed=6)[state["consumed"]:]):
        time.sleep(0.002)
    s.close()
    print("done", flush=True)
    """
)


def test_two_processes_resuming_one_job_at_once_are_reported(tmp_path):
    """Both resume from the same checkpoint, so the claim cannot tell them from a resume after a
    crash; but the later one's records would hide the earlier one's, though both were handed
    on: verify reports the overlap. One resume after another (the crash case) stays OK."""
    import torch

    from tests.common import roundtrip

    root = str(tmp_path / "log")
    log = sp.AuditLog(root, run_id="twice", flush_every=40)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, audit=log, seed=4)
    it = s(make_samples(400, seed=6))
    for _ in range(60):
        next(it)
    ckpt = tmp_path / "sift.pt"
    torch.save(roundtrip(s.state_dict()), ckpt)
    s.close()
    script = tmp_path / "resume.py"
    script.write_text(RESUMER.format(repo=REPO))

    def resume(n):
        go = tmp_path / f"go-{os.urandom(4).hex()}"
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), root, str(ckpt), str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env(),
            )
            for _ in range(n)
        ]
        # released together once every process has loaded the checkpoint (a fast one could
        # otherwise finish before a slow one starts: one resume after another, not a race)
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob(go.name + ".ready-*"))) < n and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.01)
        go.write_text("go")
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0 and "done" in out, err

    resume(1)
    resume(1)  # again from the same checkpoint, after the first finished: a resume, not a race
    report = sp.verify_log(root)
    assert report.ok and len(report.streams[0].attempts) == 3, report.lines()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        sp.read_log(root)
    tried("concurrent writers tried", 1)
    resume(2)
    report = sp.verify_log(root)
    (stream,) = report.streams
    assert not report.ok and len(stream.attempts) == 5
    assert any("ran at the same time" in c for c in stream.collisions), report.lines()
    # every reader says so too (found by review, 2026-12-05: only verify did; summary, keys,
    # whatif and plot counted one process's trained samples, exit 0, nothing said)
    with pytest.warns(RuntimeWarning, match="ran at the same time .*two processes continued one job"):
        sp.read_log(root)
    from siftpipe.cli import main

    with pytest.warns(RuntimeWarning, match="ran at the same time"):
        assert main(["log", "keys", root]) == 0
    tried("concurrent writers tried", 2)
