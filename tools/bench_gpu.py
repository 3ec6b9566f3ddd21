"""GPU benchmark (issue 12): full training vs the default recipe vs InfoBatch, side by side, on one device.

One command, under 5 minutes on one GPU, nothing to download:

    python tools/bench_gpu.py                      # cuda if available, about 60 s per arm
    python tools/bench_gpu.py --host-data          # data on the host in pinned memory instead
    python tools/bench_gpu.py --quick --device cpu # the CPU smoke run the tests use (< 30 s)

Data: a procedurally generated image classification task (``--image`` x ``--image`` RGB,
``--classes`` classes), generated directly on the compute device from a seeded generator: each class
has a random low-frequency colour pattern; a sample is its class pattern, randomly translated, mixed
with a distractor class's pattern (strength ``s``) and Gaussian noise. Most samples are easy
(``s`` in [0.75, 0.95]); a ``--hard-fraction`` tail is nearly ambiguous (``s`` in [0.5, 0.6]). The test
set is drawn from the same distribution. With ``--host-data`` the training set lives on the host,
page-locked (``pin_memory``) when the device is CUDA, and every step's batch is copied into a
pinned staging buffer and on to the device with ``non_blocking=True`` (on CPU there is nothing to
pin: the report says ``pinned: false``).

Model: a small pre-activation-free ResNet (BasicBlocks, ``--width`` channels, ``--blocks`` blocks in
each of three stages, BatchNorm), ``channels_last``, trained with SGD (Nesterov momentum, warm-up and
cosine learning rate by samples seen) under ``torch.autocast(bfloat16)`` on CUDA (``--amp``; off on
CPU by default). ``cudnn.benchmark`` is on.

Arms, in one process, same initial weights, same data order, same number of samples seen:

  full       every sample trained
  recipe     ``sp.recipe(model, scorer, budget=epochs*N, batched=True, output_batch=B)`` with the
             library's defaults (InfoBatch graded, ratio 0.5, anneal 0.875, guard 0.5, spread
             floor 0.25, score memory that
             never expires, unknown samples kept); each step's per-sample losses handed back with
             ``sifter.observe``, kept samples' weights (``__sift_weight__``) applied to the loss
  infobatch  ``sp.Sifter(..., sp.InfoBatch(0.5, budget=epochs*N), memory=sp.ScoreMemory(N,
             max_age=None), unknown="keep")``: the paper's rule as README documents it, no guard

Both sifted arms read input batches of ``--input-batches`` (default 8) training batches, as README
advises (the stage's cost is per input batch, and on CUDA the score memory waits once per input
batch for the losses ``observe`` queued: with input batches of one training batch the host would
wait for every step), and hand on batches of ``--batch`` rows. Both pass ``drop_last=True``
(``--no-drop-last`` turns it off): a sifted pass keeps a different number of samples each epoch, so
its short last batch has a new size every epoch, and with ``cudnn.benchmark`` on
(``--no-cudnn-benchmark`` turns it off) each new size is autotuned again: on an H200 that cost about
1-2 s per epoch and made both sifted arms 2-3x slower than full training (docs/gpu.md).
``host_wait_seconds`` (host time waiting for the next batch: the gather and the stage) and
``batch_sizes_trained`` are reported per arm to show where time goes.

Budget: ``--seconds-per-arm`` (default 60) times the full arm's throughput, measured on
``--calib-steps`` training steps of a throwaway model after warm-up, gives the epochs (``--epochs``
fixes them instead). The sifted arms see the same samples and train fewer, so the run takes about
3 x 60 s plus data generation, calibration and evaluations: under 5 minutes.

Reported per arm: training wall time (evaluations excluded; the device is synchronised before the
clock is read), samples seen and trained per second, seen/trained/scored/observed counters, final
test accuracy, the time (and samples) to reach the full arm's final accuracy minus 0.5 point
(interpolated between ``--evals`` evaluations), its ratio to the full arm's, peak CUDA memory; and
torch, CUDA, cuDNN versions and the device name. One JSON object on stdout (and ``--out``);
progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import siftpipe as sp

MARGIN = 0.005  # the target: the full arm's final accuracy minus half a point
ARMS = ("full", "recipe", "infobatch")
WARMUP = 0.05  # learning-rate warm-up, as a fraction of the budget


# ---------------------------------------------------------------------------------- data


def make_task(
    n: int,
    n_test: int,
    *,
    image: int,
    classes: int,
    hard_fraction: float,
    device: torch.device,
    seed: int,
    chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, x_test, y_test)`` generated on ``device`` from one seeded generator.

    ``x`` is float32 ``[n, 3, image, image]``; ``y`` int64. Prototypes are random 8x8 colour grids
    upsampled to ``image + image // 4`` pixels; a sample is a random crop of its class's prototype
    (a translation) mixed with another class's crop and Gaussian noise."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pad = image // 4
    big = image + pad
    grid = torch.randn(classes, 3, 8, 8, generator=gen, device=device)
    protos = F.interpolate(grid, size=(big, big), mode="bilinear", align_corners=False)
    protos = (protos - protos.mean()) / protos.std()
    ar = torch.arange(image, device=device)
    ch = torch.arange(3, device=device)[None, :, None, None]

    def crops(labels: torch.Tensor) -> torch.Tensor:
        m = labels.numel()
        oy = torch.randint(0, pad + 1, (m,), generator=gen, device=device)
        ox = torch.randint(0, pad + 1, (m,), generator=gen, device=device)
        rows = (oy[:, None] + ar)[:, None, :, None]
        cols = (ox[:, None] + ar)[:, None, None, :]
        return protos[labels][torch.arange(m, device=device)[:, None, None, None], ch, rows, cols]

    def draw(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for at in range(0, m, chunk):
            c = min(chunk, m - at)
            y = torch.randint(0, classes, (c,), generator=gen, device=device)
            other = (y + torch.randint(1, classes, (c,), generator=gen, device=device)) % classes
            hard = torch.rand(c, generator=gen, device=device) < hard_fraction
            u = torch.rand(c, generator=gen, device=device)
            s = torch.where(hard, 0.5 + 0.1 * u, 0.75 + 0.2 * u)[:, None, None, None]
            noise = torch.randn(c, 3, image, image, generator=gen, device=device)
            xs.append(s * crops(y) + (1 - s) * crops(other) + 0.6 * noise)
            ys.append(y)
        return torch.cat(xs), torch.cat(ys)

    x, y = draw(n)
    xt, yt = draw(n_test)
    return x, y, xt, yt


# ---------------------------------------------------------------------------------- model


class Block(nn.Module):
    """A ResNet BasicBlock: two 3x3 convolutions with BatchNorm, a projection shortcut when the
    shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: a 3x3 stem, three stages of ``blocks`` BasicBlocks at widths w, 2w, 4w
    (strides 1, 2, 2), global average pooling, a linear head."""

    def __init__(self, width: int = 32, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for stage, mult in enumerate((1, 2, 4)):
            for b in range(blocks):
                layers.append(Block(cin, width * mult, 2 if (stage > 0 and b == 0) else 1))
                cin = width * mult
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.body(self.stem(x)), 1), 1))


def build_model(args: argparse.Namespace, device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = ResNet(args.width, args.blocks, args.classes)
    return model.to(device=device, memory_format=torch.channels_last)


# ---------------------------------------------------------------------------------- data path


class HostFeeder:
    """Moves host batches to the device: through a ring of pinned staging buffers and
    ``non_blocking`` copies when the device is CUDA (``pinned``), else as they are."""

    def __init__(
        self,
        device: torch.device,
        batch: int,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        ring: int = 3,
    ) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = []
        self.at = 0
        if self.pinned:
            self.buffers = [torch.empty((batch, *shape), dtype=dtype).pin_memory() for _ in range(ring)]
            self.events = [None] * ring

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (cuda:0 is not == cuda: compare the kind, and the index where this feeder names one)
        if x.device.type == self.device.type and self.device.index in (None, x.device.index):
            return x
        if not self.pinned:
            return x.to(self.device)
        k = self.at
        self.at = (k + 1) % len(self.buffers)
        if self.events[k] is not None:
            self.events[k].synchronize()  # the copy that last read this buffer has finished
        staging = self.buffers[k][: x.shape[0]]
        staging.copy_(x)
        out = staging.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[k] = event
        return out


def batches(
    x: torch.Tensor, y: torch.Tensor, order_cpu: torch.Tensor, order_x: torch.Tensor, batch: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches in ``order``: ``i`` (the sample indices, on the host: the key), ``x`` and ``y``
    gathered where the data lives (``order_x`` is the same order on that device)."""
    for at in range(0, order_cpu.numel(), batch):
        idx = order_x[at : at + batch]
        yield {"i": order_cpu[at : at + batch], "x": x.index_select(0, idx), "y": y.index_select(0, idx)}


