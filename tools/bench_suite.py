"""Sifting across tasks (issue 12): the default recipe against full training, a reference InfoBatch
and uniform dropping, on tasks nobody built to favour sifting, each with a tuned full-data baseline.

Tasks (``TASKS``; each definition's docstring records its learning-rate sweep):

  images          a small CNN on 8,000 procedurally generated 16x16 images (10 classes of random smooth
                  templates; random crop, contrast and noise level), shift + flip augmentation
  lm              a small causal transformer LM on 3,200 generated token sequences (sparse Markov
                  chains and copy sequences); per-sequence loss = mean token cross-entropy
  tabular         an MLP on 32,000 generated tabular samples (clusters on hypercube vertices,
                  redundant and useless features, a random rotation)
  redundant       ``siftpipe.demo.redundant_task``: many easy near-duplicates and a hard tail (the
                  task of ``tools/bench_train.py`` and the demo), trained in memory
  *_noise         the same task with 20% of the training labels replaced by another class (for
                  ``lm``: 20% of the training sequences replaced by uniform random tokens), same
                  hyperparameters

Default tasks: images, lm, tabular, redundant, tabular_noise. Each task's learning rate is the best
of a sweep of the full arm (``--sweep``; results in ``_task_table``).

Every arm trains the same model from the same initial weights over the same data order for the same
budget: ``epochs`` passes over the in-memory training set (the full baseline's tuned schedule).
Optimizer: AdamW, the task's peak learning rate, linear warm-up over 5% then cosine decay to 0,
**scheduled by samples seen** (every sample that reached the selector, trained or not), so a
sifting arm runs the same schedule per pass and ends it at the same epoch as the full arm, with
fewer optimizer steps. Rows per step are the task's batch for every arm (sifted arms re-batch kept
samples). Arms (``--arms``; ``name@key=value,key=value`` sets parameters, e.g.
``recipe@ratio=0.3,warmup=0.1``):

  full            every sample trained, no selector
  recipe          ``sp.recipe(model, scorer, budget=epochs*N, batched=True, output_batch=batch)``
                  with the library's defaults (keys: ratio, warmup, anneal, guard, cost_guard,
                  graded, min_spread, noise_drop; ``guard=none``, ``graded=0`` for InfoBatch's step
                  rule; ``steps=1``: one training batch per input batch, its kept rows one step,
                  so the full run's steps on fewer rows), fed input
                  batches of ``feed`` x batch rows (default 8, as README recommends; key: feed);
                  losses of the training step handed back with ``sifter.observe``
  infobatch_ref   InfoBatch (Qin et al., ICLR 2024) written here, independent of the library
                  (``InfoBatchRef``): losses from the training step only; at each epoch start the
                  threshold is the mean of every remembered loss; below-mean samples are pruned with
                  probability ``ratio`` and the kept ones weigh ``1/(1-ratio)``; pruned samples keep
                  their last loss and are never re-scored; the first epoch (nothing remembered) and
                  every epoch from ``floor(anneal*epochs)`` on train the full data (keys: ratio,
                  anneal)
  uniform         ``sp.Uniform(keep)`` through a ``Sifter`` with a free scorer (no forward); keep =
                  the ``recipe`` arm's trained/seen in the same seed (else 0.5; key: keep)

Per run: wall time (evaluations excluded; ``torch.set_num_threads(1)``), samples seen, trained and
scored (scoring forwards), compute units = trained x 3 + scoring forwards x 1 (a forward is 1, a
backward 2), final metric, and the same counters at the target, interpolated between evaluations:
each seed's full-run final accuracy minus 0.5 point (``lm``: the full run's final eval loss). Ratios
are against the full run of the same seed. The summary holds medians over seeds per task and arm and
the issue's targets for the ``recipe`` arm, judged on wall time and on compute units.

Usage: python tools/bench_suite.py [--seeds 3] [--tasks ...] [--arms ...] [--epochs N] [--markdown PATH|-]
       python tools/bench_suite.py --sweep            # the full arm's learning-rate sweep per task
       python tools/bench_suite.py --quick            # everything tiny, for the tests (< 40 s)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _out import check_writable  # (tools/: on the path when run as a script)
from torch import nn

import siftpipe as sp

MARGIN = 0.005  # classification target: the full run's final accuracy minus half a point
WARMUP = 0.05  # learning-rate warm-up, fraction of the budget
# the recipe arm's input batches, in training batches: the stage's cost per input batch is shared by
# FEED steps, and the training steps' losses reach the memory in one update (README, "Feed it more
# rows than you train on"); recipe@feed=1 gives it one training batch per input batch
FEED = 8

# ---------------------------------------------------------------------------------- tasks


@dataclass
class Data:
    """One task's tensors: training inputs/targets, test inputs/targets, and the noisy-label mask."""

    x: torch.Tensor
    y: torch.Tensor
    xt: torch.Tensor
    yt: torch.Tensor
    noisy: np.ndarray


@dataclass
class Task:
    """A task: data, model, per-sample loss, metric, and the full baseline's tuned schedule."""

    name: str
    doc: str
    make_data: Callable[[bool], Data]  # (quick) -> Data
    make_model: Callable[[bool, int], nn.Module]  # (quick, seed) -> model
    lr: float
    epochs: int
    batch: int
    weight_decay: float = 0.01
    kind: str = "classify"  # or "lm" (metric: eval loss, lower is better)
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None
    sweep: tuple[float, ...] = ()
    quick_epochs: int = 4

    def per_sample_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "lm":
            return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)
        return F.cross_entropy(out, y, reduction="none")

    def scorer(self) -> sp.Scorer:
        if self.kind == "lm":
            return sp.TokenCrossEntropy("x", "y")
        return sp.CrossEntropy("x", "y")

    def evaluate(self, model: nn.Module, xt: torch.Tensor, yt: torch.Tensor) -> dict[str, float]:
        """``metric`` (accuracy, or eval loss for an LM) and, for an LM, token accuracy."""
        was = model.training
        model.eval()
        with torch.inference_mode():
            outs = [model(xb) for xb in xt.split(1024)]
        model.train(was)
        out = torch.cat(outs)
        if self.kind == "lm":
            loss = F.cross_entropy(out.transpose(1, 2), yt).item()
            return {"metric": loss, "token_accuracy": (out.argmax(-1) == yt).double().mean().item()}
        return {"metric": (out.argmax(1) == yt).double().mean().item()}


