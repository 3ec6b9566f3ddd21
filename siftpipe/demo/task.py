"""The demo's task: a generated classification set with easy near-duplicates and a hard tail,
its shards, its batches and its model."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def redundant_task(
    n: int,
    *,
    dim: int = 64,
    classes: int = 10,
    head_modes: int = 4,
    tail_modes: int = 20,
    hard_fraction: float = 0.1,
    label_noise: float = 0.0,
    seed: int = 0,
    draw: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x float32 [n, dim], y int64 [n], hard bool [n], noisy bool [n])``: a classification
    task with many easy, redundant samples and a hard tail.

    Each class has ``head_modes`` frequent modes (prototypes on a sphere of radius 3) and
    ``tail_modes`` rare ones. An easy sample is a prototype plus small noise (standard deviation
    0.15 per feature): near-duplicates that a model learns in its first pass and that teach it
    nothing afterwards. A hard sample (a fraction ``hard_fraction``) comes from a rare mode placed
    at distance 1.5 from a frequent mode of *another* class, so the model must carve a small
    region out of that class: it takes many passes, and it is where test accuracy is won or lost.

    ``seed`` fixes the task (modes); ``draw`` picks independent samples of it (0 for training,
    1 for a test set, ...). ``label_noise`` replaces that fraction of labels with a different,
    uniformly drawn class (use it for training sets only); ``noisy`` marks them.
    """
    if n < 0 or dim < 2 or classes < 2 or head_modes < 1 or tail_modes < 1:
        raise ValueError(
            f"need n >= 0, dim >= 2, classes >= 2 and at least one head and tail mode, got n={n}, "
            f"dim={dim}, classes={classes}, head_modes={head_modes}, tail_modes={tail_modes}"
        )
    if not (0.0 <= hard_fraction <= 1.0 and 0.0 <= label_noise <= 1.0):
        raise ValueError(
            f"hard_fraction and label_noise are fractions in [0, 1], got {hard_fraction}, {label_noise}"
        )
    task = np.random.default_rng([seed, 0])
    head = task.normal(size=(classes * head_modes, dim))
    head *= 3.0 / np.linalg.norm(head, axis=1, keepdims=True)
    head_label = np.repeat(np.arange(classes), head_modes)
    tail_label = np.repeat(np.arange(classes), tail_modes)
    # each rare mode sits next to a frequent mode of another class
    shift = task.integers(1, classes, size=tail_label.size)
    near_class = (tail_label + shift) % classes
    near = near_class * head_modes + task.integers(0, head_modes, size=tail_label.size)
    offset = task.normal(size=(tail_label.size, dim))
    offset *= 1.5 / np.linalg.norm(offset, axis=1, keepdims=True)
    tail = head[near] + offset

    rng = np.random.default_rng([seed, 1, draw])
    hard = rng.random(n) < hard_fraction
    x = np.empty((n, dim), dtype=np.float32)
    y = np.empty(n, dtype=np.int64)
    easy_n = int((~hard).sum())
    pick = rng.integers(0, head.shape[0], size=easy_n)
    x[~hard] = head[pick] + rng.normal(scale=0.15, size=(easy_n, dim))
    y[~hard] = head_label[pick]
    hard_n = int(hard.sum())
    pick = rng.integers(0, tail.shape[0], size=hard_n)
    x[hard] = tail[pick] + rng.normal(scale=0.15, size=(hard_n, dim))
    y[hard] = tail_label[pick]
    noisy = np.zeros(n, dtype=bool)
    if label_noise > 0:
        noisy = rng.random(n) < label_noise
        y[noisy] = (y[noisy] + rng.integers(1, classes, size=int(noisy.sum()))) % classes
    return x, y, hard, noisy


def task_samples(x: np.ndarray, y: np.ndarray, hard: np.ndarray | None = None) -> Iterator[dict[str, Any]]:
    """Sample dicts for ``write_shards``: ``__key__`` (``000000000``, ...), ``x.npy``, ``cls`` and
    (if given) ``hard.cls``."""
    for i in range(len(y)):
        sample: dict[str, Any] = {"__key__": f"{i:09d}", "x.npy": x[i], "cls": int(y[i])}
        if hard is not None:
            sample["hard.cls"] = int(hard[i])
        yield sample


