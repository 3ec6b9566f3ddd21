"""A training process killed with SIGKILL mid-run, then resumed from its last checkpoint."""

import textwrap

import siftpipe as sp
from tests.common import REPO, loss_field, make_samples
from tests.faults import kill_after_checkpoints

TOTAL = 6000
FLUSH_EVERY = 200

SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {repo!r})
    import siftpipe as sp
    from tests.common import loss_field, make_samples

    root, endpoint, ckpt = sys.argv[1:4]
    samples = make_samples({total}, seed=5)
    log = sp.AuditLog(root, storage_options={{"endpoint_url": endpoint}}, run_id="killed",
                      flush_every={flush})
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 300), micro_batch=50, audit=log, seed=7)
    for i, x in enumerate(s(samples)):
        if i % 100 == 99:
            torch.save(s.state_dict(), ckpt + ".tmp")
            log.flush()  # the checkpoint's records are durable before the checkpoint is
            import os; os.replace(ckpt + ".tmp", ckpt)
            print("checkpoint", s.stats.seen, log.stats.parts_written, flush=True)
        time.sleep(0.002)
    print("finished", flush=True)
    """
)


def reference_decisions():
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 300), micro_batch=50, seed=7)
    return [x["__key__"] for x in s(make_samples(TOTAL, seed=5))]


def test_sigkill_then_resume_lines_up_with_the_checkpoint(own_s3, tmp_path):
    bucket = own_s3.new_bucket()
    root = f"s3://{bucket}/log"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, total=TOTAL, flush=FLUSH_EVERY))
    ckpt = str(tmp_path / "sift.pt")
    checkpoints = kill_after_checkpoints(str(script), [root, own_s3.endpoint, ckpt], 8)
    assert len(checkpoints) >= 8

    options = own_s3.storage_options
    report = sp.verify_log(root, options)
    stream = report.streams[0]
    # every complete part is readable; nothing is missing before the last durable checkpoint
    assert not stream.unreadable_parts and not stream.gaps and not stream.duplicates
    assert stream.records >= checkpoints[-1]
    assert not stream.attempts[0]["ended"]
    assert "did not close (killed" in "\n".join(report.lines())

    import torch

    state = torch.load(ckpt, weights_only=True)
    s = sp.Sifter(
        None,
        loss_field,
        sp.RelativeProbabilistic(1.0, 300),
        micro_batch=50,
        seed=7,
        audit=sp.AuditLog(root, storage_options=options, flush_every=FLUSH_EVERY),
    )
    s.load_state_dict(state)
    samples = make_samples(TOTAL, seed=5)
    list(s(samples[state["consumed"] :]))
    s.close()

    report = sp.verify_log(root, options)
    stream = report.streams[0]
    assert report.ok, "\n".join(report.lines())
    assert stream.records == TOTAL and (stream.first_seq, stream.last_seq) == (0, TOTAL - 1)
    assert len(stream.attempts) == 2 and stream.attempts[1]["ended"]
    table = sp.read_log(root, options)
    kept = [k for k, kp in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()) if kp]
    assert kept == reference_decisions()
