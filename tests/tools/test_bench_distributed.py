"""tools/bench_distributed.py runs on real gloo processes and reports every figure it promises."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_distributed_reports_the_collectives_and_the_memory_sync():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_distributed.py"), "--worlds", "2", "--calls", "20",
         "--memory-samples", "3000"],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    for name in ("equal_steps_us_per_step", "sync_history_us_per_call", "sync_memory_ms_per_epoch"):
        assert result[f"world2_{name}"] > 0, name
    assert result["sync_memory_samples"] == 3000 and result["audit_bytes_per_record"] > 0
