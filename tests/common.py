"""Helpers the tests share: a scorer that costs nothing, a checkpoint round trip, sample streams."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess

import numpy as np
import torch

# One intra-op thread: the suite also runs DataLoader workers, writer processes and servers on
# the same cores, and OpenMP threads that spin-wait on an oversubscribed machine slow every torch
# call by an order of magnitude. Tests assert behaviour, never speed. Set here, so that it holds
# in the processes tests start too (they import this module).
torch.set_num_threads(1)

#: The repository's root: what a script a test starts puts on ``sys.path`` to import ``tests.common``.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loss_field(model, batch):
    """A scorer that costs nothing: each sample carries its own loss in field 'loss'."""
    return batch["loss"].double()


def roundtrip(state):
    """What a checkpoint does to a state dict: torch.save, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def make_samples(n: int, seed: int = 0, dim: int = 4):
    """Dict samples with a key, a feature vector, a label and a precomputed loss."""
    rng = np.random.default_rng(seed)
    losses = rng.exponential(size=n)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    return [
        {
            "__key__": f"s{i:06d}",
            "__url__": f"shard-{i // 100:03d}.tar",
            "x": torch.from_numpy(x[i]),
            "y": int(i % 3),
            "loss": float(losses[i]),
        }
        for i in range(n)
    ]


def same_state(a, b, path="state"):
    """Two state dicts hold the same values (tensors compared exactly; timings ignored)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            if k not in ("seconds", "account", "run_began"):  # wall time
                same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def run_json(cmd: list[str], timeout: float = 240) -> dict:
    """Run ``cmd`` from the repository's root in its own process group (a hang is ended with every
    process it started: ranks, workers, torchrun) with one torch thread; fail with its stderr
    unless it exits 0; its last stdout line, read as JSON."""
    import pytest

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{cmd} hung for {timeout} s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


def load_tool(name: str):
    """The module ``tools/<name>.py`` (tools are scripts, not a package), registered in
    ``sys.modules`` under ``name`` so that its dataclasses pickle."""
    import importlib.util
    import sys

    tools = os.path.join(REPO, "tools")
    if tools not in sys.path:  # as when run as a script: its helpers (_out, _s3server) import
        sys.path.append(tools)
    spec = importlib.util.spec_from_file_location(name, os.path.join(tools, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def race(*work) -> list[BaseException]:
    """Run each of ``work`` (callables) in its own thread at once, at a switch interval of 1 µs
    (a thread switch inside nearly any update: races show); the exceptions they raised."""
    import sys
    import threading

    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(fn,)) for fn in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    return errors


def thread_stack(thread) -> list[str]:
    """The names of the functions ``thread`` is in now, innermost first."""
    import sys

    frame, names = sys._current_frames().get(thread.ident), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def wait_until_waiting_inside(thread, name: str) -> None:
    """Return once ``thread`` blocks (an event's or a lock's wait, a join, a poll) inside the
    function ``name``: a signal sent then meets that wait, whatever the machine's load."""
    import time

    waits = ("wait", "poll", "_wait_for_tstate_lock", "_shutdown")
    while not (name in (names := thread_stack(thread)) and names[0] in waits):
        time.sleep(0.01)
