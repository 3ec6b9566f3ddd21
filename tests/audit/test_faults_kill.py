"""A real training process killed with SIGKILL in batched mode, re-batching into output batches,
with the thread writer (which dies with the process, unlike the writer process of
test_audit_kill.py), then resumed from its last checkpoint: the log lines up with the checkpoint
and ``siftpipe log verify`` says exactly that."""

from __future__ import annotations

import textwrap

import torch
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.cli import main as cli
from tests.common import REPO, loss_field, make_samples
from tests.contract import output_keys, signature
from tests.faults import kill_after_checkpoints

TOTAL, BATCH, OUTPUT, FLUSH = 3000, 50, 64, 150

SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {repo!r})
    from torch.utils.data import default_collate
    import siftpipe as sp
    from tests.common import loss_field, make_samples

    root, endpoint, ckpt = sys.argv[1:4]
    samples = make_samples({total}, seed=8)
    batches = [default_collate(samples[i : i + {batch}]) for i in range(0, {total}, {batch})]
    log = sp.AuditLog(root, storage_options={{"endpoint_url": endpoint}}, run_id="killed-thread",
                      flush_every={flush}, writer="thread")
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 200), batched=True, micro_batch=None,
                  output_batch={output}, audit=log, seed=4)
    for i, out in enumerate(s(batches)):
        if i % 2 == 1:
            torch.save({{"sift": s.state_dict(), "outputs": i + 1}}, ckpt + ".tmp")
            log.flush()  # the records decided before the checkpoint are durable before it is
            os.replace(ckpt + ".tmp", ckpt)
            print("checkpoint", s.stats.seen, s.consumed, flush=True)
        time.sleep(0.01)
    print("finished", flush=True)
    """
)


def batches():
    samples = make_samples(TOTAL, seed=8)
    return [default_collate(samples[i : i + BATCH]) for i in range(0, TOTAL, BATCH)]


def make_sifter(**kw):
    return sp.Sifter(
        None,
        loss_field,
        sp.RelativeProbabilistic(1.0, 200),
        batched=True,
        micro_batch=None,
        output_batch=OUTPUT,
        seed=4,
        **kw,
    )


def test_sigkill_in_batched_mode_with_the_thread_writer_then_resume(own_s3, tmp_path, capsys):
    bucket = own_s3.new_bucket()
    root = f"s3://{bucket}/log"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, total=TOTAL, batch=BATCH, flush=FLUSH, output=OUTPUT))
    ckpt = str(tmp_path / "sift.pt")
    # kill it mid-run, a little past a checkpoint: inside the next output batches
    checkpoints = kill_after_checkpoints(str(script), [root, own_s3.endpoint, ckpt], 5, past=0.015)
    assert len(checkpoints) >= 5

    options = own_s3.storage_options
    saved = torch.load(ckpt, weights_only=True)
    state = saved["sift"]
    assert state["pending"], "the checkpoint fell inside an output batch: decided rows still to hand on"
    report = sp.verify_log(root, options)
    (stream,) = report.streams
    # the dead attempt: everything up to its last checkpoint is there, whatever it lost after
    assert stream.first_seq == 0 and stream.last_seq >= state["counts"]["seen"] - 1
    assert not [g for g in stream.gaps if g[0] < state["counts"]["seen"]] and not stream.duplicates
    assert not stream.attempts[0]["ended"]

    s = make_sifter(audit=sp.AuditLog(root, storage_options=options, flush_every=FLUSH, writer="thread"))
    s.load_state_dict(state)
    rest = list(s(batches()[state["consumed"] :]))
    s.close()

    expected = list(make_sifter()(batches()))
    # the resumed run hands on exactly what the uninterrupted run handed on after the checkpoint
    assert [signature(b) for b in rest] == [signature(b) for b in expected[saved["outputs"] :]]

    report = sp.verify_log(root, options)
    (stream,) = report.streams
    assert report.ok, "\n".join(report.lines())
    assert (stream.records, stream.first_seq, stream.last_seq) == (TOTAL, 0, TOTAL - 1)
    assert stream.superseded == sum(a["records"] for a in stream.attempts) - TOTAL
    assert [a["ended"] for a in stream.attempts] == [False, True]
    assert stream.attempts[1]["resumed_from"] == state["counts"]["seen"]
    table = sp.read_log(root, options)
    kept = [k for k, kp in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()) if kp]
    assert kept == output_keys(expected)

    capsys.readouterr()
    assert cli(["log", "verify", root, "--storage-option", f"endpoint_url={own_s3.endpoint}"]) == 0
    text = capsys.readouterr().out
    assert f"run=killed-thread rank=0: OK: {TOTAL} records, seq 0..{TOTAL - 1}, 2 attempt(s)" in text
    assert "did not close (killed" in text and "closed cleanly" in text
    assert f"resumed from seq {state['counts']['seen']}" in text
