"""How often a finished two-rank DDP job (gloo) aborts in the interpreter's teardown, with and
without ``sp.exit_process`` as its last call, on a loaded machine. Prints one JSON line.

    python tools/stress_ddp_exit.py --runs 16 --hogs 2

Each run is ``torchrun --nproc_per_node=2`` of a small job: DDP over a linear model, one
backward, ``dist.all_gather_object``, ``destroy_process_group``; then either the script's end
(``plain``) or ``sp.exit_process(0)`` (``exit_process``). The two arms alternate run by run so
that both meet the same load; ``--hogs`` busy processes load the cores while they run. A run
counts as ``aborted`` when a rank printed ``terminate called without an active exception``
(SIGABRT), and as ``failed`` when torchrun exited non-zero for any reason.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = """
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import siftpipe as sp

dist.init_process_group("gloo")
torch.set_num_threads(1)
model = DDP(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, {"rank": dist.get_rank()})
dist.destroy_process_group()
if sys.argv[1] == "exit_process":
    sp.exit_process(0)
"""


def _hog() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=16, help="runs per arm")
    ap.add_argument("--hogs", type=int, default=2, help="busy processes loading the cores meanwhile")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take")
    args = ap.parse_args(argv)
    counts = {arm: {"runs": 0, "aborted": 0, "failed": 0} for arm in ("plain", "exit_process")}
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = Path(tmp) / "job.py"
            job.write_text(JOB)
            for _ in range(args.runs):
                for arm, tally in counts.items():
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                    cmd += ["--nproc_per_node=2", str(job), arm]
                    try:
                        done = subprocess.run(
                            cmd,
                            capture_output=True,
                            text=True,
                            env=env,
                            cwd=tmp,
                            timeout=args.timeout,
                            check=False,
                        )
                        failed = done.returncode != 0
                        aborted = "terminate called without an active exception" in done.stderr
                    except subprocess.TimeoutExpired:
                        failed, aborted = True, False
                    tally["runs"] += 1
                    tally["failed"] += failed
                    tally["aborted"] += aborted
    finally:
        for hog in hogs:
            hog.terminate()
    print(json.dumps({"hogs": args.hogs, "cpus": os.cpu_count(), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
