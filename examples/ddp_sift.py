"""DistributedDataParallel training over sifted WebDataset shards, on every rank.

    torchrun --nproc_per_node=2 examples/ddp_sift.py                  # CPU + gloo, local shards
    torchrun --nproc_per_node=8 examples/ddp_sift.py --store s3://bucket/sift-ddp/train \\
        --audit s3://bucket/sift-ddp/audit                            # GPUs + nccl, unchanged

Each rank streams its own shards (split by node, then by DataLoader worker), decodes and batches
in its workers, and sifts in its training process with the live model. ``EqualSteps`` keeps the
ranks in step: every rank takes the same number of optimizer steps per epoch although each keeps
a different number of samples (a naive loop deadlocks in DDP's next all-reduce). With
``--sync-every N`` the ranks share their loss histories every N steps, so percentiles are global.
Every rank writes its own audit partition (``rank=<r>``) and its own checkpoint.

Rank 0 writes a synthetic dataset to ``--store`` first if it is not there. At the end rank 0
prints one JSON line: steps per rank (equal), samples seen and kept per rank, test accuracy.
Shards, audit log and checkpoints go under ``--dir`` (default: ``siftpipe-ddp`` in the system's
temporary directory, or ``$SIFTPIPE_DDP_DIR``), never into the current directory, unless
``--store``/``--audit``/``--checkpoint`` say otherwise.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import tempfile
import time

import fsspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.cli import parse_storage_options
from siftpipe.shards import synthetic_arrays, synthetic_classification, write_shards
from siftpipe.webdataset import WebDataset, WebLoader


def to_xy(sample: dict) -> dict:
    return {
        "__key__": sample["__key__"],
        "__url__": sample["__url__"],
        "x": torch.from_numpy(sample["x.npy"]).float(),
        "y": int(sample["cls"]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--store``, ``--audit`` and ``--checkpoint`` default to ``--dir``."""
    default_dir = os.environ.get("SIFTPIPE_DDP_DIR") or os.path.join(tempfile.gettempdir(), "siftpipe-ddp")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=default_dir, help=f"where the outputs go by default ({default_dir})")
    ap.add_argument("--store", help="shard prefix, a path or fsspec URL (default: DIR/train)")
    ap.add_argument("--audit", help="audit log root, '' for none (default: DIR/audit)")
    ap.add_argument("--checkpoint", help="where each rank saves its state (default: DIR/ckpt)")
    ap.add_argument("--storage-option", action="append", metavar="KEY=VALUE")
    ap.add_argument("--samples", type=int, default=16_000, help="training samples to generate")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="kept samples per optimizer step")
    ap.add_argument(
        "--worker-batch", type=int, default=256, help="samples per worker batch (one scoring pass)"
    )
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--sync-every", type=int, default=20, help="steps between loss-history syncs (0: local)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint to --epochs in all")
    args = ap.parse_args(argv)
    for name in ("samples", "shards", "epochs", "batch", "worker_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    per_shard = -(-args.samples // args.shards)
    if -(-args.samples // per_shard) != args.shards:
        # (100 samples over 16 shards of 7 fill 15: rank 1 then asked for a 16th that was never written)
        ap.error(
            f"--samples {args.samples} in shards of {per_shard} fill {-(-args.samples // per_shard)} "
            f"shards, not --shards {args.shards}: give at least as many samples as shards, e.g. a "
            "multiple of --shards"
        )
    for name in ("store", "audit", "checkpoint"):
        if getattr(args, name) is None:
            setattr(
                args, name, os.path.join(args.dir, {"store": "train", "audit": "audit"}.get(name, "ckpt"))
            )
    return args


def main() -> None:
    # a rank that dies in C++ (SIGABRT from a collective library's thread) prints every thread's
    # Python stack first: the trace torchrun's report lacks
    faulthandler.enable(all_threads=True)
    args = parse_args()
    options = parse_storage_options(args.storage_option)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)

    per_shard = -(-args.samples // args.shards)
    urls = [f"{args.store}-{i:06d}.tar" for i in range(args.shards)]
    problem = [None]
    if rank == 0:
        # what was written, beside the shards: a later run with other --samples or --shards must
        # not read the earlier shards as its own (it reported the old sample count, silently)
        wanted = {"samples": args.samples, "shards": args.shards, "seed": 0}
        fs, manifest = fsspec.core.url_to_fs(f"{args.store}.json", **options)
        have = json.loads(fs.cat_file(manifest)) if fs.exists(manifest) else None
        if have is not None and have != wanted:
            problem[0] = (
                f"{args.store} holds shards of {have}, not {wanted}: give another --store (or --dir), "
                "or delete them"
            )
        elif have is None:
            write_shards(
                synthetic_classification(args.samples, seed=0),
                args.store,
                samples_per_shard=per_shard,
                storage_options=options,
                progress=False,
            )
            fs.pipe_file(manifest, json.dumps(wanted).encode())
    dist.broadcast_object_list(problem, src=0)  # every rank stops together, none waits forever
    if problem[0] is not None:
        dist.destroy_process_group()
        raise SystemExit(f"ddp_sift: {problem[0]}")

    dataset = (
        WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node, storage_options=options)
        .decode()
        .map(to_xy)
        .batched(args.worker_batch, collation_fn=default_collate)
    )
    loader = WebLoader(dataset, batch_size=None, num_workers=args.workers)

    torch.manual_seed(0)  # the same initial weights on every rank
    x_test, y_test, _ = synthetic_arrays(4000, seed=0, draw=1)  # the same task, unseen samples
    dim, classes = x_test.shape[1], int(y_test.max()) + 1
    net = torch.nn.Sequential(
        torch.nn.Linear(dim, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, classes),
    ).to(device)
    model = DDP(net, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)

    audit = (
        sp.AuditLog(args.audit, storage_options=options) if args.audit else None
    )  # run id shared from rank 0
    sifter = sp.Sifter(
        net,  # the live module DDP wraps: scoring must not trigger DDP's gradient hooks
        sp.CrossEntropy("x", "y"),
        sp.RelativeProbabilistic(beta=args.beta, history=2048),
        batched=True,
        micro_batch=None,
        output_batch=args.batch,
        delay=1024,
        audit=audit,
    )
    steps = sp.EqualSteps(loader.sift(sifter), sifter=sifter, sync_every=args.sync_every or None)

    first_epoch = 0
    if args.resume:  # each rank restores its own model, optimizer and sift state
        with fsspec.open(f"{args.checkpoint}/rank{rank}.pt", "rb", **options) as f:
            state = torch.load(f, weights_only=True)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sifter.load_state_dict(state["sift"])
        first_epoch = int(state["epochs_done"])

    started = time.perf_counter()
    steps_per_epoch = []
    for _epoch in range(first_epoch, args.epochs):
        model.train()
        for batch in steps:
            x, y = batch["x"].to(device, non_blocking=True), batch["y"].to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP's all-reduce: every rank must get here the same number of times
            optimizer.step()
            sifter.model_version += 1
        steps_per_epoch.append(steps.steps)

    if args.checkpoint:
        # per-rank state next to the model's: resume on the same world size with load_state_dict
        state = {
            "model": net.state_dict(),
            "optimizer": optimizer.state_dict(),
            "sift": sifter.state_dict(),
            "epochs_done": args.epochs,
        }
        with fsspec.open(f"{args.checkpoint}/rank{rank}.pt", "wb", auto_mkdir=True, **options) as f:
            torch.save(state, f)
    sifter.close()

    with torch.no_grad():
        net.eval()
        accuracy = net(torch.from_numpy(x_test).float().to(device)).argmax(1).cpu() == torch.from_numpy(
            y_test
        )
    summary = {
        "rank": rank,
        "steps_per_epoch": steps_per_epoch,
        "seen": sifter.stats.seen,
        "kept": sifter.stats.kept,
        "discarded_at_epoch_end": steps.discarded,
        "audit_records": None if audit is None else audit.stats.records,
    }
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, summary)
    if rank == 0:
        print(
            json.dumps(
                {
                    "world": world,
                    "backend": dist.get_backend(),
                    "ranks": gathered,
                    "equal_steps": len({tuple(g["steps_per_epoch"]) for g in gathered}) == 1,
                    "test_accuracy": round(float(accuracy.float().mean()), 4),
                    "weights_checksum": float(sum(p.detach().double().sum() for p in net.parameters())),
                    "seconds": round(time.perf_counter() - started, 1),
                    "audit": args.audit or None,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # DDP holds the gloo process group past destroy_process_group: end without the interpreter's
    # teardown, where its threads could abort the finished job (see sp.exit_process)
    sp.exit_process(0)
