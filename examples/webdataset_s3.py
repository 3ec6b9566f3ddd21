"""Stream WebDataset shards from S3, decode in DataLoader workers, sift with the live model.

    python examples/webdataset_s3.py                       # starts its own local S3 server
    python examples/webdataset_s3.py --store s3://my-bucket/sift-demo/train \\
        --storage-option endpoint_url=https://s3.example.com   # or the AWS environment

It writes a synthetic classification set (many easy, redundant samples and a hard tail) to
shards at the store, then trains a small MLP for a few epochs on what siftpipe keeps:

    WebDataset(s3 shards).decode().map(...).batched(256)    <- in the DataLoader workers
    WebLoader(dataset, batch_size=None, num_workers=2)      <- batches to the training process
        .sift(Sifter(model, CrossEntropy, batched=True,     <- scored with the live model
                     output_batch=128))

and prints one JSON summary: how much was kept, how over-represented the hard tail is among the
kept samples, and the test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import webdataset as wds
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.cli import parse_storage_options
from siftpipe.shards import synthetic_arrays, synthetic_classification, write_shards
from siftpipe.webdataset import WebDataset, WebLoader


def start_local_s3() -> tuple[object, str]:
    """A throwaway S3 server on loopback (moto), with dummy credentials for this process only."""
    import logging

    from moto.server import ThreadedMotoServer

    os.environ.pop("AWS_PROFILE", None)
    os.environ.update(
        AWS_ACCESS_KEY_ID="siftpipe-example",
        AWS_SECRET_ACCESS_KEY="siftpipe-example",
        AWS_DEFAULT_REGION="us-east-1",
    )
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    import fsspec

    fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True).mkdir("siftpipe-example")
    return server, endpoint


def to_xy(sample: dict) -> dict:
    """Decoded shard sample -> training sample (runs in the DataLoader workers)."""
    return {
        "__key__": sample["__key__"],
        "x": torch.from_numpy(sample["x.npy"]),
        "y": sample["cls"],
        "hard": sample["hard.cls"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="shard prefix, e.g. s3://bucket/dir/train (default: a local S3 server)")
    ap.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec storage option")
    ap.add_argument("--samples", type=int, default=40_000, help="training samples to write")
    ap.add_argument("--per-shard", type=int, default=2_000, help="samples per shard")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (decode + batch)")
    ap.add_argument("--worker-batch", type=int, default=256, help="rows per worker batch (one scoring pass)")
    ap.add_argument("--batch", type=int, default=128, help="rows per training step (kept samples)")
    ap.add_argument("--beta", type=float, default=1.0, help="RelativeProbabilistic beta (keeps 1/(1+beta))")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("samples", "per_shard", "dim", "classes", "epochs", "worker_batch", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    server = None
    options = parse_storage_options(args.storage_option)
    store = args.store
    if store is None:
        server, endpoint = start_local_s3()
        options.setdefault("endpoint_url", endpoint)
        store = "s3://siftpipe-example/demo/train"
    try:
        t0 = time.perf_counter()
        written = write_shards(
            synthetic_classification(args.samples, dim=args.dim, classes=args.classes, seed=args.seed),
            store,
            samples_per_shard=args.per_shard,
            storage_options=options,
            progress=False,
        )
        write_s = time.perf_counter() - t0

        torch.manual_seed(args.seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(args.dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, args.classes)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sifter = sp.Sifter(
            model,
            sp.CrossEntropy("x", "y"),
            sp.RelativeProbabilistic(beta=args.beta, history=2048),
            batched=True,
            micro_batch=None,  # one forward pass per worker batch
            output_batch=args.batch,
            delay=2 * args.worker_batch,
            seed=args.seed,
        )
        dataset = (
            WebDataset(
                written.pattern,
                shardshuffle=len(written.urls),
                seed=args.seed,
                storage_options=options,
                nodesplitter=wds.split_by_node,  # each rank its own shards (one rank here)
            )
            .decode()
            .map(to_xy)
            .batched(args.worker_batch, collation_fn=default_collate)
        )
        loader = WebLoader(dataset, batch_size=None, num_workers=args.workers).sift(sifter)

        kept_hard = kept = steps = 0
        t0 = time.perf_counter()
        for epoch in range(args.epochs):
            sifter.set_epoch(epoch)
            model.train()
            for batch in loader:
                loss = F.cross_entropy(model(batch["x"]), batch["y"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps += 1
                kept += len(batch["y"])
                kept_hard += int(batch["hard"].sum())
        train_s = time.perf_counter() - t0

        # the same task (seed: the class centres), samples never trained on (draw=1)
        x_test, y_test, _ = synthetic_arrays(2000, dim=args.dim, classes=args.classes, seed=args.seed, draw=1)
        with torch.no_grad():
            accuracy = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
        stats = sifter.stats
        _, _, hard_all = synthetic_arrays(args.samples, dim=args.dim, classes=args.classes, seed=args.seed)
        summary = {
            "shards": len(written.urls),
            "pattern": written.pattern,
            "epochs": args.epochs,
            "seen": stats.seen,
            "kept": stats.kept,
            "keep_rate": round(stats.keep_rate, 4),
            "train_steps": steps,
            "hard_share_in_data": round(float(hard_all.mean()), 4),
            "hard_share_in_kept": round(kept_hard / max(kept, 1), 4),
            "test_accuracy": round(float(accuracy), 4),
            "write_seconds": round(write_s, 2),
            "train_seconds": round(train_s, 2),
        }
        print(json.dumps(summary))
        assert stats.kept + stats.dropped == stats.seen == args.samples * args.epochs
        return 0
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
