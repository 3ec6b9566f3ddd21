"""Cost of siftpipe's collectives, measured with real processes on the gloo backend.

For each world size: the per-step agreement of ``EqualSteps`` (one all-reduce of one int64) and
one ``sync_history`` (an all-gather of 257 float64 per rank), in microseconds, median of many
calls; one ``sync_memory`` of an epoch's score memory (``--memory-samples`` samples of the whole
dataset, each rank sending its share and merging the others'), in milliseconds, median of 3;
plus the audit log's bytes per record from a real log. Prints one JSON object.

Usage: python tools/bench_distributed.py [--worlds 2 4] [--calls 2000] [--memory-samples 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import siftpipe as sp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, calls: int, out: str, samples: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    flag = torch.zeros(1, dtype=torch.int64)
    agree = []
    for _ in range(calls):
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        agree.append(time.perf_counter() - t0)
    sifter = sp.Sifter(None, lambda m, b: b, sp.RelativeProbabilistic(1.0, 5000), key=None)
    sifter.policy.history.extend(np.random.default_rng(rank).exponential(size=5000))
    sync = []
    for _ in range(calls // 10):
        dist.barrier()
        t0 = time.perf_counter()
        sp.sync_history(sifter)
        sync.append(time.perf_counter() - t0)
    # an epoch of a DistributedSampler's deal: this rank trained every world-th sample
    share = np.arange(rank, samples, world)
    losses = np.random.default_rng(rank).exponential(size=share.size)
    memory_ms = []
    for epoch in range(3):
        memory = sp.ScoreMemory(samples, max_age=None)
        memory.update_keys(share, losses, epoch, 1)
        dist.barrier()
        t0 = time.perf_counter()
        sp.sync_memory(memory)
        memory_ms.append((time.perf_counter() - t0) * 1e3)
        assert len(memory) == samples
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "agree_us": float(np.median(agree) * 1e6),
                    "sync_us": float(np.median(sync) * 1e6),
                    "memory_ms": float(np.median(memory_ms)),
                },
                f,
            )
    dist.destroy_process_group()


def audit_bytes_per_record(records: int = 500_000) -> float:
    root = tempfile.mkdtemp(prefix="siftpipe-scale-")
    rows = 512
    batches = [
        {
            "__key__": [f"shard-{b:06d}/sample-{b * rows + i:09d}" for i in range(rows)],
            "__url__": [f"s3://data/train-{b // 20:06d}.tar"] * rows,
            "loss": torch.from_numpy(np.random.default_rng(b).exponential(size=rows)),
        }
        for b in range(64)
    ]
    log = sp.AuditLog(root, run_id="scale", flush_every=262144)
    s = sp.Sifter(None, lambda m, b: b["loss"], micro_batch=None, batched=True, audit=log)
    for _ in s(batches[i % 64] for i in range(records // rows)):
        pass
    s.close()
    total = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".parquet")
    )
    return total / s.stats.seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--memory-samples", type=int, default=1_000_000)
    args = ap.parse_args()
    result: dict[str, object] = {"backend": "gloo", "cores": os.cpu_count()}
    for world in args.worlds:
        out = tempfile.mktemp(suffix=".json")
        mp.spawn(
            _worker, args=(world, _free_port(), args.calls, out, args.memory_samples), nprocs=world, join=True
        )
        with open(out) as f:
            measured = json.load(f)
        result[f"world{world}_equal_steps_us_per_step"] = round(measured["agree_us"], 1)
        result[f"world{world}_sync_history_us_per_call"] = round(measured["sync_us"], 1)
        result[f"world{world}_sync_memory_ms_per_epoch"] = round(measured["memory_ms"], 1)
    result["sync_memory_samples"] = args.memory_samples
    result["audit_bytes_per_record"] = round(audit_bytes_per_record(), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
