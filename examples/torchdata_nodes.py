"""torchdata.nodes: stateful shard source -> decode in worker processes -> batch -> sift -> train,
with a checkpoint in the middle that resumes exactly.

    python examples/torchdata_nodes.py                        # shards in a temporary directory
    python examples/torchdata_nodes.py --store s3://bucket/sift-demo/train \\
        --storage-option endpoint_url=https://s3.example.com

The pipeline:

    ShardSource(shards)                                   stateful: epoch, shard, byte offset
    -> ParallelMapper(decode, method="process")           decode in worker processes
    -> Batcher(256) -> Mapper(default_collate)
    -> SiftNode(Sifter(model, CrossEntropy, batched=True))  scored with the live model
    -> Loader                                             loader.state_dict() holds it all

It trains twice: once straight through, and once stopped after --stop-at steps, saved with
torch.save (model, optimizer, loader state), rebuilt from scratch and resumed. Both runs must see
exactly the same kept samples and end with the same weights; the JSON summary says so.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate
from torchdata.nodes import Batcher, Mapper, ParallelMapper

import siftpipe as sp
from siftpipe.cli import parse_storage_options
from siftpipe.nodes import Loader, ShardSource, SiftNode  # torchdata's Loader, mended
from siftpipe.shards import (
    decode_sample,
    synthetic_arrays,
    synthetic_classification,
    write_shards,
)


def to_xy(raw: dict) -> dict:
    """Raw shard sample -> training sample (runs in the worker processes). It returns numpy
    arrays, which cross the process boundary cheaply (small tensors would each go through shared
    memory); default_collate makes the batch tensors."""
    s = decode_sample(raw)
    return {"__key__": s["__key__"], "x": s["x.npy"], "y": s["cls"]}


def build(
    args: argparse.Namespace, pattern: str, options: dict
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Loader]:
    """A fresh model, optimizer and loader (what a restarted job builds before loading a checkpoint)."""
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, args.classes)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sifter = sp.Sifter(
        model,
        sp.CrossEntropy("x", "y"),
        sp.RelativeProbabilistic(beta=1.0, history=2048),
        batched=True,
        micro_batch=None,
        output_batch=args.batch,
        delay=2 * args.worker_batch,
        seed=args.seed,
    )
    source = ShardSource(pattern, storage_options=options, shuffle=True, seed=args.seed)
    # prebatch: the workers map lists of 64 samples, one inter-process message per list
    decoded = ParallelMapper(source, to_xy, num_workers=args.workers, method="process", prebatch=64)
    batches = Mapper(Batcher(decoded, batch_size=args.worker_batch, drop_last=False), default_collate)
    return model, optimizer, Loader(SiftNode(batches, sifter))


def train(model, optimizer, loader, steps: int, log: list[list[str]]) -> None:
    """``steps`` training steps on the kept batches; records each step's sample keys."""
    it = iter(loader)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:  # the next epoch (the loader restarts; the sifter keeps its history)
            it = iter(loader)
            batch = next(it)
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log.append(list(batch["__key__"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="shard prefix (any fsspec URL); default: a temporary directory")
    ap.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec storage option")
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--per-shard", type=int, default=2_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="decode worker processes")
    ap.add_argument("--worker-batch", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128, help="kept rows per training step")
    ap.add_argument("--steps", type=int, default=120, help="training steps in all")
    ap.add_argument("--stop-at", type=int, default=45, help="step after which the job is checkpointed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0 < args.stop_at < args.steps:
        ap.error("--stop-at must be between 0 and --steps")

    options = parse_storage_options(args.storage_option)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"{tmp}/train"
        written = write_shards(
            synthetic_classification(args.samples, dim=args.dim, classes=args.classes, seed=args.seed),
            store,
            samples_per_shard=args.per_shard,
            storage_options=options,
            progress=False,
        )

        t0 = time.perf_counter()
        straight: list[list[str]] = []
        model_a, opt_a, loader_a = build(args, written.pattern, options)
        train(model_a, opt_a, loader_a, args.steps, straight)
        straight_s = time.perf_counter() - t0

        interrupted: list[list[str]] = []
        model_b, opt_b, loader_b = build(args, written.pattern, options)
        train(model_b, opt_b, loader_b, args.stop_at, interrupted)
        checkpoint = io.BytesIO()  # a file or an fsspec URL in a real job
        torch.save(
            {"model": model_b.state_dict(), "optimizer": opt_b.state_dict(), "loader": loader_b.state_dict()},
            checkpoint,
        )
        del model_b, opt_b, loader_b  # the job dies

        checkpoint.seek(0)
        saved = torch.load(checkpoint, weights_only=True)
        model_c, opt_c, loader_c = build(args, written.pattern, options)
        model_c.load_state_dict(saved["model"])
        opt_c.load_state_dict(saved["optimizer"])
        loader_c.load_state_dict(saved["loader"])
        train(model_c, opt_c, loader_c, args.steps - args.stop_at, interrupted)

    x_test, y_test, _ = synthetic_arrays(2000, dim=args.dim, classes=args.classes, seed=args.seed, draw=1)
    with torch.no_grad():
        accuracy = (model_a(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
    same_weights = all(
        torch.equal(a, c) for a, c in zip(model_a.state_dict().values(), model_c.state_dict().values())
    )
    sifter = loader_a.root.sifter
    summary = {
        "shards": len(written.urls),
        "steps": args.steps,
        "checkpoint_after_step": args.stop_at,
        "seen": sifter.stats.seen,
        "kept": sifter.stats.kept,
        "keep_rate": round(sifter.stats.keep_rate, 4),
        "test_accuracy": round(float(accuracy), 4),
        "resumed_run_saw_the_same_samples": straight == interrupted,
        "resumed_run_has_the_same_weights": same_weights,
        "straight_run_seconds": round(straight_s, 2),
    }
    print(json.dumps(summary))
    return 0 if straight == interrupted and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
