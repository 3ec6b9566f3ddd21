"""``siftpipe demo``: train the same model with and without sifting, streaming WebDataset shards.

The demo writes a generated classification set to WebDataset tar shards (a local directory, or
any fsspec URL such as ``s3://...``), then trains the same MLP twice for the same number of
samples seen (``--epochs`` passes over the shards; ``--budget-seconds`` switches to a wall-time
budget): once on everything, once through a ``Sifter`` in batched mode. Both runs stream the shards
through ``siftpipe.webdataset``: DataLoader workers read the tar files, decode and batch; the
sifter runs in the training process and scores each worker batch with the live model. It prints a
table and a closing line computed from the measured numbers, writes the sifted run's audit log
and a PNG of test accuracy against wall time.

The dataset (``redundant_task``) is built to behave like real training data in the way that
matters here: most samples are near-duplicates of a few prototypes per class (learned in the first
epoch and redundant after that), and a hard tail of rare modes sits next to another class's
prototypes, so learning it takes many passes. Test accuracy is measured on fresh samples of the
same distribution (the same mix of easy and hard).

The building blocks (``redundant_task``, ``write_task_shards``, ``build_model``, ``Arm`` and
``train_run``) are public so that ``tools/bench_train.py`` runs the same code with more arms.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Arm",
    "Point",
    "RunResult",
    "add_cli",
    "build_model",
    "decode_batch",
    "redundant_task",
    "run_demo",
    "task_samples",
    "time_to_target",
    "train_run",
    "write_task_shards",
]


# ---------------------------------------------------------------------------------- the task


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
) -> Any:
    """Write the task's samples to ``{prefix}-000000.tar``, ...; returns the ``ShardSet``."""
    from .shards import write_shards

    return write_shards(
        task_samples(x, y, hard),
        prefix,
        samples_per_shard=samples_per_shard,
        storage_options=storage_options,
        progress=progress,
        total=len(y),
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


# ---------------------------------------------------------------------------------- one run


def train_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``train_run`` keywords that ``siftpipe demo`` and ``tools/bench_train.py`` take from their
    command lines under the same names: model width, peak learning rate, rows per training step,
    rows per worker batch, DataLoader workers."""
    return {name: getattr(args, name) for name in ("width", "lr", "batch", "worker_batch", "workers")}


@dataclass(frozen=True)
class Arm:
    """How one training run selects its samples.

    Attributes:
        name: Label in tables and plots.
        policy: Makes the keep rule (``None``: train on every sample, no sift stage).
        scoring: ``"model"`` scores with the live model; ``"free"`` uses no scores at all (for
            ``Uniform``, which ignores them: random dropping costs nothing); ``"proxy"`` scores
            with a small MLP trained online on every worker batch; ``"reducible"`` scores the live
            model's loss minus a reference model's (RHO-LOSS; ``train_run(reference=...)``).
        memory_age: Give the sifter a ``ScoreMemory(max_age=memory_age)`` (``None``: no memory).
        observe: Hand the training step's per-sample losses back (``sifter.observe``).
        remember_forward: Remember scoring-forward losses too (``Sifter(remember_forward=...)``).
        predecode: Drop samples in the DataLoader workers before decode (``PreDecodeFilter``),
            from the memory the training process publishes after every epoch.
        delay: Samples kept unconditionally at the start (the sifter's warm-up).
        train: ``False`` reads, decodes and batches the shards without training (to measure
            what the data path alone costs).
    """

    name: str
    policy: Callable[[], Any] | None = None
    scoring: str = "model"
    memory_age: int | None = None
    observe: bool = False
    remember_forward: bool = True
    predecode: bool = False
    delay: int = 1024
    train: bool = True


@dataclass
class Point:
    """One evaluation during a run.

    Attributes:
        seen: Samples the run had read from the shards (kept or dropped, before-decode drops too).
        forward: Samples through a forward pass so far (scoring and training).
        backward: Samples through a backward pass so far (trained).
        seconds: Wall time of the run so far, evaluations excluded.
        accuracy: Test accuracy, a fraction.
    """

    seen: int
    forward: int
    backward: int
    seconds: float
    accuracy: float


@dataclass
class RunResult:
    """What one training run did (counts in samples, times in seconds).

    ``cpu_seconds`` is the training process's CPU time (DataLoader workers not included; the
    evaluations subtracted as wall time, which they are on one thread). ``c_score`` and
    ``c_train`` are the measured seconds per sample of a scoring forward (from
    ``sifter.stats.score_seconds / scored``, memory lookups included) and of a training step
    (forward, backward and optimizer step, per sample of a step); ``nan`` where not measured.
    """

    name: str
    points: list[Point]
    seen: int
    scored: int
    trained: int
    from_memory: int
    predecode_dropped: int
    seconds: float
    accuracy: float
    train_seconds: float
    score_seconds: float
    epochs: float
    cpu_seconds: float = math.nan
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def keep_rate(self) -> float:
        """Samples trained / samples seen."""
        return self.trained / self.seen if self.seen else 1.0

    @property
    def forward(self) -> int:
        """Samples through a forward pass: scoring forwards plus training forwards."""
        return self.scored + self.trained

    @property
    def c_train(self) -> float:
        return self.train_seconds / self.trained if self.trained else math.nan

    @property
    def c_score(self) -> float:
        return self.score_seconds / self.scored if self.scored else math.nan

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able numbers (rounded), the curve as lists."""
        return {
            "name": self.name,
            "seen": self.seen,
            "scored": self.scored,
            "trained": self.trained,
            "forward": self.forward,
            "backward": self.trained,
            "from_memory": self.from_memory,
            "predecode_dropped": self.predecode_dropped,
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "accuracy": round(self.accuracy, 5),
            "keep_rate": round(self.keep_rate, 4),
            "epochs": round(self.epochs, 3),
            "c_train_us": None if math.isnan(self.c_train) else round(self.c_train * 1e6, 2),
            "c_score_us": None if math.isnan(self.c_score) else round(self.c_score * 1e6, 2),
            "curve": {
                "seen": [p.seen for p in self.points],
                "backward": [p.backward for p in self.points],
                "forward": [p.forward for p in self.points],
                "seconds": [round(p.seconds, 3) for p in self.points],
                "accuracy": [round(p.accuracy, 5) for p in self.points],
            },
            **({"stats": self.stats} if self.stats else {}),
        }


def time_to_target(points: Sequence[Point], target: float) -> dict[str, float] | None:
    """When a run's test accuracy first reached ``target``: ``seconds``, ``backward``, ``forward``
    and ``seen``, interpolated linearly between the last evaluation below the target and the first
    at or above it (the clock starts at 0 with nothing trained); ``None`` if it never did."""
    before = Point(0, 0, 0, 0.0, 0.0)
    for point in points:
        if point.accuracy >= target:
            gap = point.accuracy - before.accuracy
            f = (target - before.accuracy) / gap if gap > 0 else 1.0
            f = min(max(f, 0.0), 1.0)

            return {
                name: getattr(before, name) + f * (getattr(point, name) - getattr(before, name))
                for name in ("seconds", "backward", "forward", "seen")
            }
        before = point
    return None


class _Counted:
    """A worker-side stage around ``stage`` (a ``PreDecodeFilter``): each sample it hands on
    carries ``__read__``, the raw samples this worker had read by then (dropped ones included)."""

    def __init__(self, stage: Callable[[Iterable[Any]], Iterator[Any]]) -> None:
        self.stage = stage

    def __call__(self, source: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        from torch.utils.data import get_worker_info

        read = 0

        def counting() -> Iterator[dict[str, Any]]:
            nonlocal read
            for sample in source:
                read += 1
                yield sample

        info = get_worker_info()
        worker = info.id if info is not None else 0
        for sample in self.stage(counting()):
            yield {**sample, "__read__": read, "__worker__": worker}


def _free_scorer(model: nn.Module | None, batch: Any) -> torch.Tensor:
    """No forward pass: zeros (for rules that ignore the losses, such as ``Uniform``)."""
    return torch.zeros(len(batch["y"]), dtype=torch.float64)


def _lr_at(progress: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up over the first ``warmup`` of the budget, then cosine decay to 0."""
    progress = min(max(progress, 0.0), 1.0)
    return peak * min(1.0, progress / warmup if warmup else 1.0) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_run(
    arm: Arm,
    shards: str | Sequence[str],
    samples_per_epoch: int,
    test: tuple[torch.Tensor, torch.Tensor],
    *,
    epochs: int = 8,
    budget_seconds: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
    dim: int = 64,
    classes: int = 10,
    width: int = 768,
    depth: int = 3,
    lr: float = 6e-3,
    batch: int = 128,
    worker_batch: int = 256,
    workers: int = 2,
    seed: int = 0,
    evals: int = 24,
    audit: Any = None,
    scratch: str | None = None,
    progress: Callable[[int], None] | None = None,
    decode: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]] = decode_batch,
    loader_stage: Callable[[Iterable[Any]], Iterator[Any]] | None = None,
    flags: Mapping[str, np.ndarray] | None = None,
    reference: nn.Module | None = None,
) -> RunResult:
    """Train a fresh ``build_model(...)`` on the shards, selecting samples as ``arm`` says.

    Workers (``workers`` DataLoader processes, persistent) read the shards, decode and collate
    worker batches of ``worker_batch`` rows; a run without a policy trains on each in steps of
    ``batch`` rows, a sifted run hands them to a ``Sifter(batched=True, micro_batch=None,
    output_batch=batch)`` in this process (one scoring forward per worker batch). Optimizer: AdamW
    (weight decay 0.01), peak learning rate ``lr``, warmed up over 5% of the budget then
    cosine-decayed to 0, scheduled by samples *seen* so every arm follows the same schedule per
    epoch. The test set ``(x, y)`` is evaluated ``evals`` times, evenly over the budget; the clock
    (``seconds``) stops during evaluations and runs for everything else (worker start-up, reading,
    scoring, training, publishing the memory).

    Args:
        arm: What to sift with (see ``Arm``).
        shards: Shard URLs or a brace pattern.
        samples_per_epoch: Samples in the shards (one epoch).
        test: Test inputs and labels (tensors).
        epochs: Passes over the shards (the budget, unless ``budget_seconds``).
        budget_seconds: Train for this many seconds (evaluations excluded) instead of ``epochs``
            passes, passing over the shards as often as that takes; the learning-rate schedule then
            follows the time spent.
        storage_options: fsspec options for the shards.
        dim, classes, width, depth: The model (see ``build_model``).
        lr: Peak learning rate.
        batch: Rows per training step.
        worker_batch: Rows per worker batch (one scoring forward).
        workers: DataLoader worker processes.
        seed: Seeds the model, the shard order and the sifter.
        evals: Evaluations over the budget.
        audit: ``Sifter(audit=...)`` for the sifted run (a URL or an ``AuditLog``).
        scratch: A directory for the published memory of a ``predecode`` arm.
        progress: Called with the number of samples read since its last call.
        decode: The worker's decode-and-collate function (raw samples -> batch dict).
        loader_stage: A stage run in this process on the worker batches before the sifter (to
            count or time them, say).
        flags: Boolean arrays indexed by sample number (the key ``000000123`` is sample 123),
            e.g. ``{"hard": hard, "noisy": noisy}``: the result's ``stats`` counts how many
            trained samples had each flag (``trained_hard``, ...).
        reference: The irreducible-loss model of a ``"reducible"`` arm (trained beforehand on
            held-out data; ``train_reference``).
    """
    import siftpipe as sp

    from .webdataset import WebDataset, WebLoader

    if arm.predecode and scratch is None:
        raise ValueError("a predecode arm publishes its memory: give train_run a scratch directory")
    torch.manual_seed(seed)
    model = build_model(dim, classes, width, depth, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    total = samples_per_epoch * epochs

    proxy_model: nn.Module | None = None
    proxy_optimizer: torch.optim.Optimizer | None = None
    sifter: sp.Sifter | None = None
    published = None if scratch is None else os.path.join(scratch, "published")
    if published is not None and arm.predecode:
        os.makedirs(published, exist_ok=True)
    if arm.policy is not None:
        if arm.scoring == "model":
            scorer: Any = sp.CrossEntropy("x", "y")
        elif arm.scoring == "free":
            scorer = _free_scorer
        elif arm.scoring == "proxy":
            proxy_model = build_model(dim, classes, max(32, width // 6), 2, seed + 1)
            proxy_optimizer = torch.optim.AdamW(proxy_model.parameters(), lr=lr)
            scorer = sp.Proxy(sp.CrossEntropy("x", "y"), model=proxy_model)
        elif arm.scoring == "reducible":
            if reference is None:
                raise ValueError("a 'reducible' arm needs train_run(reference=<irreducible-loss model>)")
            scorer = sp.ReducibleLoss(reference, sp.CrossEntropy("x", "y"))
        else:
            raise ValueError(f"scoring must be 'model', 'free', 'proxy' or 'reducible', got {arm.scoring!r}")
        memory = None
        if arm.memory_age is not None:
            memory = sp.ScoreMemory(capacity=max(16, 2 * samples_per_epoch), max_age=arm.memory_age)
        sifter = sp.Sifter(
            model if arm.scoring in ("model", "reducible") else None,
            scorer,
            arm.policy(),
            batched=True,
            micro_batch=None,
            output_batch=batch,
            delay=arm.delay,
            seed=seed,
            memory=memory,
            remember_forward=arm.remember_forward,
            audit=audit,
        )

    dataset: Any = WebDataset(
        shards,
        shardshuffle=1000,
        seed=seed,
        storage_options=storage_options,
        empty_check=False,
    )
    if arm.predecode:
        assert published is not None
        dataset = dataset.compose(_Counted(sp.PreDecodeFilter(published)))
    dataset = dataset.batched(worker_batch, collation_fn=decode, partial=True)
    loader: Any = WebLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    if loader_stage is not None:
        loader = loader.compose(loader_stage)
    if proxy_model is not None:
        loader = loader.compose(
            _proxy_trainer(proxy_model, proxy_optimizer, lambda: optimizer.param_groups[0]["lr"])
        )
    if sifter is not None:
        loader = loader.sift(sifter)

    x_test, y_test = test
    points: list[Point] = []
    state = {"seen": 0, "trained": 0, "scored": 0}
    train_seconds = 0.0
    flag_counts = dict.fromkeys(flags or (), 0)
    paused = 0.0
    next_eval = 1
    _warm_up(model, dim, batch, worker_batch)
    start = time.perf_counter()
    cpu_start = time.process_time()

    def elapsed() -> float:
        return time.perf_counter() - start - paused

    def budget_progress(seen: int) -> float:
        if budget_seconds is not None:
            return elapsed() / budget_seconds
        return seen / total if total else 1.0

    def evaluate(seen: int) -> None:
        nonlocal paused
        t0 = time.perf_counter()
        seconds = t0 - start - paused
        was = model.training
        model.eval()
        with torch.inference_mode():
            accuracy = (model(x_test).argmax(1) == y_test).double().mean().item()
        model.train(was)
        scored = sifter.stats.scored if sifter is not None and arm.scoring != "free" else 0
        points.append(Point(seen, scored + state["trained"], state["trained"], seconds, accuracy))
        paused += time.perf_counter() - t0

    model.train()
    epoch = 0
    done = False
    read_before = 0  # samples read in finished epochs
    while not done:
        if sifter is not None:
            sifter.set_epoch(epoch)
        seen_at_start = sifter.stats.seen if sifter is not None else state["seen"]
        last_reported = state["seen"]
        read_by_worker: dict[int, int] = {}
        rows_in_epoch = 0
        for step_batch in _steps(loader, sifter is None, batch):
            # samples read from the shards so far (before-decode drops included)
            if arm.predecode:
                reads = step_batch["__read__"]
                workers_ = step_batch["__worker__"]
                for w in torch.unique(workers_).tolist():
                    read_by_worker[int(w)] = max(
                        read_by_worker.get(int(w), 0), int(reads[workers_ == w].max())
                    )
                in_epoch = sum(read_by_worker.values())
            elif sifter is not None:
                in_epoch = sifter.stats.seen - seen_at_start
            else:
                rows_in_epoch += len(step_batch["y"])
                in_epoch = rows_in_epoch
            seen = read_before + min(in_epoch, samples_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(budget_progress(seen), lr)
            if arm.train:
                t0 = time.perf_counter()
                logits = model(step_batch["x"])
                losses = F.cross_entropy(logits, step_batch["y"], reduction="none")
                weight = step_batch.get("__sift_weight__")
                loss = (losses * weight).mean() if weight is not None else losses.mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                train_seconds += time.perf_counter() - t0
                if sifter is not None and arm.observe:
                    sifter.observe(step_batch["__key__"], losses.detach())
                state["trained"] += len(step_batch["y"])
            if flags and arm.train:
                index = np.fromiter((int(k) for k in step_batch["__key__"]), dtype=np.int64)
                for flag, values in flags.items():
                    flag_counts[flag] += int(values[index].sum())
            state["seen"] = seen
            if progress is not None and seen > last_reported:
                progress(seen - last_reported)
                last_reported = seen
            while next_eval < evals and budget_progress(seen) >= next_eval / evals:
                evaluate(seen)
                next_eval += 1
            if budget_seconds is not None and elapsed() >= budget_seconds:
                done = True
                break
        if not done:
            read_before += samples_per_epoch
            if progress is not None and read_before > last_reported:
                progress(read_before - last_reported)
            state["seen"] = read_before
            epoch += 1
            if sifter is not None and arm.predecode:
                assert published is not None
                sifter.publish_memory(published)
            if budget_seconds is None and epoch >= epochs:
                done = True
    seconds = elapsed()
    cpu_seconds = time.process_time() - cpu_start - paused
    evaluate(state["seen"])  # the final model
    final = points[-1].accuracy
    # end the workers now, not whenever the garbage collector gets to the loader
    _shutdown(loader)
    if sifter is not None:
        sifter.close()
    stats = sifter.stats if sifter is not None else None
    predecode_dropped = 0
    if arm.predecode and stats is not None:
        predecode_dropped = state["seen"] - stats.seen
    return RunResult(
        name=arm.name,
        points=points,
        seen=state["seen"],
        scored=stats.scored if stats is not None and arm.scoring != "free" else 0,  # no forward
        trained=state["trained"],
        from_memory=stats.from_memory if stats is not None else 0,
        predecode_dropped=max(0, predecode_dropped),
        seconds=seconds,
        accuracy=final,
        train_seconds=train_seconds,
        score_seconds=stats.score_seconds if stats is not None and arm.scoring != "free" else 0.0,
        epochs=state["seen"] / samples_per_epoch if samples_per_epoch else 0.0,
        cpu_seconds=cpu_seconds,
        stats={
            **(
                {}
                if stats is None
                else {"seen_by_sifter": stats.seen, "kept": stats.kept, "observed": stats.observed}
            ),
            **{f"trained_{flag}": count for flag, count in flag_counts.items()},
        },
    )


def _warm_up(model: nn.Module, dim: int, batch: int, worker_batch: int) -> None:
    """One untimed training step and scoring forward on a copy of ``model``, so that the clock
    of the first run in a process does not include torch's one-time set-up (kernel selection,
    allocator growth)."""
    import copy

    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=0.0)
    x = torch.zeros(batch, dim)
    F.cross_entropy(twin(x), torch.zeros(batch, dtype=torch.int64)).backward()
    optimizer.step()
    with torch.inference_mode():
        twin(torch.zeros(worker_batch, dim))


def _shutdown(loader: Any) -> None:
    """Stop a (persistent-worker) DataLoader's workers inside a webdataset ``WebLoader``."""
    from torch.utils.data import DataLoader

    for stage in getattr(loader, "pipeline", [loader]):
        iterator = getattr(stage, "_iterator", None) if isinstance(stage, DataLoader) else None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            stage._iterator = None


def _steps(loader: Iterable[dict[str, Any]], split: bool, batch: int) -> Iterator[dict[str, Any]]:
    """Training batches: the loader's (sifted: already ``batch`` rows), or worker batches cut into
    steps of ``batch`` rows."""
    if not split:
        yield from loader
        return
    for big in loader:
        rows = len(big["y"])
        for lo in range(0, rows, batch):
            yield {k: (v[lo : lo + batch]) for k, v in big.items()}


def _proxy_trainer(
    proxy: nn.Module, optimizer: torch.optim.Optimizer | None, current_lr: Callable[[], float]
) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A training-process stage: hands each worker batch on (the sifter scores it with the proxy),
    then trains the proxy on it, at the main model's current learning rate."""
    assert optimizer is not None

    def stage(source: Iterable[Any]) -> Iterator[Any]:
        for item in source:
            yield item
            for group in optimizer.param_groups:
                group["lr"] = current_lr()
            proxy.train()
            loss = F.cross_entropy(proxy(item["x"]), item["y"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            proxy.eval()

    return stage


# ---------------------------------------------------------------------------------- the demo


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _table(results: Sequence[RunResult]) -> str:
    head = (
        "run",
        "samples seen",
        "samples trained",
        "forward passes",
        "backward passes",
        "wall time",
        "test accuracy",
        "keep rate",
    )
    rows = [
        (
            r.name,
            _fmt_int(r.seen),
            _fmt_int(r.trained),
            _fmt_int(r.forward),
            _fmt_int(r.trained),
            f"{r.seconds:.1f} s",
            f"{100 * r.accuracy:.2f}%",
            f"{r.keep_rate:.3f}",
        )
        for r in results
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in (head, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(full: RunResult, sifted: RunResult, margin: float = 0.005) -> str:
    """One line comparing the runs, computed from their curves: when did each first reach the full
    run's final accuracy minus ``margin`` (a fraction: 0.005 is half a point)? Times and backward
    samples are interpolated between evaluations (``time_to_target``)."""
    target = full.accuracy - margin
    what = f"the full run's final accuracy minus {100 * margin:.1f} pt ({100 * target:.2f}%)"
    a = time_to_target(full.points, target)
    b = time_to_target(sifted.points, target)
    if a is None:  # cannot happen with margin >= 0: the full run ends at its final accuracy
        raise ValueError("the full run never reached its own final accuracy minus the margin")
    if b is None:
        return (
            f"Sifting did not reach {what} within the same budget: it ended at "
            f"{100 * sifted.accuracy:.2f}% after {sifted.seconds:.1f} s and "
            f"{_fmt_int(sifted.trained)} backward samples "
            f"({sifted.seconds / full.seconds:.2f}x the full run's time, "
            f"{sifted.trained / max(1, full.trained):.2f}x its backward passes)."
        )
    time_ratio = b["seconds"] / a["seconds"] if a["seconds"] > 0 else math.inf
    back_ratio = b["backward"] / a["backward"] if a["backward"] else math.inf
    faster = "less" if time_ratio < 1 else "more"
    return (
        f"Sifting reached {what} after {b['seconds']:.1f} s and {_fmt_int(round(b['backward']))} "
        f"backward samples, the full run after {a['seconds']:.1f} s and {_fmt_int(round(a['backward']))}: "
        f"{abs(1 - time_ratio) * 100:.0f}% {faster} wall time ({time_ratio:.2f}x), "
        f"{back_ratio:.2f}x the backward passes."
    )


def plot_runs(results: Sequence[RunResult], path: str, title: str = "") -> None:
    """Write a PNG: test accuracy against wall time (evaluations excluded), one line per run.

    The left panel shows every evaluation (the y-axis spans them all, the early low ones too);
    the right one zooms on the top of the curves (from 2 points below the lowest final accuracy),
    where the runs' final accuracies differ."""
    from ._optional import require

    require("matplotlib", "the accuracy plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for r in results:
        for ax in (full, zoom):
            ax.plot(
                [0.0] + [p.seconds for p in r.points],
                [math.nan] + [100 * p.accuracy for p in r.points],
                marker="o",
                ms=3,
                label=f"{r.name} ({100 * r.accuracy:.2f}%)",
            )
    values = [100 * p.accuracy for r in results for p in r.points]
    if values:
        full.set_ylim(max(0.0, min(values) - 2), min(100.0, max(values) + 1))
        last = min(100 * r.points[-1].accuracy for r in results if r.points)
        zoom.set_ylim(max(0.0, last - 2), min(100.0, max(values) + 0.3))
    full.set(
        xlabel="wall time, s (evaluations excluded)", ylabel="test accuracy, %", title="every evaluation"
    )
    zoom.set(xlabel="wall time, s (evaluations excluded)", title="zoom on the top (lower points: left)")
    for ax in (full, zoom):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(args: argparse.Namespace) -> int:
    """The ``siftpipe demo`` command (see ``add_cli`` for the flags)."""
    import siftpipe as sp

    from ._cliopts import parse_storage_options
    from ._optional import available, progress_bar

    wall0 = time.perf_counter()
    can_plot = available("matplotlib")
    if not can_plot:
        print(
            "siftpipe demo: no accuracy plot: matplotlib is not installed (pip install 'siftpipe[plot]')",
            file=sys.stderr,
        )
    torch.set_num_threads(max(1, args.threads))
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    options = parse_storage_options(args.storage_option)
    store = args.store or os.path.join(out, "shards", "train")
    quiet = args.quiet
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    x, y, hard, _ = redundant_task(
        args.samples, hard_fraction=args.hard_fraction, label_noise=args.label_noise, seed=args.task_seed
    )
    xt, yt, _, _ = redundant_task(
        args.test_samples, hard_fraction=args.hard_fraction, seed=args.task_seed, draw=1
    )
    say(
        f"siftpipe demo: {args.samples:,} training samples ({hard.mean():.0%} in the hard tail"
        + (f", {args.label_noise:.0%} labels flipped" if args.label_noise else "")
        + f"), {args.test_samples:,} test samples"
    )
    try:
        written = write_task_shards(
            store, x, y, samples_per_shard=args.per_shard, storage_options=options, progress=not quiet
        )
    except (sp.ShardError, sp.ConfigError) as exc:
        raise SystemExit(f"siftpipe demo: {exc}") from None
    say(f"wrote {len(written.urls)} shards: {written.pattern}")
    test = (torch.from_numpy(xt), torch.from_numpy(yt))
    audit_root = os.path.join(out, "audit")
    budget = (
        f"{args.budget_seconds:g} s of training each"
        if args.budget_seconds
        else f"{args.epochs} epochs ({args.epochs * args.samples:,} samples seen) each"
    )
    age = max(0, args.memory_age)
    scoring = (
        f"losses remembered for {age} epoch{'s' if age > 1 else ''} (training losses fed back, "
        "a scoring forward only for samples the memory does not know)"
        if age
        else "a scoring forward for every sample"
    )
    say(f"training the same MLP twice, {budget}: without and with sifting (beta={args.beta:g}; {scoring})")

    arms = [
        Arm("full (no sifting)"),
        Arm(
            f"sifted (beta={args.beta:g})",
            policy=lambda: sp.RelativeProbabilistic(beta=args.beta, history=2048),
            delay=args.worker_batch * 4,
            memory_age=age or None,
            observe=age > 0,
        ),
    ]
    results = []
    for arm in arms:
        audit = None
        if arm.policy is not None:
            audit = sp.AuditLog(audit_root, run_id=f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
        bar = progress_bar(
            total=None if args.budget_seconds else args.epochs * args.samples,
            unit="sample",
            desc=arm.name,
            disable=quiet,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        try:
            result = train_run(
                arm,
                written.urls,
                written.samples,
                test,
                epochs=args.epochs,
                budget_seconds=args.budget_seconds,
                storage_options=options,
                **train_options(args),
                seed=args.seed,
                evals=args.evals,
                audit=audit,
                progress=bar.update,
                flags={"hard": hard},
            )
        finally:
            bar.close()
        results.append(result)

    full, sifted = results
    plot = os.path.join(out, "accuracy.png")
    if can_plot:
        plot_runs(results, plot, title=f"siftpipe demo: {args.samples:,} samples, {budget}")
    print()
    print(_table(results))
    print()
    print(verdict(full, sifted))
    share = sifted.stats.get("trained_hard", 0) / max(1, sifted.trained)
    print(
        f"The hard tail is {hard.mean():.0%} of the data and {share:.0%} of what the sifted run trained on "
        f"(keep rate {sifted.keep_rate:.2f})."
    )
    run_id = audit.run_id if audit is not None else "?"
    print(f"audit log of the sifted run: {audit_root} (run {run_id}); inspect it with")
    print(f"  siftpipe log summary {audit_root}")
    if can_plot:
        print(f"plot of test accuracy against wall time: {plot}")
    say(f"(demo took {time.perf_counter() - wall0:.0f} s in all)")
    return 0


def add_cli(subparsers: Any) -> None:
    """``siftpipe demo [--out DIR] [--store URL] [--samples N] [--epochs E] ...``."""
    from ._cliopts import add_storage_option_flag

    p = subparsers.add_parser(
        "demo",
        help="train a small model with and without sifting on generated WebDataset shards",
        description="Write a generated dataset (many easy, redundant samples and a hard tail) to "
        "WebDataset shards, train the same MLP on it twice for the same number of samples seen "
        "(with and without sifting), streaming the shards through DataLoader workers, and print a "
        "table, a plot and the sifted run's audit log. Defaults take about 1.5-2 minutes on 2 CPU cores.",
    )
    p.add_argument(
        "--out",
        default="siftpipe-demo",
        help="directory for shards, audit log and plot (default ./siftpipe-demo)",
    )
    p.add_argument(
        "--store", help="shard prefix URL instead of OUT/shards/train, e.g. s3://bucket/demo/train"
    )
    add_storage_option_flag(p)
    p.add_argument("--samples", type=int, default=12_000, help="training samples (default 12000)")
    p.add_argument("--test-samples", type=int, default=3_000, help="test samples (default 3000)")
    p.add_argument("--per-shard", type=int, default=500, help="samples per shard (default 500)")
    p.add_argument(
        "--epochs", type=int, default=8, help="passes over the shards: the budget of each run (default 8)"
    )
    p.add_argument(
        "--budget-seconds",
        type=float,
        help="train each run for this many seconds instead (evaluations excluded), as many passes as fit",
    )
    p.add_argument(
        "--beta", type=float, default=1.0, help="RelativeProbabilistic beta: keeps 1/(1+beta) (default 1)"
    )
    p.add_argument(
        "--memory-age",
        type=int,
        default=3,
        help="epochs the sifted run reuses a sample's remembered loss (the training step's loss fed "
        "back, or its last scoring forward) instead of a new scoring forward; 0: a scoring forward "
        "for every sample seen (default 3)",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="DataLoader workers reading and decoding (default 1)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training process (default 1)")
    p.add_argument("--width", type=int, default=1536, help="MLP width, 3 hidden layers (default 1536)")
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate of AdamW (default 0.006)")
    p.add_argument("--batch", type=int, default=128, help="samples per training step (default 128)")
    p.add_argument(
        "--worker-batch",
        type=int,
        default=256,
        help="samples per worker batch, one scoring forward (default 256)",
    )
    p.add_argument("--hard-fraction", type=float, default=0.1, help="fraction of hard samples (default 0.1)")
    p.add_argument(
        "--label-noise", type=float, default=0.0, help="fraction of training labels flipped (default 0)"
    )
    p.add_argument("--evals", type=int, default=20, help="test evaluations per run (default 20)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the model, shard order and sifter (default 0)"
    )
    p.add_argument("--task-seed", type=int, default=0, help="seed of the generated task (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    p.set_defaults(func=_cli_demo)


def _cli_demo(args: argparse.Namespace) -> int:
    for name in (
        "samples",
        "test_samples",
        "per_shard",
        "workers",
        "batch",
        "worker_batch",
        "evals",
        "threads",
    ):
        if getattr(args, name) < (0 if name == "workers" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {0 if name == 'workers' else 1}")
    if args.epochs < 1 and not args.budget_seconds:
        raise SystemExit("--epochs must be >= 1 (or give --budget-seconds)")
    if args.beta <= 0:
        raise SystemExit(f"--beta must be > 0, got {args.beta}")
    return run_demo(args)
