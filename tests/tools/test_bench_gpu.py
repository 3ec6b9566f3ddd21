"""tools/bench_gpu.py on CPU: the --quick run's JSON is complete and its counters add up; the host-data
path (pinning skipped on CPU) decides exactly what the device-data path decides; the late feedback
of --deferred-observe still hands back every trained sample's loss."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.common import load_tool

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_gpu.py"
ARMS = ("full", "recipe", "infobatch")
QUICK_SEEN = 4 * 1536  # --quick: 4 epochs of 1,536 samples


bench = load_tool("bench_gpu")


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--device", "cpu"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _check_counters(arms: dict, names) -> None:
    assert set(arms) == set(names)
    for name, r in arms.items():
        assert r["seen"] == QUICK_SEEN, name
        assert 0 < r["trained"] <= r["seen"], name
        assert r["keep_rate"] == pytest.approx(r["trained"] / r["seen"], abs=1e-4), name
        acc = r["final_accuracy"]
        assert isinstance(acc, float) and math.isfinite(acc) and 0.0 <= acc <= 1.0, name
        assert r["seconds"] > 0 and r["seen_per_s"] > 0, name
        assert r["scored"] == 0, name  # no arm ever runs a scoring forward
        curve = r["curve"]
        assert curve[-1]["accuracy"] == pytest.approx(acc, abs=1e-4)
        assert curve[-1]["seen"] == r["seen"] and curve[-1]["trained"] == r["trained"]
        for a, b in itertools.pairwise(curve):
            assert a["seconds"] <= b["seconds"] and a["seen"] <= b["seen"] and a["trained"] <= b["trained"]
        assert "peak_cuda_memory_mb" not in r  # CPU run
        # 1536 samples in batches of 128: one shape for the full arm, and (drop_last) for the sifted
        assert r["batch_sizes_trained"] == 1, name
        if name == "full":
            assert r["trained"] == r["seen"]
            assert "sifter" not in r
        else:
            s = r["sifter"]
            assert s["seen"] == r["seen"]
            # drop_last: each pass's short last batch is not trained (counted, not lost)
            assert s["kept"] == r["trained"] + s["unhanded"]
            assert s["observed"] == r["trained"]  # every trained sample's loss handed back
            # epoch 0: nothing known, everything kept; later epochs decided from the memory
            assert s["unknown"] == 1536
            assert s["from_memory"] == r["seen"] - 1536


def test_quick_report(report):
    _check_counters(report["arms"], ARMS)
    assert report["quick"] is True
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["cpu_threads"] == 1
    assert report["data"]["placement"] == "device" and report["data"]["pinned"] is False
    assert report["data"]["generated_on"] == "cpu"
    assert report["model"]["kind"] == "ResNet" and report["model"]["channels_last"] is True
    assert report["model"]["autocast"] is None  # --amp auto: off on CPU
    assert report["train"]["epochs"] == 4 and report["calibration"] is None
    assert report["train"]["input_batches"] == 8 and report["train"]["drop_last"] is True
    full = report["arms"]["full"]
    target = full["final_accuracy"] - bench.MARGIN
    assert full["to_target"] is not None and full["time_to_target_ratio_to_full"] == 1.0
    for name, r in report["arms"].items():
        assert r["target"] == pytest.approx(target, abs=1e-5)
        assert r["wall_ratio_to_full"] == pytest.approx(r["seconds"] / full["seconds"], rel=1e-3)
        if r["to_target"] is not None:
            assert r["to_target"]["seconds"] <= r["seconds"] + 1e-3, name
            assert r["time_to_target_ratio_to_full"] == pytest.approx(
                r["to_target"]["seconds"] / full["to_target"]["seconds"], rel=1e-2
            )
    # the sifted arms train fewer samples than they see: InfoBatch prunes below-mean ones
    assert report["arms"]["recipe"]["trained"] < QUICK_SEEN


def test_host_data_path_decides_the_same(report, capsys):
    out = bench.main(["--quick", "--device", "cpu", "--host-data", "--arms", "full", "recipe"])
    capsys.readouterr()
    assert out["data"]["placement"] == "host"
    assert out["data"]["pinned"] is False  # pin_memory needs CUDA: skipped on CPU, and said so
    _check_counters(out["arms"], ("full", "recipe"))
    for name in ("full", "recipe"):  # where the data lives changes no decision and no weight
        assert out["arms"][name]["trained"] == report["arms"][name]["trained"]
        assert out["arms"][name]["final_accuracy"] == report["arms"][name]["final_accuracy"]


def test_deferred_observe_hands_back_every_loss(capsys):
    out = bench.main(["--quick", "--device", "cpu", "--arms", "infobatch", "--deferred-observe"])
    capsys.readouterr()
    assert out["train"]["deferred_observe"] is True
    _check_counters(out["arms"], ("infobatch",))


def test_host_feeder_on_cpu_passes_through():
    feed = bench.HostFeeder(torch.device("cpu"), 4, (3,))
    assert feed.pinned is False and feed.buffers == []
    x = torch.arange(12.0).reshape(4, 3)
    assert feed(x) is x


def test_task_is_seeded_and_shaped():
    kw = {"image": 8, "classes": 4, "hard_fraction": 0.5, "device": torch.device("cpu")}
    a = bench.make_task(64, 16, seed=3, chunk=24, **kw)
    b = bench.make_task(64, 16, seed=3, **kw)
    c = bench.make_task(64, 16, seed=4, **kw)
    assert a[0].shape == (64, 3, 8, 8) and a[2].shape == (16, 3, 8, 8)
    assert a[1].dtype == torch.int64 and int(a[1].min()) >= 0 and int(a[1].max()) < 4
    assert not torch.equal(a[0], c[0])
    # chunking draws in another order, so only the same chunking repeats exactly
    assert torch.equal(bench.make_task(64, 16, seed=3, chunk=24, **kw)[0], a[0])
    assert torch.equal(bench.make_task(64, 16, seed=3, **kw)[0], b[0])


def test_time_to_target_interpolates():
    points = [
        {"seconds": 1.0, "seen": 10, "trained": 10, "accuracy": 0.5},
        {"seconds": 3.0, "seen": 30, "trained": 20, "accuracy": 0.9},
    ]
    hit = bench.time_to_target(points, 0.7)
    assert hit == {"seconds": 2.0, "seen": 20.0, "trained": 15.0}
    assert bench.time_to_target(points, 0.95) is None
    assert bench.time_to_target(points, 0.25) == {"seconds": 0.5, "seen": 5.0, "trained": 5.0}


def test_model_is_a_resnet_in_channels_last():
    args = bench.parse(["--quick"])
    model = bench.build_model(args, torch.device("cpu"), seed=0)
    assert sum(isinstance(m, bench.Block) for m in model.modules()) == 3 * args.blocks
    out = model(torch.zeros(2, 3, args.image, args.image).contiguous(memory_format=torch.channels_last))
    assert out.shape == (2, args.classes)
    assert model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_input_batches_must_be_a_whole_number_of_batches(capsys):
    with pytest.raises(SystemExit):
        bench.parse(["--input-batches", "0"])
    assert "--input-batches is a whole number" in capsys.readouterr().err


def test_every_arm_follows_the_same_learning_rate_schedule_while_all_is_kept(monkeypatch, capsys):
    # found by review (2026-12-05): the sifted arms placed each step by the stage's count of
    # samples seen, which runs ahead of the rows handed on by up to one input batch (8 training
    # batches): they skipped the warm-up's first steps and trained their last ones at a learning
    # rate near 0, where the full arm counted per step
    progress: dict[str, list[float]] = {}
    arm = ["?"]
    real = bench.lr_at

    def recording(p, peak):
        progress.setdefault(arm[0], []).append(p)
        return real(p, peak)

    real_run = bench.run_arm

    def run(name, *a, **kw):
        arm[0] = name
        return real_run(name, *a, **kw)

    monkeypatch.setattr(bench, "lr_at", recording)
    monkeypatch.setattr(bench, "run_arm", run)
    bench.main(["--quick", "--device", "cpu", "--arms", "full", "recipe", "infobatch"])
    capsys.readouterr()
    epoch0 = 1536 // 128  # the first epoch: nothing known yet, every sample kept, by every arm
    full = progress["full"][:epoch0]
    for name in ("recipe", "infobatch"):
        assert progress[name][:epoch0] == pytest.approx(full), name
        assert progress[name][0] == pytest.approx(128 / QUICK_SEEN)
        # the schedule never goes back (a batch keeping another share moves the scale)
        assert all(a <= b for a, b in itertools.pairwise(progress[name])), name
