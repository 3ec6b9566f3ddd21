"""Overhead of the sift stage itself, measured side by side in one run on one core.

Prints one JSON object:
  passthrough_samples_per_s   a bare generator over the same samples
  per_sample_samples_per_s    the stage in per-sample mode with a scorer that costs nothing
                              (each sample carries its precomputed loss)
  batched_samples_per_s       the stage in batched mode (worker batches of --batch rows)
  batched_256_samples_per_s   the same with worker batches of 256 rows
  per_micro_batch_us          the stage's own cost per micro-batch of 256 rows: the batched_256 run
                              minus a bare loop over the same batches that calls the same scorer
                              and takes its losses to numpy (interleaved with it, best of each)
  model_scoring_ratio         stage throughput with a real model (3-layer MLP of --width, micro-batch
                              256; width 256 takes about 1 ms per forward on this 2-core VM) divided
                              by calling that model directly on the same micro-batches
  model_per_micro_batch_us    the stage's cost per micro-batch beyond that direct call
  rss_mib_after_tenth, rss_mib_at_end, rss_growth   the process's resident memory in a batched run of
                              --rss-samples: after its first tenth (1M of the default 10M), and the
                              highest from then to its end (sampled every 64 batches)
  recipe_us_per_sample        the recipe's stage (InfoBatch, graded, ratio 0.5, over a score memory;
                              no scoring forward) per sample seen, in CPU microseconds: 8 epochs of
                              32,000 string-keyed samples in batches of 128 (tools/bench_suite.py's
                              tabular shape), re-batched to 128, observe() per output batch, minus a
                              bare loop building the same batches and key lists (best of --repeats,
                              alternating; CPU time, which other tenants of a VM disturb less)
  recipe_index_keys_us_per_sample   the same with each sample's dataset index as its key (the
                              batch's "__key__" an int64 tensor, as tools/bench_suite.py feeds it)
  recipe_index_keys_1024_us_per_sample   the same with input batches of 1024 rows re-batched to 128
                              (a loader batch 8x the training batch: the stage's fixed cost per
                              input batch shared by 8x the rows)
  recipe_index_list_1024_us_per_sample   the same with observe() given the index as a list of
                              Python ints (tensor.tolist(), as tools/bench_gpu.py hands them)

  mode_switch_us, eval_train_us   putting a ResNet-50-sized tree of modules (164: 23 blocks of
                              conv, batch-norm, ReLU) in eval mode and back around a scoring
                              forward: the stage's switch (siftpipe.core.scoring.EvalMode), and
                              model.eval() then model.train() (what it did before), side by side

Usage: python tools/bench_overhead.py [--samples 2000000] [--repeats 3] [--only CASE ...]
CASE: passthrough, per_sample, batched, batched_256, model, rss, recipe, modes (default: all).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import siftpipe as sp
from siftpipe.demo import build_model

CASES = ("passthrough", "per_sample", "batched", "batched_256", "model", "rss", "recipe", "modes")


def rss_mib() -> float:
    """The process's resident memory now, in MiB (Linux; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_rate(fn, n: int, repeats: int) -> float:
    """Samples per second of the fastest of ``repeats`` runs of ``fn`` (which handles n samples)."""
    return n / best_time(fn, repeats)


def side_by_side(bare, staged, repeats: int) -> tuple[float, float]:
    """Best seconds of ``bare`` and of ``staged``, run alternately so that drift in the machine's
    speed hits both alike."""
    bare_s, staged_s = float("inf"), float("inf")
    for _ in range(repeats):
        bare_s = min(bare_s, best_time(bare, 1))
        staged_s = min(staged_s, best_time(staged, 1))
    return bare_s, staged_s


