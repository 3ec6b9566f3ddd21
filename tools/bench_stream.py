"""Streaming throughput with and without sifting: WebDataset shards from a local S3 server.

Both arms run the same pipeline, measured side by side in one run with their repeats
interleaved (plain, sifted, sifted, plain, ...; this VM is noisy):

    WebDataset(s3://.../bench-{000000..}.tar, storage_options={endpoint_url})   # 2 workers:
        .decode().batched(--worker-batch, default_collate)                      # read, decode, batch
    WebLoader(dataset, batch_size=None, num_workers=2)                          # -> this process
        [.sift(Sifter(None, precomputed, RelativeProbabilistic(1, 500), batched=True))]

The scorer costs nothing (each sample carries a precomputed loss), so the difference between the
arms is the sift stage itself plus what it takes from the CPUs the workers need. The S3 server
(moto) runs in its own process. Prints one JSON object:

  plain_samples_per_s, sifted_samples_per_s   input samples streamed per second (median of repeats;
                                              each arm keeps its two workers: persistent_workers)
  ratio                                       sifted / plain
  median_pair_ratio                           median over repeats of sifted / plain (same repeat)
  plain_runs, sifted_runs                     every repeat, samples per second
  keep_rate                                   kept / seen of the sifted arm
  training_process_cpu_us_per_sample          CPU time of this process (not the workers or the
                                              server) per streamed sample, median of each arm:
                                              the sift stage's own cost, robust to a busy machine
  load_average_1min_before                    how busy the machine was when the run started

Usage: python tools/bench_stream.py [--samples 20000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.adapters.webdataset import WebDataset, WebLoader
from siftpipe.streaming.shards import write_shards


def start_moto() -> tuple[subprocess.Popen, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    moto_server = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [moto_server, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.05)


def samples(n: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    loss = rng.exponential(size=n)
    for i in range(n):
        yield {"__key__": f"{i:09d}", "x.npy": x[i], "cls": int(y[i]), "loss.npy": np.float64(loss[i])}


def precomputed(model, batch):
    return batch["loss.npy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20_000, help="samples per run")
    ap.add_argument("--per-shard", type=int, default=2_500)
    ap.add_argument("--dim", type=int, default=32, help="float32 features per sample")
    ap.add_argument("--worker-batch", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9, help="runs of each arm, interleaved")
    args = ap.parse_args()

    env_before = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")}
    os.environ.pop("AWS_PROFILE", None)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    load_before = os.getloadavg()[0]
    proc, endpoint = start_moto()
    try:
        import fsspec

        options = {"endpoint_url": endpoint}
        fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir("bench")
        written = write_shards(
            samples(args.samples, args.dim),
            "s3://bench/stream/bench",
            samples_per_shard=args.per_shard,
            storage_options=options,
            progress=False,
        )
        dataset = (
            WebDataset(written.pattern, shardshuffle=False, storage_options=options)
            .decode()
            .batched(args.worker_batch, collation_fn=default_collate)
        )
        torch.set_num_threads(1)
        keep_rates = []

        # one loader per arm, with persistent workers: every repeat streams the shards again
        # through the same two workers (no process start-up or S3 client set-up in the timings)
        plain_loader = WebLoader(dataset, batch_size=None, num_workers=args.workers, persistent_workers=True)
        sifter = sp.Sifter(
            None, precomputed, sp.RelativeProbabilistic(1.0, 500), batched=True, micro_batch=None
        )
        sifted_loader = WebLoader(
            dataset, batch_size=None, num_workers=args.workers, persistent_workers=True
        ).sift(sifter)

        def plain() -> int:
            n = 0
            for batch in plain_loader:
                n += len(batch["__key__"])
            return n

        def sifted() -> int:
            before = sifter.stats
            for _ in sifted_loader:
                pass
            after = sifter.stats
            keep_rates.append((after.kept - before.kept) / (after.seen - before.seen))
            return after.seen - before.seen

        runs: dict[str, list[float]] = {"plain": [], "sifted": []}
        cpu: dict[str, list[float]] = {"plain": [], "sifted": []}
        arms = {"plain": plain, "sifted": sifted}
        plain()  # warm up both arms: the server, the page cache, lazy imports in the workers
        sifted()
        keep_rates.clear()
        for r in range(args.repeats):
            for name in ("plain", "sifted") if r % 2 == 0 else ("sifted", "plain"):
                t0, c0 = time.perf_counter(), time.process_time()
                n = arms[name]()
                elapsed, used = time.perf_counter() - t0, time.process_time() - c0
                assert n == args.samples, (name, n)
                runs[name].append(n / elapsed)
                cpu[name].append(used / n * 1e6)
        plain_rate = statistics.median(runs["plain"])
        sifted_rate = statistics.median(runs["sifted"])
        # each repeat's two runs were back to back: their ratio cancels slow drifts of the VM
        pair_ratios = [s / p for s, p in zip(runs["sifted"], runs["plain"])]
        print(
            json.dumps(
                {
                    "samples": args.samples,
                    "shards": len(written.urls),
                    "workers": args.workers,
                    "worker_batch": args.worker_batch,
                    "repeats": args.repeats,
                    "plain_samples_per_s": round(plain_rate),
                    "sifted_samples_per_s": round(sifted_rate),
                    "ratio": round(sifted_rate / plain_rate, 3),
                    "median_pair_ratio": round(statistics.median(pair_ratios), 3),
                    "plain_runs": [round(v) for v in runs["plain"]],
                    "sifted_runs": [round(v) for v in runs["sifted"]],
                    "keep_rate": round(statistics.mean(keep_rates), 3),
                    "training_process_cpu_us_per_sample": {
                        name: round(statistics.median(v), 2) for name, v in cpu.items()
                    },
                    "load_average_1min_before": round(load_before, 2),
                }
            )
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    main()