# ---------------------------------------------------------------------------------- training


def lr_at(progress: float, peak: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    return peak * min(1.0, progress / WARMUP) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, amp: bool) -> Any:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if amp else nullcontext()


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    xb: torch.Tensor,
    yb: torch.Tensor,
    weight: torch.Tensor | None,
    device: torch.device,
    amp: bool,
) -> torch.Tensor:
    """One SGD step; the per-sample losses (detached, on the device)."""
    xb = xb.contiguous(memory_format=torch.channels_last)
    with autocast(device, amp):
        out = model(xb)
    losses = F.cross_entropy(out.float(), yb, reduction="none")
    loss = (losses * weight).mean() if weight is not None else losses.mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return losses.detach()


@torch.no_grad()
def evaluate(model: nn.Module, xt: torch.Tensor, yt: torch.Tensor, device: torch.device, amp: bool) -> float:
    was = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for at in range(0, xt.shape[0], 1024):
        xb = xt[at : at + 1024].contiguous(memory_format=torch.channels_last)
        with autocast(device, amp):
            pred = model(xb).argmax(1)
        correct += (pred == yt[at : at + 1024]).sum()
    model.train(was)
    return correct.item() / xt.shape[0]


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=args.weight_decay
    )


def calibrate(
    args: argparse.Namespace,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    feed: tuple[HostFeeder, HostFeeder, HostFeeder],
) -> float:
    """Samples per second of the full arm's training step (gather, copy, step), after warm-up."""
    model = build_model(args, device, seed=12345)
    opt = make_optimizer(model, args)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(1)
    warm, steps = 5, args.calib_steps
    t0 = 0.0
    for k in range(warm + steps):
        if k == warm:
            sync(device)
            t0 = time.perf_counter()
        idx = torch.randint(0, n, (args.batch,), generator=gen).to(x.device)
        xb = feed[0](x.index_select(0, idx))
        yb = feed[1](y.index_select(0, idx))
        for g in opt.param_groups:
            g["lr"] = 0.01
        train_step(model, opt, xb, yb, None, device, args.amp)
    sync(device)
    return steps * args.batch / (time.perf_counter() - t0)


