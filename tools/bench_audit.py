"""Cost of the audit log, and speed of reading it back, measured side by side in one run.

Prints one JSON object:
  no_audit_samples_per_s      batched stage, precomputed losses, worker batches of --batch rows
  audit_samples_per_s         the same with the audit log writing to the loopback S3 server,
                              timed until every record is written (close() included)
  audit_ratio                 audit_samples_per_s / no_audit_samples_per_s
  model_audit_ratio           the same ratio when scoring runs a real model (3-layer MLP of width 256,
                              about 1 ms per forward of 256 on this VM) on worker batches of 256
  summary_records             records in the log read back by `log summary`
  summary_s3_records_per_s    read_log(summary columns) + summarize, from the S3 server
  summary_local_records_per_s the same from a local directory

Usage: python tools/bench_audit.py [--samples 2000000] [--summary-records 10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _s3server import S3Server

import siftpipe as sp
from siftpipe.audit.summary import summarize
from siftpipe.demo import build_model


def precomputed(model, batch):
    return batch["loss"]


def make_batches(rows: int, count: int, rng: np.random.Generator) -> list[dict]:
    return [
        {
            "__key__": [f"shard-{b % 97:06d}/sample-{b * rows + i:09d}" for i in range(rows)],
            "__url__": [f"s3://data/train-{b // 20:06d}.tar"] * rows,
            "x": torch.zeros(rows, 8),
            "loss": torch.from_numpy(rng.exponential(size=rows)),
        }
        for b in range(count)
    ]


def run(batches: list[dict], total: int, audit: sp.AuditLog | None, model=None, scorer=precomputed) -> float:
    """Samples per second of a batched stage over ``total`` batches (cycling ``batches``)."""
    s = sp.Sifter(
        model, scorer, sp.RelativeProbabilistic(1.0, 500), micro_batch=None, batched=True, audit=audit
    )
    if audit is not None:
        audit.start()  # a trainer builds its log before the loop; the writer's start-up is not timed
        time.sleep(1.0)
    t0 = time.perf_counter()
    for _ in s(batches[i % len(batches)] for i in range(total)):
        pass
    s.close()
    return s.stats.seen / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2_000_000, help="decisions per throughput arm")
    ap.add_argument("--batch", type=int, default=512, help="rows per worker batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--summary-records", type=int, default=10_000_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = make_batches(args.batch, 256, rng)
    total = args.samples // args.batch
    result: dict[str, object] = {"batch_rows": args.batch, "decisions_per_arm": total * args.batch}
    with S3Server() as s3:
        bucket = s3.bucket("bench-audit")
        plain, audited = [], []
        for r in range(args.repeats):  # interleaved: drift in machine speed hits both arms alike
            plain.append(run(batches, total, None))
            log = sp.AuditLog(f"s3://{bucket}/throughput/{r}", storage_options=s3.storage_options)
            audited.append(run(batches, total, log))
        result["no_audit_samples_per_s"] = max(plain)
        result["audit_samples_per_s"] = max(audited)
        result["audit_ratio"] = max(audited) / max(plain)

        torch.manual_seed(0)
        width = 256
        model = build_model(width, 10, width, depth=2).eval()  # 256-256-256-10
        model_batches = [
            {**b, "x": torch.randn(256, width), "y": torch.randint(0, 10, (256,))}
            for b in make_batches(256, 64, rng)
        ]
        scorer = sp.CrossEntropy("x", "y")
        plain, audited = [], []
        model_total = max(1, total // 4)
        for r in range(args.repeats):
            plain.append(run(model_batches, model_total, None, model, scorer))
            log = sp.AuditLog(f"s3://{bucket}/model/{r}", storage_options=s3.storage_options)
            audited.append(run(model_batches, model_total, log, model, scorer))
        result["model_no_audit_samples_per_s"] = max(plain)
        result["model_audit_samples_per_s"] = max(audited)
        result["model_audit_ratio"] = max(audited) / max(plain)

        # a log of --summary-records records, on S3 and locally, read back by `log summary`
        n_batches = args.summary_records // args.batch
        root = f"s3://{bucket}/summary"
        local = tempfile.mkdtemp(prefix="siftpipe-bench-")
        try:
            for url, options in ((root, s3.storage_options), (local, None)):
                log = sp.AuditLog(url, storage_options=options, run_id="bench", flush_every=262144)
                run(batches, n_batches, log)
            for name, url, options in (("s3", root, s3.storage_options), ("local", local, None)):
                best = float("inf")
                for _ in range(2):  # the second read finds the page cache warm, as a repeated summary does
                    t0 = time.perf_counter()
                    columns = ["seq", "kept", "loss", "reason", "url", "epoch"]
                    table = sp.read_log(url, options, columns=columns)
                    summary = summarize(table)
                    best = min(best, time.perf_counter() - t0)
                    del table
                result["summary_records"] = summary["records"]
                result[f"summary_{name}_records_per_s"] = summary["records"] / best
        finally:
            shutil.rmtree(local, ignore_errors=True)
    result["torch_threads"] = torch.get_num_threads()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
