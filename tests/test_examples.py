"""The examples run end to end at a small size, so they never rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, env=None):
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=240,
        env=environment,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SMALL = ["--samples", "3000", "--per-shard", "250", "--worker-batch", "200", "--batch", "100"]


def test_webdataset_s3_example_with_its_own_server():
    out = run_example("webdataset_s3.py", *SMALL, "--epochs", "2")
    assert out["shards"] == 12 and out["seen"] == 6000
    assert 0 < out["kept"] < out["seen"]
    # sifting keeps the hard tail over-represented, and the model still learns the task
    assert out["hard_share_in_kept"] > 1.5 * out["hard_share_in_data"]
    assert out["test_accuracy"] > 0.8


def test_webdataset_s3_example_with_a_given_store(local_s3, bucket):
    out = run_example(
        "webdataset_s3.py",
        *SMALL,
        "--epochs",
        "1",
        "--store",
        f"s3://{bucket}/example/train",
        "--storage-option",
        f"endpoint_url={local_s3.endpoint}",
    )
    assert out["pattern"] == f"s3://{bucket}/example/train-{{000000..000011}}.tar"
    assert local_s3.fs().exists(f"{bucket}/example/train-000011.tar")


def test_torchdata_example_resumes_exactly():
    out = run_example("torchdata_nodes.py", *SMALL, "--steps", "30", "--stop-at", "11")
    assert out["resumed_run_saw_the_same_samples"] is True
    assert out["resumed_run_has_the_same_weights"] is True
    assert 0 < out["kept"] < out["seen"]


def test_the_ddp_example_writes_under_a_temporary_directory_unless_told(tmp_path, monkeypatch):
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("ddp_sift_example", ROOT / "examples" / "ddp_sift.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SIFTPIPE_DDP_DIR", raising=False)
    args = example.parse_args([])
    default = os.path.join(tempfile.gettempdir(), "siftpipe-ddp")
    assert (args.store, args.audit, args.checkpoint) == tuple(
        os.path.join(default, name) for name in ("train", "audit", "ckpt")
    )
    monkeypatch.setenv("SIFTPIPE_DDP_DIR", str(tmp_path / "env"))
    assert example.parse_args([]).store == str(tmp_path / "env" / "train")
    args = example.parse_args(["--dir", str(tmp_path / "run"), "--audit", ""])
    assert args.store == str(tmp_path / "run" / "train") and args.audit == ""
    assert list(tmp_path.iterdir()) == []  # nothing in the current directory


def test_the_examples_outputs_are_ignored_by_git(tmp_path):
    import shutil

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # not a checkout: nothing to ignore
    names = ["siftpipe-ddp/train-000000.tar", "siftpipe-demo/plot.png"]
    done = subprocess.run(
        ["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.stdout.split() == names


def test_the_ddp_example_refuses_shards_it_would_not_write_or_that_are_another_runs(tmp_path):
    # found by review (2026-12-05): --samples 100 --shards 16 wrote 15 shards of 7 and a rank
    # then failed on the 16th; a second run with other --samples read the first run's shards as
    # its own and reported their sample count, silently
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_sift_example", ROOT / "examples" / "ddp_sift.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit):
        example.parse_args(["--samples", "100", "--shards", "16", "--dir", str(tmp_path)])
    (tmp_path / "train.json").write_text(json.dumps({"samples": 4000, "shards": 16, "seed": 0}))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "examples" / "ddp_sift.py"), "--dir", str(tmp_path), "--samples", "8000"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert done.returncode != 0
    assert "holds shards of {'samples': 4000" in done.stderr and "give another --store" in done.stderr
    assert not list(tmp_path.glob("train-*.tar"))  # nothing written over them


@pytest.mark.parametrize(
    "name, resume", [("hf_lm.py", ["--resume"]), ("lightning_lm.py", ["--resume", "last"])]
)
def test_the_lm_examples_refuse_resuming_the_last_checkpoint_without_output(name, resume):
    # found by review (2026-12-05): their docstrings' resume commands had no --output, so each
    # run looked for its last checkpoint in a new temporary directory and failed with a traceback
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *resume],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert done.returncode == 2 and "give --output DIR" in done.stderr and "Traceback" not in done.stderr
    doc = (ROOT / "examples" / name).read_text().split('"""')[1]
    assert all("--output" in line for line in doc.splitlines() if "--resume" in line)