def write_task_shards(
    prefix: str,
    x: np.ndarray,
    y: np.ndarray,
    hard: np.ndarray | None = None,
    *,
    samples_per_shard: int = 500,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
    existing: Literal["keep", "refuse", "replace"] = "keep",
) -> Any:
    """Write the task's samples to ``{prefix}-000000.tar``, ...; returns the ``ShardSet``
    (``existing``: ``write_shards``')."""
    from ..streaming.shards import write_shards

    return write_shards(
        task_samples(x, y, hard),
        prefix,
        samples_per_shard=samples_per_shard,
        storage_options=storage_options,
        progress=progress,
        total=len(y),
        existing=existing,
    )


def decode_batch(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Decode and collate raw shard samples in a DataLoader worker: ``x`` (float32 [n, dim]) from
    ``x.npy``, ``y`` (int64) from ``cls``, ``hard`` from ``hard.cls`` when present, and the
    metadata columns of ``batch_meta``."""
    out: dict[str, Any] = {
        **batch_meta(samples),
        "x": torch.from_numpy(_stack_npy([s["x.npy"] for s in samples])),
        "y": torch.tensor([int(s["cls"]) for s in samples], dtype=torch.int64),
    }
    if "hard.cls" in samples[0]:
        out["hard"] = torch.tensor([int(s["hard.cls"]) for s in samples], dtype=torch.int64)
    return out


def batch_meta(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The metadata columns of a worker batch: keys and shard URLs (``__url__``, for the audit log)
    as lists, and every numeric ``__dunder__`` field (a ``PreDecodeFilter``'s marks, counters) as a
    float64 tensor. Any decode-and-collate function of the demo's or the benchmark's starts here."""
    first = samples[0]
    out: dict[str, Any] = {"__key__": [s["__key__"] for s in samples]}
    if "__url__" in first:
        out["__url__"] = [s["__url__"] for s in samples]
    for name, value in first.items():
        if name.startswith("__") and name.endswith("__") and isinstance(value, int | float):
            out[name] = torch.tensor([s[name] for s in samples], dtype=torch.float64)
    return out


def _stack_npy(blobs: Sequence[bytes]) -> np.ndarray:
    """Stack ``.npy`` payloads. Payloads whose header is byte-for-byte the first one's (the usual
    case: same dtype and shape) are read with ``np.frombuffer`` after it, which skips parsing the
    same header thousands of times; any other payload goes through ``np.load``."""
    first = np.load(io.BytesIO(blobs[0]), allow_pickle=False)
    # header length: magic (6) + version (2) + a 2- or 4-byte length + the header itself
    major = blobs[0][6]
    size_bytes = 2 if major == 1 else 4
    header = 8 + size_bytes + int.from_bytes(blobs[0][8 : 8 + size_bytes], "little")
    prefix = blobs[0][:header]
    if first.dtype.hasobject or first.dtype.byteorder == ">" or np.isfortran(first):
        return np.stack([np.load(io.BytesIO(b), allow_pickle=False) for b in blobs])
    out = np.empty((len(blobs), *first.shape), dtype=first.dtype)
    out[0] = first
    for i in range(1, len(blobs)):
        blob = blobs[i]
        if blob[:header] == prefix and len(blob) - header == first.nbytes:
            out[i] = np.frombuffer(blob, dtype=first.dtype, offset=header).reshape(first.shape)
        else:
            out[i] = np.load(io.BytesIO(blob), allow_pickle=False)
    return out


def build_model(
    dim: int = 64, classes: int = 10, width: int = 768, depth: int = 3, seed: int = 0
) -> nn.Module:
    """An MLP: ``depth`` hidden layers of ``width`` ReLU units (weights seeded by ``seed``)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        layers: list[nn.Module] = []
        size = dim
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        layers.append(nn.Linear(size, classes))
        return nn.Sequential(*layers)
    finally:
        torch.random.set_rng_state(generator_state)


def train_reference(
    x: np.ndarray,
    y: np.ndarray,
    *,
    classes: int = 10,
    width: int = 256,
    depth: int = 2,
    epochs: int = 10,
    batch: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
) -> nn.Module:
    """RHO-LOSS's irreducible-loss model: a small MLP trained in memory on held-out samples
    ``(x, y)`` (labels as noisy as the training set's), returned in eval mode."""
    model = build_model(x.shape[1], classes, width, depth, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for index in torch.randperm(len(ys), generator=generator).split(batch):
            loss = F.cross_entropy(model(xs[index]), ys[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.eval()
