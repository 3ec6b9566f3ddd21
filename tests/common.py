"""Helpers the tests share: a scorer that costs nothing, a checkpoint round trip, sample streams."""

from __future__ import annotations

import io

import numpy as np
import torch

# One intra-op thread: the suite also runs DataLoader workers, writer processes and servers on
# the same cores, and OpenMP threads that spin-wait on an oversubscribed machine slow every torch
# call by an order of magnitude. Tests assert behaviour, never speed. Set here, so that it holds
# in the processes tests start too (they import this module).
torch.set_num_threads(1)


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