def precomputed(model, batch):
    return batch if isinstance(batch, torch.Tensor) else batch["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2_000_000, help="samples per throughput run")
    ap.add_argument("--batch", type=int, default=512, help="rows per worker batch in batched mode")
    ap.add_argument("--width", type=int, default=256, help="MLP width for model_scoring_ratio")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rss-samples", type=int, default=10_000_000, help="samples for the memory check")
    ap.add_argument("--only", nargs="+", choices=CASES, default=list(CASES), help="run only these cases")
    args = ap.parse_args()
    only = set(args.only)
    torch.set_num_threads(1)
    n = args.samples
    rng = np.random.default_rng(0)
    result: dict[str, float | int | str] = {}

    # per-sample stream: each sample is its own precomputed loss (a float)
    losses = rng.exponential(size=n).tolist() if only & {"passthrough", "per_sample"} else []

    def passthrough():
        for _ in (x for x in losses):
            pass

    def per_sample():
        s = sp.Sifter(None, precomputed, sp.RelativeProbabilistic(1.0, 500), micro_batch=256, key=None)
        for _ in s(losses):
            pass

    # batched stream: worker batches with a key list, a feature tensor and the loss
    def make_batches(rows):
        return [
            {
                "__key__": [f"k{i}" for i in range(b * rows, (b + 1) * rows)],
                "x": torch.zeros(rows, 8),
                "loss": torch.from_numpy(rng.exponential(size=rows)),
            }
            for b in range(256)
        ]

    def batch_stream(batches, count):
        for i in range(count):
            yield batches[i % len(batches)]

    def staged_run(batches, count):
        def run():
            s = sp.Sifter(
                None, precomputed, sp.RelativeProbabilistic(1.0, 500), micro_batch=None, batched=True
            )
            for _ in s(batch_stream(batches, count)):
                pass

        return run

    if "passthrough" in only:
        result["passthrough_samples_per_s"] = best_rate(passthrough, n, args.repeats)
    if "per_sample" in only:
        result["per_sample_samples_per_s"] = best_rate(per_sample, n, args.repeats)
    if "batched" in only:
        rows = args.batch
        count = n // rows
        result["batched_samples_per_s"] = best_rate(
            staged_run(make_batches(rows), count), count * rows, args.repeats
        )
        result["batched_rows_per_batch"] = rows
    if "batched_256" in only:
        rows = 256
        count = n // rows
        batches = make_batches(rows)

        def bare():
            # what any loop over these batches pays anyway: the scorer call and its losses in numpy
            for batch in batch_stream(batches, count):
                precomputed(None, batch).numpy()

        bare_s, staged_s = side_by_side(bare, staged_run(batches, count), args.repeats)
        result["batched_256_samples_per_s"] = count * rows / staged_s
        result["bare_256_samples_per_s"] = count * rows / bare_s
        result["per_micro_batch_us"] = (staged_s - bare_s) / count * 1e6

    if "model" in only:
        # a real model whose forward on a micro-batch of 256 takes about a millisecond here
        torch.manual_seed(0)
        width = args.width
        model = build_model(width, 10, width, depth=2)  # width-width-width-10
        mb = 256
        model_batches = [(torch.randn(mb, width), torch.randint(0, 10, (mb,))) for _ in range(200)]
        scorer = sp.CrossEntropy(0, 1)

        def direct():
            model.eval()
            with torch.inference_mode():
                for x, y in model_batches:
                    F.cross_entropy(model(x), y, reduction="none").cpu().numpy()

        def staged():
            s = sp.Sifter(
                model, scorer, sp.RelativeProbabilistic(1.0, 500), micro_batch=None, batched=True, key=None
            )
            for _ in s(model_batches):
                pass

        model_n = mb * len(model_batches)
        direct_s, staged_s = side_by_side(direct, staged, args.repeats)
        t0 = time.perf_counter()
        direct()
        result["model_forward_ms_per_micro_batch"] = (time.perf_counter() - t0) / len(model_batches) * 1e3
        result["model_direct_samples_per_s"] = model_n / direct_s
        result["model_staged_samples_per_s"] = model_n / staged_s
        result["model_scoring_ratio"] = direct_s / staged_s
        result["model_per_micro_batch_us"] = (staged_s - direct_s) / len(model_batches) * 1e6

    if "rss" in only:
        # memory: peak RSS must not grow with the stream (history, buffers and queues are bounded)
        total = args.rss_samples // args.batch
        s = sp.Sifter(
            None, precomputed, sp.RelativeProbabilistic(1.0, 100_000), micro_batch=None, batched=True
        )
        marks = {}
        tenth = args.rss_samples // 10
        # the process's resident memory now, not its peak since it started: the cases run before
        # this one set that peak, and hid this run's growth (found by review, 2026-12-05)
        highest = 0.0
        for i, _ in enumerate(s(batch_stream(make_batches(args.batch), total))):
            if s.stats.seen >= tenth and "rss_mib_after_tenth" not in marks:
                marks["rss_mib_after_tenth"] = highest = rss_mib()
            elif i % 64 == 0 and "rss_mib_after_tenth" in marks:
                highest = max(highest, rss_mib())
        marks["rss_mib_at_end"] = max(highest, rss_mib())
        marks["rss_samples"] = s.stats.seen
        result.update(marks)
        result["rss_growth"] = marks["rss_mib_at_end"] / marks["rss_mib_after_tenth"] - 1

    if "recipe" in only:
        result.update(recipe_cost(args.repeats))
    if "modes" in only:
        result.update(mode_switch_cost(args.repeats))

    if {"per_sample", "passthrough"} <= only:
        result["per_sample_vs_passthrough"] = (
            result["per_sample_samples_per_s"] / result["passthrough_samples_per_s"]
        )
    result["torch_threads"] = torch.get_num_threads()
    result["torch"] = torch.__version__
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, indent=1))


