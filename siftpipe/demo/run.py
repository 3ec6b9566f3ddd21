"""One training run of the demo (or of ``tools/bench_train.py``): an arm (full, sifted, proxy)
streamed from shards through DataLoader workers, timed and evaluated."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .task import build_model, decode_batch


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


def _quiet_broken_connections(worker_id: int) -> None:
    """In a DataLoader worker: the training process stopped (Ctrl-C, SIGTERM) while it was taking
    a batch's memory from the worker, and the worker's sharing thread printed that connection's
    broken pipe as a traceback after the command said it stopped (found by review, 2026-12-05).
    Only connection errors of the worker's own threads are quiet; its work errors are not."""
    import sys
    import threading

    previous, previous_sys = threading.excepthook, sys.excepthook

    def hook(args: Any) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, ConnectionError | EOFError):
            return
        previous(args)

    def sys_hook(kind: Any, value: Any, tb: Any) -> None:
        # (multiprocessing's resource sharer reports its thread's errors through sys.excepthook)
        if kind is not None and issubclass(kind, ConnectionError | EOFError):
            return
        previous_sys(kind, value, tb)

    threading.excepthook = hook
    sys.excepthook = sys_hook


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

    from ..adapters.webdataset import WebDataset, WebLoader

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
        worker_init_fn=_quiet_broken_connections if workers else None,
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
        # not the training step: off the stage's clock (its step time, and what it saved)
        off_clock = sifter.off_clock() if sifter is not None else contextlib.nullcontext()
        with off_clock, torch.inference_mode():
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
        at_start = sifter.stats if sifter is not None else None
        last_reported = state["seen"]
        read_by_worker: dict[int, int] = {}
        rows_in_epoch = placed = 0
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
            elif sifter is not None and at_start is not None:
                # the stage decides a whole input batch before it hands its first rows on, so its
                # seen count runs ahead by up to one (the learning rate would run ahead of the
                # full arm's): the rows handed on, scaled by the epoch's seen/kept, do not
                now = sifter.stats
                seen_now, kept_now = now.seen - at_start.seen, now.kept - at_start.kept
                rows_in_epoch += len(step_batch["y"])
                # (never back: the scale moves when a batch keeps another share)
                placed = max(placed, min(seen_now, round(rows_in_epoch * seen_now / max(kept_now, 1))))
                in_epoch = placed
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
    seen = state["seen"]
    if budget_seconds is not None and stats is not None and not arm.predecode:
        # stopped by the clock inside an epoch: the learning rate's estimate of the samples read
        # (rows handed on, scaled) ran a worker batch behind what the stage decided, which its
        # audit log records: the table's "samples seen" and keep rate said otherwise (found by
        # review, 2026-12-05)
        seen = max(seen, stats.seen)
    return RunResult(
        name=arm.name,
        points=points,
        seen=seen,
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
