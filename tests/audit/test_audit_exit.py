"""Reading a log leaves no native thread behind that could abort the process at exit.

`siftpipe log verify` on a complete S3 log once died with SIGABRT ("terminate called without an
active exception") on a loaded machine, after its report was printed. The cause: pyarrow's
worker threads (pre-buffering, threaded decoding, the dataset scanner's read-ahead) held Python
objects (a ``BytesIO``, a buffer over Python bytes) and released them just after the read
returned; when that happened while the interpreter was exiting, the GIL their release asks for
ended their thread (``pthread_exit`` in Python 3.11) inside a C++ destructor, which terminates
the process. Parts are now read on the calling thread from an Arrow-owned copy, and the ``log``
commands end with ``os._exit`` once their output is flushed.
"""

import os
import subprocess
import sys
import textwrap

import siftpipe as sp
from tests.common import REPO, loss_field, make_samples


def write_log(root, storage_options=None, n=1500):
    log = sp.AuditLog(root, storage_options=storage_options, run_id="exit", flush_every=300)
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 200), micro_batch=50, audit=log)
    list(s(make_samples(n, seed=3)))
    s.close()


READERS = textwrap.dedent(
    """
    import os, sys, threading, time
    sys.path.insert(0, {repo!r})
    import siftpipe as sp
    from siftpipe.audit.summary import summarize
    from tests.common import make_samples

    def native_threads():
        mine = {{t.native_id for t in threading.enumerate()}}
        return {{int(t) for t in os.listdir("/proc/self/task")}} - mine

    root = sys.argv[1]
    sp.read_log(root)  # imports and first use: whatever pyarrow starts at import is not a reader's
    before = native_threads()
    for _ in range(3):
        table = sp.read_log(root)
        summarize(table)
        assert sp.verify_log(root).ok
        list(sp.replay(root)(make_samples(1500, seed=3)))
        sp.whatif(root, [sp.Uniform(0.5)])
    # a Python thread that just finished may linger a moment as a native one: wait for it to go,
    # but an Arrow pool's workers never go
    for _ in range(200):
        extra = native_threads() - before
        if not extra:
            break
        time.sleep(0.05)
    print("extra native threads:", len(extra))
    """
)


def test_reading_a_log_leaves_no_native_worker_thread(tmp_path):
    root = str(tmp_path / "log")
    write_log(root)
    script = tmp_path / "read.py"
    script.write_text(READERS.format(repo=REPO))
    done = subprocess.run(
        [sys.executable, str(script), root],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "extra native threads: 0" in done.stdout, done.stdout + done.stderr


def test_log_verify_on_s3_exits_cleanly_every_time_under_load(own_s3):
    """The reported failure, exercised: `siftpipe log verify` on a complete S3 log, several times,
    while CPU burners compete for the cores. Every run must exit 0 with nothing on stderr."""
    bucket = own_s3.new_bucket()
    root = f"s3://{bucket}/log"
    write_log(root, own_s3.storage_options)
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(2)
    ]
    env = {**os.environ, "PYTHONPATH": REPO}
    results = []
    try:
        for _ in range(6):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "siftpipe",
                    "log",
                    "verify",
                    root,
                    "--storage-option",
                    f"endpoint_url={own_s3.endpoint}",
                ],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            results.append((done.returncode, done.stderr, "OK: 1500 records" in done.stdout))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert all(r == (0, "", True) for r in results), results


STOPPED = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    import siftpipe as sp
    from tests.common import loss_field, make_samples

    log = sp.AuditLog(sys.argv[1], run_id="r")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=log)
    for i, _ in enumerate(s(make_samples(400, seed=3))):
        if i == 100:
            raise RuntimeError("out of disk")  # uncaught: the log is closed at exit
    """
)


def test_an_attempt_closed_by_an_error_or_an_interrupt_does_not_read_closed_cleanly(tmp_path):
    """A job stopped by Ctrl-C (or any error) closes its log on the way out, and `verify` said
    "closed cleanly", as for a run that finished. The end marker now names what stopped it."""
    interrupted = str(tmp_path / "interrupted")
    try:
        with sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=interrupted) as s:
            for i, _ in enumerate(s(make_samples(400, seed=3))):
                if i == 100:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    crashed = str(tmp_path / "crashed")
    run = subprocess.run(
        [sys.executable, "-c", STOPPED.format(repo=str(REPO)), crashed],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1 and "out of disk" in run.stderr
    finished = str(tmp_path / "finished")
    write_log(finished, n=400)
    for root, end in [
        (interrupted, "closed as KeyboardInterrupt stopped the job"),
        (crashed, "closed as RuntimeError stopped the job"),
        (finished, "closed cleanly"),
    ]:
        report = sp.verify_log(root)
        assert report.ok, report.lines()  # whole up to where it stopped
        assert end in "\n".join(report.lines()), report.lines()
    assert "out of disk" not in "".join(p.read_text() for p in (tmp_path / "crashed").rglob("*.json"))