def _flip_labels(y: np.ndarray, classes: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Replace ``fraction`` of labels with a different, uniformly drawn class."""
    rng = np.random.default_rng([seed, 99])
    noisy = rng.random(y.size) < fraction
    y = y.copy()
    y[noisy] = (y[noisy] + rng.integers(1, classes, size=int(noisy.sum()))) % classes
    return y, noisy


# -- images: a small CNN on generated 16x16 images


def _images(n: int, draw: int, classes: int = 10, side: int = 16) -> tuple[np.ndarray, np.ndarray]:
    task = np.random.default_rng([12, 0])
    # each class: a random smooth template (a sum of 6 signed gaussian blobs) on a 24x24 canvas
    grid = np.arange(24)
    templates = np.zeros((classes, 24, 24))
    for c in range(classes):
        for _ in range(6):
            cy, cx = task.uniform(4, 20, size=2)
            s = task.uniform(1.5, 3.5)
            sign = task.choice([-1.0, 1.0])
            templates[c] += sign * np.exp(
                -((grid[:, None] - cy) ** 2 + (grid[None, :] - cx) ** 2) / (2 * s * s)
            )
    templates /= templates.std(axis=(1, 2), keepdims=True)
    rng = np.random.default_rng([12, 1, draw])
    y = rng.integers(0, classes, size=n)
    oy, ox = rng.integers(0, 24 - side + 1, size=(2, n))  # random crop = shift up to +-4 px
    rows = oy[:, None] + np.arange(side)[None, :]
    cols = ox[:, None] + np.arange(side)[None, :]
    x = templates[y[:, None, None], rows[:, :, None], cols[:, None, :]]
    x *= rng.uniform(0.4, 1.4, size=(n, 1, 1))  # contrast
    x += rng.normal(size=x.shape) * rng.uniform(0.4, 2.2, size=(n, 1, 1))  # noise level: difficulty
    return x[:, None].astype(np.float32), y.astype(np.int64)


def _images_data(quick: bool, noise: float) -> Data:
    n, nt = (600, 300) if quick else (8000, 2000)
    x, y = _images(n, 0)
    xt, yt = _images(nt, 1)
    noisy = np.zeros(n, dtype=bool)
    if noise:
        y, noisy = _flip_labels(y, 10, noise, 12)
    return Data(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt), torch.from_numpy(yt), noisy)


def _cnn(quick: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    c1, c2 = (4, 8) if quick else (16, 32)
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _augment_images(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shift by up to 2 px (one per batch, circular) and a random horizontal flip per sample."""
    dy, dx = (int(v) for v in torch.randint(-2, 3, (2,), generator=gen))
    x = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
    flip = torch.rand(x.shape[0], generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


# -- lm: a small transformer on generated sequences

VOCAB, SEQ = 48, 33


def _sequences(n: int, draw: int) -> np.ndarray:
    """Token sequences of length SEQ: 70% walks of one of 6 sparse Markov chains (each state has 3
    likely successors), 30% copy sequences (a random 8-token motif repeated)."""
    task = np.random.default_rng([13, 0])
    chains = np.full((6, VOCAB, VOCAB), 0.02 / VOCAB)
    for c in range(6):
        for s in range(VOCAB):
            nxt = task.choice(VOCAB, size=3, replace=False)
            chains[c, s, nxt] += task.dirichlet([1.0, 1.0, 1.0])
    chains /= chains.sum(-1, keepdims=True)
    cum = chains.cumsum(-1)
    rng = np.random.default_rng([13, 1, draw])
    out = np.empty((n, SEQ), dtype=np.int64)
    copy = rng.random(n) < 0.3
    motif = rng.integers(0, VOCAB, size=(n, 8))
    out[copy] = np.tile(motif[copy], SEQ // 8 + 1)[:, :SEQ]
    walk = np.flatnonzero(~copy)
    chain = rng.integers(0, 6, size=walk.size)
    state = rng.integers(0, VOCAB, size=walk.size)
    out[walk, 0] = state
    for t in range(1, SEQ):
        u = rng.random(walk.size)[:, None]
        state = np.minimum((cum[chain, state] < u).sum(-1), VOCAB - 1)
        out[walk, t] = state
    return out


def _lm_data(quick: bool, noise: float) -> Data:
    n, nt = (400, 200) if quick else (3200, 1000)
    seq = _sequences(n, 0)
    test = _sequences(nt, 1)
    noisy = np.zeros(n, dtype=bool)
    if noise:
        rng = np.random.default_rng([13, 99])
        noisy = rng.random(n) < noise
        seq[noisy] = rng.integers(0, VOCAB, size=(int(noisy.sum()), SEQ))
    s, t = torch.from_numpy(seq), torch.from_numpy(test)
    return Data(
        s[:, :-1].contiguous(), s[:, 1:].contiguous(), t[:, :-1].contiguous(), t[:, 1:].contiguous(), noisy
    )


class TinyLM(nn.Module):
    """A causal transformer: token + position embeddings, pre-norm encoder layers, tied-free head."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ - 1, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(SEQ - 1), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def _lm(quick: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLM(d=32, layers=1, heads=2) if quick else TinyLM()


# -- tabular


def _tabular(n: int, draw: int) -> tuple[np.ndarray, np.ndarray]:
    """6 classes x 3 clusters on vertices of a 10-d hypercube (side 2.4), gaussian clusters,
    10 redundant features (random linear mixes), 10 useless ones, then a random rotation."""
    task = np.random.default_rng([14, 0])
    classes, per, inf = 6, 3, 10
    vertices = task.choice(2**inf, size=classes * per, replace=False)
    centers = ((vertices[:, None] >> np.arange(inf)) & 1) * 2.4 - 1.2
    mix = task.normal(size=(inf, 10))
    rotation, _ = np.linalg.qr(task.normal(size=(30, 30)))
    covariances = task.normal(scale=0.6, size=(classes * per, inf, inf))
    rng = np.random.default_rng([14, 1, draw])
    cluster = rng.integers(0, classes * per, size=n)
    z = np.einsum("nij,nj->ni", covariances[cluster], rng.normal(size=(n, inf))) + centers[cluster]
    x = np.concatenate([z, z @ mix * 0.3, rng.normal(size=(n, 10))], axis=1) @ rotation
    return x.astype(np.float32), (cluster % classes).astype(np.int64)


def _tabular_data(quick: bool, noise: float) -> Data:
    n, nt = (1000, 500) if quick else (32000, 4000)
    x, y = _tabular(n, 0)
    xt, yt = _tabular(nt, 1)
    noisy = np.zeros(n, dtype=bool)
    if noise:
        y, noisy = _flip_labels(y, 6, noise, 14)
    return Data(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt), torch.from_numpy(yt), noisy)


def _mlp(dim: int, classes: int, width: int, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    size = dim
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, classes))


# -- redundant: siftpipe.demo.redundant_task, in memory


def _redundant_data(quick: bool, noise: float) -> Data:
    from siftpipe.demo import redundant_task

    n, nt = (800, 400) if quick else (8000, 2000)
    x, y, _, noisy = redundant_task(n, label_noise=noise)
    xt, yt, _, _ = redundant_task(nt, draw=1)
    return Data(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt), torch.from_numpy(yt), noisy)


def _task_table() -> dict[str, Task]:
    # LR sweeps of the full arm (python tools/bench_suite.py --sweep --seeds 1, then --seeds 2 --lrs
    # for the best few): final metric (mean over seeds); the best is the task's lr. Sifting arms get
    # the same hyperparameters, never tuned per task.
    images_doc = """CNN (conv16-conv32-fc64, 3x3 convs, max-pool) on 8,000 generated 16x16 images, 10
    classes (2,000 test); random shift and flip augmentation. AdamW (wd 0.01), batch 64, 8 epochs,
    5% warm-up + cosine. LR sweep, final test accuracy, seed 0: 1e-3 0.918, 3e-3 0.936, 6e-3 0.949,
    1e-2 0.9475; seeds 0-1: 6e-3 0.9485, 1e-2 0.942. Chosen lr 6e-3."""
    lm_doc = """Causal transformer LM (d 64, 2 pre-norm layers, 4 heads, FF 128) on 3,200 generated
    sequences of 32 next-token targets (vocab 48; 1,000 test); per-sequence loss = mean token
    cross-entropy. AdamW (wd 0.01), batch 32, 8 epochs, 5% warm-up + cosine. LR sweep, final eval
    loss, seed 0: 1e-3 2.608, 3e-3 2.417, 6e-3 2.306, 1e-2 2.144, 2e-2 2.018, 3e-2 2.063; seeds
    0-1: 1e-2 2.154, 2e-2 1.951. Chosen lr 2e-2."""
    tab_doc = """MLP 30-384-384-6 on 32,000 generated tabular samples (4,000 test). AdamW (wd 0.01),
    batch 128, 8 epochs, 5% warm-up + cosine. LR sweep, final accuracy, seed 0: 1e-3 0.920, 3e-3
    0.936, 6e-3 0.942, 1e-2 0.9423, 2e-2 0.9343; seeds 0-1: 6e-3 0.9415, 1e-2 0.9449, 2e-2 0.9389.
    Chosen lr 1e-2 (re-swept 2026-12-06; 6e-3 before, from a sweep whose 1e-2 figures did not
    reproduce)."""
    red_doc = """MLP 64-1024x3-10 on siftpipe.demo.redundant_task (8,000 train, 2,000 test), in memory.
    AdamW (wd 0.01), batch 128, 8 epochs, 5% warm-up + cosine. LR sweep, final accuracy, seed 0:
    1e-3 0.9675, 3e-3 0.975, 6e-3 0.979, 1e-2 0.980, 2e-2 0.956; seeds 0-1: 6e-3 0.981, 1e-2
    0.980. Chosen lr 6e-3."""
    base = {
        "images": Task(
            "images",
            images_doc,
            lambda q: _images_data(q, 0.0),
            _cnn,
            lr=6e-3,
            epochs=8,
            batch=64,
            augment=_augment_images,
            sweep=(1e-3, 3e-3, 6e-3, 1e-2),
        ),
        "lm": Task(
            "lm",
            lm_doc,
            lambda q: _lm_data(q, 0.0),
            _lm,
            lr=2e-2,
            epochs=8,
            batch=32,
            kind="lm",
            sweep=(1e-3, 3e-3, 6e-3, 1e-2, 2e-2, 3e-2),
        ),
        "tabular": Task(
            "tabular",
            tab_doc,
            lambda q: _tabular_data(q, 0.0),
            lambda q, s: _mlp(30, 6, 64 if q else 384, 2, s),
            lr=1e-2,  # 6e-3 until 2026-12-06: the sweep re-run (docs/suite.md) chose 1e-2
            epochs=8,
            batch=128,
            sweep=(1e-3, 3e-3, 6e-3, 1e-2, 2e-2),
        ),
        "redundant": Task(
            "redundant",
            red_doc,
            lambda q: _redundant_data(q, 0.0),
            lambda q, s: _mlp(64, 10, 64 if q else 1024, 3, s),
            lr=6e-3,
            epochs=8,
            batch=128,
            sweep=(1e-3, 3e-3, 6e-3, 1e-2, 2e-2),
        ),
    }
    makers = {"images": _images_data, "lm": _lm_data, "tabular": _tabular_data, "redundant": _redundant_data}
    out = dict(base)
    for name, task in base.items():
        maker = makers[name]
        out[f"{name}_noise"] = Task(
            f"{name}_noise",
            task.doc + " 20% label noise on the training set (test clean); same hyperparameters.",
            lambda q, m=maker: m(q, 0.2),
            task.make_model,
            lr=task.lr,
            epochs=task.epochs,
            batch=task.batch,
            weight_decay=task.weight_decay,
            kind=task.kind,
            augment=task.augment,
            sweep=task.sweep,
        )
    return out


TASKS = _task_table()
DEFAULT_TASKS = ("images", "lm", "tabular", "redundant", "tabular_noise")

# ---------------------------------------------------------------------------------- arms


@dataclass
class ArmSpec:
    """An arm: its kind (full, recipe, infobatch_ref, uniform) and parameters; ``label`` as given."""

    label: str
    kind: str
    params: dict[str, Any]


ARM_KINDS = {
    "full": set(),
    "recipe": {
        *("ratio", "warmup", "anneal", "guard", "cost_guard", "graded", "feed", "min_spread", "noise_drop"),
        "steps",
    },
    "infobatch_ref": {"ratio", "anneal"},
    "uniform": {"keep", "feed"},
}


def keep_copied(arm: ArmSpec, done: dict[str, dict[str, Any]]) -> ArmSpec:
    """``arm``, or for a uniform arm given no ``keep=``, the same arm keeping the rate the
    ``recipe`` arm kept in this seed (``done``: the seed's rows so far; 0.5 without one), every
    other parameter as given (found by review, 2026-12-05: ``uniform@feed=1`` ran with feed 8)."""
    if arm.kind != "uniform" or "keep" in arm.params:
        return arm
    base = done.get("recipe")
    return ArmSpec(arm.label, "uniform", {**arm.params, "keep": base["keep_rate"] if base else 0.5})


def parse_arm(text: str) -> ArmSpec:
    """``kind`` or ``kind@key=value,key=value`` (values are numbers or ``none``)."""
    kind, _, rest = text.partition("@")
    if kind not in ARM_KINDS:
        raise ValueError(f"unknown arm {kind!r}; arms are {sorted(ARM_KINDS)}")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ARM_KINDS[kind]:
            raise ValueError(f"arm {text!r}: {item!r} is not key=value with key in {sorted(ARM_KINDS[kind])}")
        params[key] = None if value.lower() == "none" else float(value)
        if key in ("cost_guard", "graded"):
            params[key] = bool(params[key])
    return ArmSpec(text, kind, params)


def infobatch_select(
    scores: np.ndarray, known: np.ndarray, ratio: float, draws: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The InfoBatch rule for one epoch: ``(kept indices, their weights)``.

    ``scores``: each sample's last training loss; ``known``: whether it has one. The threshold is
    the mean over every known score (a pruned sample keeps its old one); a known sample below it is
    pruned when its ``draw`` (uniform in [0, 1)) is below ``ratio``; kept below-mean samples weigh
    ``1/(1-ratio)``, every other sample 1. Unknown samples are always kept.
    """
    below = np.zeros(scores.size, dtype=bool)
    if known.any():
        below = known & (scores < scores[known].mean())
    pruned = below & (draws < ratio)
    kept = np.flatnonzero(~pruned)
    weights = np.where(below[kept], 1.0 / (1.0 - ratio), 1.0)
    return kept, weights


class InfoBatchRef:
    """The reference InfoBatch arm's state: scores per sample, updated from training losses only."""

    def __init__(self, n: int, epochs: int, ratio: float = 0.5, anneal: float = 0.875, seed: int = 0) -> None:
        self.scores = np.zeros(n)
        self.known = np.zeros(n, dtype=bool)
        self.ratio = ratio
        self.full_from = math.floor(anneal * epochs)  # epochs from here on train the full data
        self.rng = np.random.default_rng([seed, 7])

    def epoch(self, epoch: int, order: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The samples of this epoch in ``order`` (kept ones only) and their weights (None: all 1)."""
        draws = self.rng.random(order.size)
        if epoch >= self.full_from:
            return order, None
        kept, weights = infobatch_select(self.scores[order], self.known[order], self.ratio, draws)
        return order[kept], weights

    def feedback(self, index: np.ndarray, losses: np.ndarray) -> None:
        self.scores[index] = losses
        self.known[index] = True


def _free_scorer(model: nn.Module | None, batch: Any) -> torch.Tensor:
    """No forward: zeros (the uniform arm's policy ignores losses)."""
    return torch.zeros(len(batch["__key__"]), dtype=torch.float64)


# ---------------------------------------------------------------------------------- one run


def _lr_at(progress: float, peak: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    return peak * min(1.0, progress / WARMUP) * 0.5 * (1.0 + math.cos(math.pi * progress))


def run_arm(
    task: Task, data: Data, arm: ArmSpec, seed: int, *, quick: bool, evals: int, lr: float | None = None
) -> dict[str, Any]:
    """Train one arm for the task's budget; counters, curve and final metric."""
    torch.manual_seed(seed)
    model = task.make_model(quick, seed)
    peak = task.lr if lr is None else lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=task.weight_decay)
    n = len(data.y)
    epochs = task.quick_epochs if quick else task.epochs
    batch = task.batch
    total = n * epochs
    order_gen = torch.Generator().manual_seed(seed)
    aug_gen = torch.Generator().manual_seed(seed + 1000)

    sifter: sp.Sifter | None = None
    ref: InfoBatchRef | None = None
    feed = batch  # rows per batch the selector gets
    if arm.kind == "recipe":
        params = dict(arm.params)
        # steps=1: every training batch is one input batch whose kept rows are one step (no
        # re-batching): the full run's steps, each on fewer rows
        same_steps = bool(params.pop("steps", 0))
        times = params.pop("feed", 1 if same_steps else FEED)
        if times != int(times) or times < 1:
            raise ValueError(f"arm {arm.label!r}: feed is a whole number of training batches >= 1: {times}")
        feed = batch * int(times)
        sifter = sp.recipe(
            model,
            task.scorer(),
            budget=total,
            batched=True,
            output_batch=None if same_steps else batch,
            seed=seed,
            **params,
        )
    elif arm.kind == "uniform":
        keep = arm.params.get("keep", 0.5)
        # fed as the recipe is (until 2026-12-05 one training batch at a time: 8x the stage's
        # calls, a cost the control paid and the recipe did not)
        times = arm.params.get("feed", FEED)
        if times != int(times) or times < 1:
            raise ValueError(f"arm {arm.label!r}: feed is a whole number of training batches >= 1: {times}")
        feed = batch * int(times)
        sifter = sp.Sifter(
            None,
            _free_scorer,
            sp.Uniform(keep),
            batched=True,
            micro_batch=None,
            output_batch=batch,
            seed=seed,
        )
    elif arm.kind == "infobatch_ref":
        ref = InfoBatchRef(n, epochs, seed=seed, **arm.params)

    state = {"seen": 0, "trained": 0, "scored": 0}
    steps_taken = 0  # optimizer steps
    points: list[dict[str, float]] = []
    paused = 0.0
    trained_per_epoch: list[int] = []
    spread_per_epoch: list[float | None] = []
    hard_per_epoch: list[float | None] = []
    next_eval = 0
    noisy_trained = 0

    def evaluate() -> None:
        nonlocal paused
        t0, cpu_at = time.perf_counter(), time.process_time()
        # an evaluation is not the training step: off the stage's clock (stats.step_seconds,
        # saved_seconds and the recipe's cost guard), as it is off the run's (found by review,
        # 2026-12-06: it counted as step time, and the guard saw sifting pay more than it did)
        with sifter.off_clock() if sifter is not None else contextlib.nullcontext():
            got = task.evaluate(model, data.xt, data.yt)
        if sifter is not None and arm.kind != "uniform":
            # scoring forwards so far (the units to target count them): none in today's arms
            state["scored"] = sifter.stats.scored
        points.append(
            {
                "seen": state["seen"],
                "trained": state["trained"],
                "scored": state["scored"],
                "seconds": t0 - start - paused,
                **got,
            }
        )
        paused += time.perf_counter() - t0
        cpu_paused[0] += time.process_time() - cpu_at

    cpu_paused = [0.0]  # CPU seconds in evaluations, left out of cpu_seconds as out of seconds
    clock = {"select": 0.0, "feedback": 0.0}
    model.train()
    start = time.perf_counter()
    cpu0 = time.process_time()
    for epoch in range(epochs):
        order = torch.randperm(n, generator=order_gen)
        trained_before = state["trained"]
        seen_before = epoch * n
        weights_all: np.ndarray | None = None
        if ref is not None:
            picked, weights_all = ref.epoch(epoch, order.numpy())
            kept_n = max(1, picked.size)
            steps: Iterator[tuple[torch.Tensor, torch.Tensor | None, int]] = (
                (
                    torch.from_numpy(picked[at : at + batch]),
                    None if weights_all is None else torch.from_numpy(weights_all[at : at + batch]).float(),
                    seen_before + round(min(at + batch, picked.size) / kept_n * n),
                )
                for at in range(0, picked.size, batch)
            )
        else:

            def batches(order: torch.Tensor = order) -> Iterator[dict[str, Any]]:
                for idx in order.split(feed):
                    yield {
                        # the dataset index is the sample's key (what a map-style dataset has)
                        "__key__": idx,
                        "x": data.x[idx],
                        "y": data.y[idx],
                    }

            if sifter is None:
                steps = (
                    (b["__key__"], None, seen_before + min((k + 1) * batch, n))
                    for k, b in enumerate(batches())
                )
            else:
                sifter.set_epoch(epoch)
                start_stats = sifter.stats

                def sifted(
                    s: sp.Sifter = sifter, start: sp.SiftStats = start_stats, base: int = seen_before
                ) -> Iterator[Any]:
                    handed = at = 0
                    for b in s(batches()):
                        now = s.stats
                        seen, kept = now.seen - start.seen, now.kept - start.kept
                        handed += len(b["__key__"])
                        # the samples seen up to this step's: the stage decides a whole input batch
                        # before it hands the first rows on, so its seen count runs ahead by up to an
                        # input batch; the rows handed on, scaled by the pass's seen/kept, do not
                        # (never back: the scale moves when a batch keeps another share)
                        at = max(at, min(seen, n, round(handed * seen / max(kept, 1))))
                        yield b["__key__"], b.get("__sift_weight__"), base + at

                steps = sifted()
        for idx, weight, seen in _timed(steps, clock):
            # evaluation k happens before the step whose samples cross k/evals of the budget
            while next_eval < evals and seen > (next_eval / evals) * total:
                evaluate()
                next_eval += 1
            state["seen"] = seen
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(seen / total, peak)
            x, y = data.x[idx], data.y[idx]
            if task.augment is not None:
                x = task.augment(x, aug_gen)
            out = model(x)
            losses = task.per_sample_loss(out, y)
            loss = (losses * weight).mean() if weight is not None else losses.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps_taken += 1
            detached = losses.detach()
            t_feedback = time.perf_counter()
            if arm.kind == "recipe":
                assert sifter is not None
                sifter.observe(idx, detached)
            elif ref is not None:
                ref.feedback(idx.numpy(), detached.numpy().astype(np.float64))
            clock["feedback"] += time.perf_counter() - t_feedback
            state["trained"] += len(idx)
            noisy_trained += int(data.noisy[idx.numpy()].sum())
        state["seen"] = (epoch + 1) * n
        trained_per_epoch.append(state["trained"] - trained_before)
        if sifter is not None and sifter.memory is not None:
            spread = sifter.memory.measured_spread  # as last measured: reading it changes nothing
            spread_per_epoch.append(None if spread is None else round(spread, 4))
            hard = sifter.memory.persistent_hard()  # applied losses only: reading changes nothing
            hard_per_epoch.append(None if hard is None else round(hard, 4))
    seconds = time.perf_counter() - start - paused
    cpu_seconds = time.process_time() - cpu0 - cpu_paused[0]
    evaluate()
    stats = sifter.stats if sifter is not None else None
    if stats is not None:
        sifter.close()
    scored = stats.scored if (stats is not None and arm.kind != "uniform") else 0
    state["scored"] = scored
    points[-1]["scored"] = scored
    final = points[-1]
    row: dict[str, Any] = {
        "seed": seed,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "seen": state["seen"],
        "trained": state["trained"],
        "scored": scored,
        "units": 3 * state["trained"] + scored,
        "steps": steps_taken,
        "keep_rate": round(state["trained"] / state["seen"], 4),
        # wall time getting each step's batch (building it, and the selector) and handing losses back
        "select_seconds": round(clock["select"], 3),
        "feedback_seconds": round(clock["feedback"], 3),
        "trained_per_epoch": trained_per_epoch,
        "noisy_share_trained": round(noisy_trained / max(1, state["trained"]), 4),
        "final_metric": round(final["metric"], 5),
        "points": [{k: round(v, 5) if isinstance(v, float) else v for k, v in p.items()} for p in points],
    }
    if "token_accuracy" in final:
        row["final_token_accuracy"] = round(final["token_accuracy"], 5)
    if stats is not None:
        row["sifter"] = {
            "seen": stats.seen,
            "kept": stats.kept,
            "unknown": stats.unknown,
            "from_memory": stats.from_memory,
            "observed": stats.observed,
            "sifting_scale": round(stats.sifting_scale, 4),
            # the memory's spread (mean shortfall below the mean, in mean losses) as last measured
            # when each pass ended
            "spread_per_epoch": spread_per_epoch,
            # ScoreMemory.persistent_hard() when each pass ended: the share of training losses of
            # known samples above twice the mean, as their remembered loss was
            "persistent_hard_per_epoch": hard_per_epoch,
            # the stage's own account of whether it paid (wall seconds; SiftStats)
            "stage_seconds": round(stats.stage_seconds, 3),
            "step_seconds": round(stats.step_seconds, 3),
            "saved_seconds": round(stats.saved_seconds, 3),
            "net_seconds": round(stats.net_seconds, 3),
        }
    return row


def _timed(steps: Iterator[Any], clock: dict[str, float]) -> Iterator[Any]:
    """``steps``, adding the wall time spent producing each item to ``clock["select"]``."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(steps)
        except StopIteration:
            clock["select"] += time.perf_counter() - t0
            return
        clock["select"] += time.perf_counter() - t0
        yield item


def to_target(points: Sequence[dict[str, float]], target: float, lower: bool) -> dict[str, float] | None:
    """Counters when the metric first reached ``target`` (interpolated from the evaluation before)."""
    before = None
    for p in points:
        if (p["metric"] <= target) if lower else (p["metric"] >= target):
            if before is None:
                f = 1.0
                before = p
            else:
                gap = p["metric"] - before["metric"]
                f = (target - before["metric"]) / gap if gap else 1.0
                f = min(max(f, 0.0), 1.0)
            out = {k: before[k] + f * (p[k] - before[k]) for k in ("seconds", "seen", "trained", "scored")}
            out["units"] = 3 * out["trained"] + out["scored"]
            return out
        before = p
    return None


# ---------------------------------------------------------------------------------- suite


def _median(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    m = statistics.median(vals)
    return None if math.isinf(m) else round(m, 4)


def run_task(task: Task, arms: list[ArmSpec], seeds: list[int], args: argparse.Namespace) -> dict[str, Any]:
    data = task.make_data(args.quick)
    lower = task.kind == "lm"
    runs: dict[str, list[dict[str, Any]]] = {a.label: [] for a in arms}
    evals = 6 if args.quick else args.evals
    for seed in seeds:
        done: dict[str, dict[str, Any]] = {}
        # full first (the target), recipe arms before uniform (uniform copies recipe's keep rate)
        ordered = sorted(arms, key=lambda a: ("full", "recipe", "infobatch_ref", "uniform").index(a.kind))
        for arm in ordered:
            spec = keep_copied(arm, done)
            row = run_arm(task, data, spec, seed, quick=args.quick, evals=evals)
            if spec is not arm:
                row["keep"] = spec.params["keep"]
            done[arm.label] = row
            print(
                f"[{task.name} seed {seed}] {arm.label:<28} {row['seconds']:6.1f} s  "
                f"metric {row['final_metric']:.4f}  keep {row['keep_rate']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        full = done.get("full")
        for label, row in done.items():
            if full is not None:
                final = full["final_metric"]
                target = final if lower else final - MARGIN
                row["target"] = round(target, 5)
                row["final_gap"] = round(row["final_metric"] - final, 5)  # vs the full run, same seed
                hit = to_target(row["points"], target, lower)
                full_hit = to_target(full["points"], target, lower)
                row["to_target"] = None if hit is None else {k: round(v, 2) for k, v in hit.items()}
                if full_hit is not None:
                    for k in ("seconds", "units", "seen", "trained"):
                        row[f"{k}_ratio"] = (
                            math.inf if hit is None else round(hit[k] / max(full_hit[k], 1e-9), 4)
                        )
            runs[label].append(row)
    summary: dict[str, Any] = {}
    for label, rows in runs.items():
        reached = sum(1 for r in rows if r.get("to_target"))
        summary[label] = {
            "reached": f"{reached}/{len(rows)}",
            "time_ratio": _median([r.get("seconds_ratio", math.nan) for r in rows]),
            "units_ratio": _median([r.get("units_ratio", math.nan) for r in rows]),
            "seen_ratio": _median([r.get("seen_ratio", math.nan) for r in rows]),
            "trained_ratio": _median([r.get("trained_ratio", math.nan) for r in rows]),
            "worst_time_ratio": max((r.get("seconds_ratio", math.nan) for r in rows), default=None),
            "worst_units_ratio": max((r.get("units_ratio", math.nan) for r in rows), default=None),
            "seconds": _median([r["seconds"] for r in rows]),
            "select_seconds": _median([r["select_seconds"] for r in rows]),
            "feedback_seconds": _median([r["feedback_seconds"] for r in rows]),
            "keep_rate": _median([r["keep_rate"] for r in rows]),
            "scored": _median([r["scored"] for r in rows]),
            "final_metric": _median([r["final_metric"] for r in rows]),
            "final_gap": _median([r.get("final_gap", math.nan) for r in rows]),
            "noisy_share_trained": _median([r["noisy_share_trained"] for r in rows]),
        }
        for k in ("worst_time_ratio", "worst_units_ratio"):
            v = summary[label][k]
            summary[label][k] = None if v is None or math.isinf(v) or math.isnan(v) else v
    for rows in runs.values():
        for r in rows:
            for k in ("seconds_ratio", "units_ratio", "seen_ratio", "trained_ratio"):
                if k in r and math.isinf(r[k]):
                    r[k] = None  # not reached (JSON has no infinity)
    return {
        "definition": {
            "doc": " ".join(task.doc.split()),
            "kind": task.kind,
            "metric": "eval loss (lower is better)" if lower else "test accuracy",
            "target": "full run's final eval loss" if lower else "full run's final accuracy - 0.5 pt",
            "samples": len(data.y),
            "test_samples": len(data.yt),
            "epochs": task.quick_epochs if args.quick else task.epochs,
            "batch": task.batch,
            "lr": task.lr,
            "weight_decay": task.weight_decay,
            "parameters": sum(p.numel() for p in task.make_model(args.quick, 0).parameters()),
        },
        "runs": runs,
        "summary": summary,
    }


def targets(tasks: dict[str, Any], arm: str = "recipe", ref: str = "infobatch_ref") -> dict[str, Any]:
    """Issue 12's targets for ``arm``, on wall time and on compute units."""
    out: dict[str, Any] = {"arm": arm}
    for measure, row_key in (("time", "seconds_ratio"), ("units", "units_ratio")):
        per_task: dict[str, float] = {}
        never_over = True
        ahead = 0
        compared = 0
        for name, t in tasks.items():
            s = t["summary"].get(arm)
            if s is None:
                continue
            rows = t["runs"][arm]
            ratios = [math.inf if r.get(row_key) is None else r[row_key] for r in rows]
            m = statistics.median(ratios) if ratios else math.inf
            per_task[name] = m
            never_over &= all(r <= 1.0 for r in ratios)
            if ref in t["runs"]:
                ref_ratios = [math.inf if r.get(row_key) is None else r[row_key] for r in t["runs"][ref]]
                compared += 1
                ahead += m < statistics.median(ref_ratios)
        if not per_task:
            continue
        med = statistics.median(per_task.values())
        out[measure] = {
            "per_task_median": {k: (None if math.isinf(v) else round(v, 4)) for k, v in per_task.items()},
            "median_over_tasks": None if math.isinf(med) else round(med, 4),
            "median_le_0.65": med <= 0.65,
            "every_task_le_0.90": all(v <= 0.90 for v in per_task.values()),
            "never_over_1.0": never_over,
            f"ahead_of_{ref}": f"{ahead}/{compared}",
            f"ahead_of_{ref}_on_3_of_4": compared > 0 and ahead >= 0.75 * compared,
        }
        out[measure]["all_met"] = all(
            out[measure][k]
            for k in ("median_le_0.65", "every_task_le_0.90", "never_over_1.0", f"ahead_of_{ref}_on_3_of_4")
        )
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for name, t in report["tasks"].items():
        d = t["definition"]
        lines += [
            f"### {name}",
            "",
            f"{d['samples']:,} samples x {d['epochs']} epochs, batch {d['batch']}, lr {d['lr']:g}; "
            f"metric: {d['metric']}; target: {d['target']}.",
            "",
            "| arm | reached | time / full | units / full | seen / full | trained / full | worst time | "
            "keep rate | scoring fwd | final metric | final - full | wall s | select+feedback s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]

        def f(v: Any, p: str = ".2f") -> str:
            return "—" if v is None else format(v, p)

        for arm, s in t["summary"].items():
            got, runs = (int(v) for v in s["reached"].split("/"))
            # a seed that never reached the target is the worst: "never", not a blank
            worst = "never" if got < runs else f(s["worst_time_ratio"])
            lines.append(
                f"| {arm} | {s['reached']} | {f(s['time_ratio'])} | {f(s['units_ratio'])} | "
                f"{f(s['seen_ratio'])} | {f(s['trained_ratio'])} | {worst} | "
                f"{f(s['keep_rate'], '.3f')} | {f(s['scored'], '.0f')} | {f(s['final_metric'], '.4f')} | "
                f"{f(s.get('final_gap'), '+.4f')} | "
                f"{f(s['seconds'], '.1f')} | "
                f"{f((s['select_seconds'] or 0) + (s['feedback_seconds'] or 0), '.1f')} |"
            )
        lines.append("")
    arms = list(next(iter(report["tasks"].values()))["summary"]) if report["tasks"] else []
    lines += [
        "### Across tasks (medians over seeds; time / units to target vs full)",
        "",
        "| arm | " + " | ".join(report["tasks"]) + " | median | worst |",
        "| --- | " + " | ".join("---" for _ in report["tasks"]) + " | --- | --- |",
    ]
    for measure, key in (("time", "time_ratio"), ("units", "units_ratio")):
        for arm in arms:
            vals = [t["summary"][arm][key] for t in report["tasks"].values()]
            inf_vals = [math.inf if v is None else v for v in vals]
            med = statistics.median(inf_vals)
            cells = ["never" if v is None else f"{v:.2f}" for v in vals]
            lines.append(
                f"| {arm} ({measure}) | "
                + " | ".join(cells)
                + f" | {'never' if math.isinf(med) else f'{med:.2f}'} | "
                + f"{'never' if math.isinf(max(inf_vals)) else f'{max(inf_vals):.2f}'} |"
            )
    lines.append("")
    for measure in ("time", "units"):
        tg = report["targets"].get(measure)
        if tg:
            lines.append(
                f"Targets ({measure}, arm `{report['targets']['arm']}`): median over tasks "
                f"{tg['median_over_tasks']} (<= 0.65: {tg['median_le_0.65']}), every task <= 0.90: "
                f"{tg['every_task_le_0.90']}, never > 1.0: {tg['never_over_1.0']}, ahead of "
                f"infobatch_ref: {tg['ahead_of_infobatch_ref']} ({tg['ahead_of_infobatch_ref_on_3_of_4']}); "
                f"all met: {tg['all_met']}."
            )
    return "\n".join(lines) + "\n"


def sweep(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The full arm's LR sweep per task (seeds ``--seeds``): final metric per learning rate."""
    out: dict[str, Any] = {}
    for name in names:
        task = TASKS[name]
        data = task.make_data(args.quick)
        out[name] = {}
        for lr in args.lrs or task.sweep:
            finals = []
            for seed in range(args.seeds):
                row = run_arm(task, data, ArmSpec("full", "full", {}), seed, quick=args.quick, evals=1, lr=lr)
                finals.append(row["final_metric"])
                print(
                    f"[sweep {name}] lr {lr:g} seed {seed}: {row['final_metric']:.4f} "
                    f"({row['seconds']:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            out[name][f"{lr:g}"] = round(statistics.fmean(finals), 5)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=None, help="seeds (default 3; 1 with --quick)")
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=sorted(TASKS))
    ap.add_argument("--arms", nargs="+", default=["full", "recipe", "infobatch_ref", "uniform"])
    ap.add_argument("--evals", type=int, default=16, help="evaluations over the budget (plus the final one)")
    ap.add_argument("--quick", action="store_true", help="tiny tasks, 4 epochs, 1 seed (for the tests)")
    ap.add_argument("--sweep", action="store_true", help="LR sweep of the full arm per task, then exit")
    ap.add_argument("--lrs", type=float, nargs="+", default=None, help="--sweep these instead of the task's")
    ap.add_argument(
        "--epochs", type=int, default=None, help="every task's budget in epochs (default: each task's own)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="", help="also write the JSON report here")
    ap.add_argument("--markdown", default="", help="write markdown tables here ('-': stderr)")
    args = ap.parse_args(argv)
    check_writable(out=args.out, markdown=args.markdown)
    torch.set_num_threads(args.threads)
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.epochs is not None:
        if args.epochs < 1:
            raise SystemExit("--epochs: a whole number of passes >= 1")
        for name in args.tasks:
            TASKS[name] = dataclasses.replace(TASKS[name], epochs=args.epochs, quick_epochs=args.epochs)
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    if args.sweep:
        report: dict[str, Any] = {"sweep": sweep(args.tasks, args)}
        print(json.dumps(report, indent=1))
        return report
    arms = [parse_arm(a) for a in args.arms]
    if len({a.label for a in arms}) != len(arms):
        raise SystemExit("each arm once, please")
    seeds = list(range(args.seeds))
    tasks = {name: run_task(TASKS[name], arms, seeds, args) for name in args.tasks}
    report = {
        "command": " ".join(["python", "tools/bench_suite.py", *(sys.argv[1:] if argv is None else argv)]),
        "seeds": seeds,
        "arms": [a.label for a in arms],
        "schedule": "AdamW, linear warm-up 5% then cosine to 0, by samples seen (every arm ends its "
        "schedule at the last epoch); rows per step = the task's batch for every arm",
        "units": "trained x 3 + scoring forwards x 1",
        "tasks": tasks,
        "targets": targets(tasks) if any(a.label == "recipe" for a in arms) else {},
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_1min_before": round(load_before, 2),
            "load_average_1min_after": round(os.getloadavg()[0], 2),
        },
        "bench_seconds": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(report, indent=1)
    print(text, flush=True)  # first: the run's figures are on stdout whatever happens to the file
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.markdown:
        md = markdown(report)
        if args.markdown == "-":
            print(md, file=sys.stderr)
        else:
            with open(args.markdown, "w") as fh:
                fh.write(md)
    return report


if __name__ == "__main__":
    main()
