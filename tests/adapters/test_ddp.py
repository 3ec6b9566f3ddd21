"""A real 2-process DDP training run (gloo, CPU) over sifted WebDataset shards on the loopback S3
server: bounded in time, equal steps on both ranks, complete audit partitions, exact resume."""

import os
import sys

import pytest
import torch

import siftpipe as sp
from tests.common import run_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_sift.py")


def torchrun(args, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        EXAMPLE,
        *args,
    ]
    return run_json(cmd, timeout)


@pytest.fixture
def s3(own_s3):
    bucket = own_s3.new_bucket()
    opts = ["--storage-option", f"endpoint_url={own_s3.endpoint}"]
    return own_s3, bucket, opts


def test_ddp_over_sifted_s3_shards_takes_equal_steps_and_logs_every_rank(s3):
    server, bucket, opts = s3
    common = [
        "--store",
        f"s3://{bucket}/train",
        "--audit",
        f"s3://{bucket}/audit",
        "--checkpoint",
        f"s3://{bucket}/ckpt",
        "--samples",
        "6000",
        "--shards",
        "8",
        "--worker-batch",
        "200",
        "--batch",
        "64",
        *opts,
    ]
    result = torchrun([*common, "--epochs", "2"])
    ranks = result["ranks"]
    assert result["equal_steps"] and ranks[0]["steps_per_epoch"] == ranks[1]["steps_per_epoch"]
    assert all(r["seen"] == 6000 for r in ranks)  # each rank streamed its half, twice
    report = sp.verify_log(f"s3://{bucket}/audit", server.storage_options)
    assert report.ok, "\n".join(report.lines())
    assert [(s.rank, s.records) for s in report.streams] == [(0, 6000), (1, 6000)]
    assert len({s.run for s in report.streams}) == 1  # one run id, shared from rank 0

    # exact resume on the same world size: 2 epochs + 1 resumed equals 3 straight
    resumed = torchrun([*common, "--epochs", "3", "--resume"])
    straight = torchrun(
        [
            *common,
            "--epochs",
            "3",
            "--store",
            f"s3://{bucket}/train",
            "--audit",
            "",
            "--checkpoint",
            f"s3://{bucket}/ckpt-straight",
        ]
    )
    assert resumed["ranks"][0]["steps_per_epoch"] == straight["ranks"][0]["steps_per_epoch"][2:]
    assert resumed["weights_checksum"] == pytest.approx(straight["weights_checksum"], rel=1e-9)
    fs = server.fs()
    with fs.open(f"{bucket}/ckpt/rank1.pt", "rb") as f:
        state = torch.load(f, weights_only=True)
    assert state["sift"]["audit"]["rank"] == 1 and state["epochs_done"] == 3