def time_to_target(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """Counters when accuracy first reached ``target``, interpolated from the evaluation before
    (the clock starts at 0 with nothing trained); None if it never did."""
    before = {"seconds": 0.0, "seen": 0.0, "trained": 0.0, "accuracy": 0.0}
    for p in points:
        if p["accuracy"] >= target:
            gap = p["accuracy"] - before["accuracy"]
            f = (target - before["accuracy"]) / gap if gap > 0 else 1.0
            f = min(max(f, 0.0), 1.0)
            return {k: round(before[k] + f * (p[k] - before[k]), 3) for k in ("seconds", "seen", "trained")}
        before = p
    return None


def make_sifter(arm: str, model: nn.Module, n: int, total: int, args: argparse.Namespace) -> sp.Sifter | None:
    common: dict[str, Any] = {
        "batched": True,
        "output_batch": args.batch,
        "drop_last": args.drop_last,
        "key": "i",
        "seed": args.seed,
        "micro_batch": args.micro_batch or None,
    }
    scorer = sp.CrossEntropy("x", "y")  # held, never run: both arms decide from training losses
    if arm == "recipe":
        return sp.recipe(model, scorer, budget=total, **common)
    if arm == "infobatch":
        return sp.Sifter(
            model,
            scorer,
            sp.InfoBatch(0.5, budget=total),
            memory=sp.ScoreMemory(capacity=n, max_age=None),
            unknown="keep",
            remember_forward=False,
            **common,
        )
    return None


def run_arm(
    arm: str,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    epochs: int,
    device: torch.device,
    feed: tuple[HostFeeder, HostFeeder, HostFeeder],
    args: argparse.Namespace,
) -> dict[str, Any]:
    x, y, xt, yt = data
    n = x.shape[0]
    total = n * epochs
    model = build_model(args, device, seed=args.seed)
    opt = make_optimizer(model, args)
    sifter = make_sifter(arm, model, n, total, args)
    order_gen = torch.Generator().manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    points: list[dict[str, float]] = []
    state = {"seen": 0, "trained": 0}
    paused = 0.0
    next_eval = 1  # evaluation k at k/evals of the budget; the last one after training
    pending: tuple[list[int], torch.Tensor, Any] | None = None  # --deferred-observe
    waited = 0.0  # host seconds spent waiting for the next batch (the data gather, and the stage)
    shapes: set[int] = set()  # distinct batch sizes trained (each new one costs a cudnn autotune)

    def eval_point() -> None:
        nonlocal paused
        sync(device)
        t0 = time.perf_counter()
        with sifter.off_clock() if sifter is not None else contextlib.nullcontext():
            acc = evaluate(model, xt, yt, device, args.amp)  # not the step: off its clock
        points.append(
            {
                "seconds": t0 - start - paused,
                "seen": state["seen"],
                "trained": state["trained"],
                "accuracy": acc,
            }
        )
        paused += time.perf_counter() - t0

    model.train()
    sync(device)
    start = time.perf_counter()
    for epoch in range(epochs):
        order_cpu = torch.randperm(n, generator=order_gen)
        if x.device.type == "cuda":
            order_x = order_cpu.pin_memory().to(x.device, non_blocking=True)
        else:
            order_x = order_cpu
        # the sifted arms read input batches of --input-batches training batches (README: the
        # stage's cost is per input batch, and on CUDA it waits once per input batch for the losses
        # observe() queued) and hand on batches of --batch rows; full reads --batch rows
        rows = args.batch if sifter is None else args.batch * args.input_batches
        source = batches(x, y, order_cpu, order_x, rows)
        base = epoch * n
        if sifter is None:
            stream: Iterator[tuple[dict[str, torch.Tensor], int]] = (
                (b, base + min((k + 1) * args.batch, n)) for k, b in enumerate(source)
            )
        else:
            sifter.set_epoch(epoch)
            at_start = sifter.stats

            def sifted(
                s: sp.Sifter = sifter,
                src: Iterator[Any] = source,
                at_start: sp.SiftStats = at_start,
                base: int = base,
            ) -> Iterator[Any]:
                handed = at = 0
                for b in s(src):
                    now = s.stats
                    seen, kept = now.seen - at_start.seen, now.kept - at_start.kept
                    handed += int(b["i"].numel())
                    # the samples seen up to this step's: the stage decides a whole input batch
                    # before it hands its first rows on, so its seen count runs ahead by up to an
                    # input batch (the learning rate and the evaluation points would run ahead of
                    # the full arm's); the rows handed on, scaled by the pass's seen/kept, do not
                    # (never back: the scale moves when a batch keeps another share)
                    at = max(at, min(seen, n, round(handed * seen / max(kept, 1))))
                    yield b, base + at

            stream = sifted()
        it = iter(stream)
        while True:
            t_wait = time.perf_counter()
            got = next(it, None)
            waited += time.perf_counter() - t_wait
            if got is None:
                break
            b, seen = got
            shapes.add(int(b["i"].numel()))
            while next_eval < args.evals and seen > next_eval / args.evals * total:
                eval_point()
                next_eval += 1
            state["seen"] = seen
            for g in opt.param_groups:
                g["lr"] = lr_at(seen / total, args.lr)
            xb = feed[0](b["x"])
            yb = feed[1](b["y"])
            weight = b.get("__sift_weight__")
            if weight is not None:
                weight = feed[2](weight)
            losses = train_step(model, opt, xb, yb, weight, device, args.amp)
            if sifter is not None:
                if args.deferred_observe:
                    # hand the losses back one step late, from a non_blocking copy to pinned memory,
                    # so the host never waits for the step it just queued (on CPU: one step late only)
                    event = None
                    if device.type == "cuda":
                        host = torch.empty(losses.shape, dtype=losses.dtype, pin_memory=True)
                        host.copy_(losses, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record()
                    else:
                        host = losses
                    if pending is not None:
                        if pending[2] is not None:
                            pending[2].synchronize()
                        sifter.observe(pending[0], pending[1])
                    pending = (b["i"].tolist(), host, event)
                else:
                    sifter.observe(b["i"].tolist(), losses)
            state["trained"] += int(b["i"].numel())
        if pending is not None:  # the epoch's last step, before the next pass decides
            if pending[2] is not None:
                pending[2].synchronize()
            sifter.observe(pending[0], pending[1])  # type: ignore[union-attr]
            pending = None
        state["seen"] = (epoch + 1) * n
    sync(device)
    seconds = time.perf_counter() - start - paused
    eval_point()
    wall = time.perf_counter() - start
    row: dict[str, Any] = {
        "seconds": round(seconds, 3),
        "seconds_with_evals": round(wall, 3),
        "seen": state["seen"],
        "trained": state["trained"],
        "scored": 0,
        "keep_rate": round(state["trained"] / state["seen"], 4),
        "seen_per_s": round(state["seen"] / seconds, 1),
        "trained_per_s": round(state["trained"] / seconds, 1),
        "final_accuracy": round(points[-1]["accuracy"], 5),
        "host_wait_seconds": round(waited, 3),
        "batch_sizes_trained": len(shapes),
        "curve": [{k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()} for p in points],
    }
    if sifter is not None:
        stats = sifter.stats
        row["scored"] = stats.scored
        row["sifter"] = {
            "seen": stats.seen,
            "kept": stats.kept,
            "unknown": stats.unknown,
            "from_memory": stats.from_memory,
            "observed": stats.observed,
            "unhanded": stats.unhanded,
            "sifting_scale": round(stats.sifting_scale, 4),
            "decide_seconds": round(stats.decide_seconds, 3),
            "score_seconds": round(stats.score_seconds, 3),
        }
        sifter.close()
    if device.type == "cuda":
        row["peak_cuda_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return row


# ---------------------------------------------------------------------------------- main


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "siftpipe": sp.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--host-data", action="store_true", help="training data on the host (pinned on CUDA)")
    ap.add_argument(
        "--amp", choices=("auto", "bf16", "off"), default="auto", help="auto: bf16 on CUDA, off on CPU"
    )
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--test-samples", type=int, default=10_000)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--hard-fraction", type=float, default=0.2)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--micro-batch", type=int, default=0, help="Sifter micro_batch (0: one per batch)")
    ap.add_argument(
        "--deferred-observe",
        action="store_true",
        help="hand losses to sifter.observe one step late (CUDA: from a non_blocking pinned copy)",
    )
    ap.add_argument(
        "--cudnn-benchmark",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cudnn.benchmark on CUDA (each new batch shape is autotuned once)",
    )
    ap.add_argument(
        "--input-batches",
        type=int,
        default=8,
        help="sifted arms: training batches per input batch the stage decides at once",
    )
    ap.add_argument(
        "--drop-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sifted arms: Sifter(drop_last=...), hand on full batches only (one shape per run)",
    )
    ap.add_argument("--epochs", type=int, default=None, help="fixed epochs (default: from --seconds-per-arm)")
    ap.add_argument("--seconds-per-arm", type=float, default=60.0)
    ap.add_argument("--max-epochs", type=int, default=200)
    ap.add_argument("--calib-steps", type=int, default=30)
    ap.add_argument("--evals", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--quick", action="store_true", help="a small CPU-sized run for the tests (< 30 s)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.input_batches < 1:
        ap.error(f"--input-batches is a whole number of training batches >= 1, got {args.input_batches}")
    if args.quick:
        args.samples, args.test_samples, args.image = 1536, 512, 16
        args.width, args.blocks, args.batch, args.evals = 8, 1, 128, 4
        if args.epochs is None:
            args.epochs = 4
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    args.amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")

    t0 = time.perf_counter()
    x, y, xt, yt = make_task(
        args.samples,
        args.test_samples,
        image=args.image,
        classes=args.classes,
        hard_fraction=args.hard_fraction,
        device=device,
        seed=args.seed,
    )
    sync(device)
    gen_seconds = time.perf_counter() - t0
    feed = (
        HostFeeder(device, args.batch, tuple(x.shape[1:])),  # images
        HostFeeder(device, args.batch, (), torch.int64),  # labels
        HostFeeder(device, args.batch, ()),  # the weight column (on the host beside host batches)
    )
    pinned = False
    if args.host_data:
        x, y = x.cpu(), y.cpu()
        if feed[0].pinned:
            x, y = x.pin_memory(), y.pin_memory()
            pinned = bool(x.is_pinned())
    print(f"data: {tuple(x.shape)} on {x.device} in {gen_seconds:.1f} s (pinned: {pinned})", file=sys.stderr)

    calib = None
    if args.epochs is None:
        rate = calibrate(args, x, y, device, feed)
        epochs = max(1, min(args.max_epochs, round(args.seconds_per_arm * rate / args.samples)))
        calib = {"samples_per_s": round(rate, 1), "steps": args.calib_steps, "epochs": epochs}
        print(f"calibration: {rate:.0f} samples/s -> {epochs} epochs", file=sys.stderr)
    else:
        epochs = args.epochs

    arms: dict[str, Any] = {}
    for arm in args.arms:
        arms[arm] = run_arm(arm, (x, y, xt, yt), epochs, device, feed, args)
        r = arms[arm]
        print(
            f"{arm:<10} {r['seconds']:7.1f} s  acc {100 * r['final_accuracy']:6.2f}%  "
            f"trained {r['trained']}/{r['seen']}",
            file=sys.stderr,
            flush=True,
        )
    full = arms.get("full")
    if full is not None:
        target = full["final_accuracy"] - MARGIN
        full_hit = time_to_target(full["curve"], target)
        for r in arms.values():
            hit = time_to_target(r["curve"], target)
            r["target"] = round(target, 5)
            r["to_target"] = hit
            r["wall_ratio_to_full"] = round(r["seconds"] / full["seconds"], 4)
            r["trained_ratio_to_full"] = round(r["trained"] / full["trained"], 4)
            if hit is not None and full_hit is not None and full_hit["seconds"] > 0:
                r["time_to_target_ratio_to_full"] = round(hit["seconds"] / full_hit["seconds"], 4)
            else:
                r["time_to_target_ratio_to_full"] = None
    report = {
        "benchmark": "bench_gpu",
        "quick": args.quick,
        "environment": environment(device),
        "data": {
            "train": args.samples,
            "test": args.test_samples,
            "image": [3, args.image, args.image],
            "classes": args.classes,
            "hard_fraction": args.hard_fraction,
            "generated_on": str(device),
            "generation_seconds": round(gen_seconds, 3),
            "placement": "host" if args.host_data else "device",
            "pinned": pinned,
        },
        "model": {
            "kind": "ResNet",
            "width": args.width,
            "blocks_per_stage": args.blocks,
            "parameters": sum(p.numel() for p in build_model(args, torch.device("cpu"), 0).parameters()),
            "channels_last": True,
            "autocast": "bfloat16" if args.amp else None,
        },
        "train": {
            "epochs": epochs,
            "batch": args.batch,
            "lr": args.lr,
            "evals": args.evals,
            "seed": args.seed,
            "micro_batch": args.micro_batch or None,
            "deferred_observe": args.deferred_observe,
            "drop_last": args.drop_last,
            "input_batches": args.input_batches,
            "cudnn_benchmark": bool(args.cudnn_benchmark) if device.type == "cuda" else None,
        },
        "calibration": calib,
        "margin": MARGIN,
        "arms": arms,
        "total_seconds": round(time.perf_counter() - t0, 2),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