def mode_switch_cost(repeats: int) -> dict[str, float]:
    """µs to put a 164-module model in eval mode and back: the stage's switch and eval()/train()."""
    from torch import nn

    from siftpipe.core.scoring import EvalMode

    def block() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        )  # fmt: skip

    model = nn.Sequential(*[block() for _ in range(23)], nn.Flatten(), nn.Linear(8, 10)).train()
    calls = 500

    def switch() -> None:
        for _ in range(calls):
            EvalMode.enter(model).leave()  # type: ignore[union-attr]

    def eval_train() -> None:
        for _ in range(calls):
            model.eval()
            model.train()

    old_s, new_s = side_by_side(eval_train, switch, repeats)
    return {"mode_switch_us": new_s / calls * 1e6, "eval_train_us": old_s / calls * 1e6}


def recipe_cost(repeats: int) -> dict[str, float]:
    """CPU µs per sample seen of the recipe's stage, beyond building its input (see the docstring),
    with string keys and with the dataset index as the key."""
    return {
        "recipe_us_per_sample": recipe_cost_of(repeats, index_keys=False),
        "recipe_index_keys_us_per_sample": recipe_cost_of(repeats, index_keys=True),
        "recipe_index_keys_1024_us_per_sample": recipe_cost_of(repeats, index_keys=True, rows=1024),
        "recipe_index_list_1024_us_per_sample": recipe_cost_of(
            repeats, index_keys=True, rows=1024, observe_list=True
        ),
    }


def recipe_cost_of(repeats: int, index_keys: bool, rows: int = 128, observe_list: bool = False) -> float:
    """CPU µs per sample seen, keys strings (``index_keys`` False) or the index tensor, input
    batches of ``rows`` handed on in batches of 128; ``observe_list``: observe() gets the index
    as a list of Python ints (``tensor.tolist()``, as tools/bench_gpu.py hands them)."""
    n, epochs = 32_000, 8
    # the stage's account warns that sifting does not pay here (nothing is trained): expected
    logging.getLogger("siftpipe").setLevel(logging.ERROR)
    keys = [f"{i:07d}" for i in range(n)]
    x, y = torch.randn(n, 30), torch.randint(0, 6, (n,))
    base = np.random.default_rng(0).exponential(size=n)

    def batches(order: torch.Tensor):
        for idx in order.split(rows):
            key = idx if index_keys else [keys[i] for i in idx.tolist()]
            yield {"__key__": key, "i": idx, "x": x[idx], "y": y[idx]}

    def staged() -> None:
        sifter = sp.Sifter(
            None,
            "cross_entropy",
            sp.InfoBatch(0.5, n * epochs, 0.875, 0.5, graded=True, min_spread=0.25),  # sp.recipe's policy
            memory=sp.ScoreMemory(n, max_age=None),
            unknown="keep",
            remember_forward=False,
            batched=True,
            output_batch=128,
            seed=0,
        )
        gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(1)
        for epoch in range(epochs):
            sifter.set_epoch(epoch)
            for batch in sifter(batches(torch.randperm(n, generator=gen))):
                idx = batch["i"]
                # losses that shrink over epochs, with noise: some below the mean, some above
                got = base[idx.numpy()] * 0.7**epoch * rng.uniform(0.5, 1.5, size=len(idx))
                if observe_list:
                    handed: Any = idx.tolist()
                else:
                    handed = idx if index_keys else [keys[i] for i in idx.tolist()]
                sifter.observe(handed, torch.from_numpy(got))

    def bare() -> None:
        gen = torch.Generator().manual_seed(0)
        for _ in range(epochs):
            for batch in batches(torch.randperm(n, generator=gen)):
                if not index_keys:
                    [keys[i] for i in batch["i"].tolist()]
                elif observe_list:
                    batch["i"].tolist()  # the list the loop hands observe() (its cost, not the stage's)

    def cpu(fn) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    bare_s = staged_s = float("inf")
    for _ in range(repeats):
        bare_s = min(bare_s, cpu(bare))
        staged_s = min(staged_s, cpu(staged))
    return (staged_s - bare_s) / (n * epochs) * 1e6


if __name__ == "__main__":
    main()
