"""matplotlib and tqdm are extras: without them siftpipe imports, writes and reads shards and logs
(no progress bars), the demo runs (no plot, one line saying so), and `siftpipe log plot` is one
error line naming the `pip install` to run. "Without them" is real: the modules are blocked in a
fresh interpreter, so importing them raises ImportError as on a machine that lacks them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.demo.test_demo import TINY

ROOT = Path(__file__).resolve().parents[1]
_HIDDEN = ("matplotlib", "matplotlib.pyplot", "tqdm", "tqdm.auto")
BLOCK = f"import sys\nfor m in {_HIDDEN!r}: sys.modules[m] = None\n"


def run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])),
        check=False,
    )


def test_without_the_extras_shards_and_logs_work_and_plot_names_the_install(tmp_path):
    done = run(
        f"""
        import siftpipe as sp
        from siftpipe.cli import main
        from tests.common import loss_field, make_samples
        samples = make_samples(200, seed=3)
        from siftpipe.shards import write_shards
        written = write_shards(({{"__key__": s["__key__"], "loss.json": float(s["loss"])}}
                                   for s in samples), {str(tmp_path / "data" / "train")!r},
                                  samples_per_shard=50, progress=True)
        assert len(written.urls) == 4, written
        log = sp.AuditLog({str(tmp_path / "log")!r}, run_id="x", flush_every=50, writer="thread")
        s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=25, audit=log)
        list(s(samples))
        s.close()
        assert sp.read_log({str(tmp_path / "log")!r}, progress=True).num_rows == 200
        assert main(["log", "summary", {str(tmp_path / "log")!r}]) == 0
        sys.exit(main(["log", "plot", {str(tmp_path / "log")!r}, "--output", {str(tmp_path / "p.png")!r}]))
        """,
        tmp_path,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("siftpipe: error")]
    assert errors == [
        "siftpipe: error: siftpipe log plot needs matplotlib, which is not installed: "
        "pip install 'siftpipe[plot]'"
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "p.png").exists()


def test_without_the_extras_the_demo_runs_and_says_why_there_is_no_plot(tmp_path):
    out = tmp_path / "demo"
    done = run(
        f"""
        from siftpipe.cli import main
        sys.exit(main(["demo", "--out", {str(out)!r}, *{TINY!r}]))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no accuracy plot: matplotlib is not installed (pip install 'siftpipe[plot]')" in done.stderr
    assert "full (no sifting)" in done.stdout and not (out / "accuracy.png").exists()
    assert "plot of test accuracy" not in done.stdout
