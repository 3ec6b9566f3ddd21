"""The default recipe: one stage configuration, chosen by the cross-task suite (tools/bench_suite.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ConfigError
from .memory import ScoreMemory
from .policies import InfoBatch, integer_count, real_number
from .scorers import Scorer
from .stage import Sifter

__all__ = ["recipe"]

#: The recipe's settings: the configuration that did best across tools/bench_suite.py's tasks
#: (docs/suite.md, "Recipe variants"; docs/benchmarks.md has the reading).
DEFAULTS: dict[str, float] = {"ratio": 0.35, "warmup": 0.0, "anneal": 0.875, "guard": 0.5, "min_spread": 0.25}


def recipe(
    model: nn.Module | None,
    scorer: Scorer | str,
    *,
    budget: int,
    capacity: int | None = None,
    ratio: float = DEFAULTS["ratio"],
    warmup: float = DEFAULTS["warmup"],
    anneal: float = DEFAULTS["anneal"],
    guard: float | None = DEFAULTS["guard"],
    cost_guard: bool = True,
    graded: bool = True,
    min_spread: float | None = DEFAULTS["min_spread"],
    noise_drop: float | None = None,
    **sifter_kwargs: Any,
) -> Sifter:
    """A ``Sifter`` set up as siftpipe's default recipe: no scoring forward, ever.

    Every loss comes from the training step: call ``sifter.observe(keys, per_sample_losses)`` after
    each step and ``sifter.set_epoch(epoch)`` before each pass. A sample the stage has never seen
    trained is kept; a below-mean sample is pruned with a probability that grows with how far
    below the mean its loss is (``ratio`` at loss 0) and the kept ones reweighted (``InfoBatch``
    with ``graded=True``); after ``anneal`` of the budget every sample is trained; nothing is
    pruned while the losses do not tell samples apart (``min_spread``); a guard backs pruning
    off when the samples it dropped are being forgotten (``stats.sifting_scale``), and another
    stops sifting when the stage costs more wall time than it saves (``cost_guard``).

    Args:
        model: The live model (passed to ``Sifter``; the recipe never runs a scoring forward).
        scorer: The scorer ``Sifter`` holds (unused by the recipe, kept for ``unknown="score"``
            overrides and for the audit log's records of where losses come from).
        budget: Samples this stage will see over the whole run (epochs x samples per epoch on
            this rank).
        capacity: Samples the score memory can hold: one epoch of the samples it remembers
            is enough (this rank's; every rank's when the ranks share their memories, as
            ``EqualSteps`` and the integrations under DDP do by default). Default ``budget``
            (every sample of the run), which costs memory and time at each pass in proportion
            to the number of epochs: give one epoch's on long schedules.
        ratio: Most probability of pruning a below-mean sample (one with loss 0), in [0, 1).
        warmup: Fraction of the budget kept whole at the start, in [0, 1).
        anneal: Fraction of the budget after which nothing is pruned.
        guard: Forgetting tolerance of the guard, in mean losses (``InfoBatch``); None: off.
        cost_guard: Stop sifting for the rest of the run once the stage's own time exceeds the
            training time its dropped samples would have cost (``Sifter(cost_guard=...)``; judged
            from the second pass that drops samples, logged, ``stats.stopped_at``). Its timing
            depends on the machine; False keeps the run's decisions independent of timing. On
            one rank of several it only logs (ranks step together: one that stopped alone would
            save no step).
        graded: Prune each below-mean sample with probability ``ratio * (mean - loss) / mean``
            (True) or ``ratio`` (False: InfoBatch's step rule, as in the paper).
        min_spread: Keep every sample while the remembered losses sit less than this far below
            their mean on average, in mean losses (``ScoreMemory.spread()``): they do not tell
            samples apart, and pruning then costs accuracy (``InfoBatch``); None: no floor.
        noise_drop: Opt-in, for data with wrong labels: once samples that stay far above the
            mean loss abound (``stats.persistent_hard`` >= 0.15), prune a sample whose loss is
            above twice the mean with this probability, unweighted (``InfoBatch``); 0.9 was
            measured (docs/benchmarks.md). None (default): off.
        sifter_kwargs: Any other ``Sifter`` argument (``batched``, ``micro_batch``, ``audit``, ...).
    """
    count = integer_count(budget)  # a numpy or torch integer too (epochs * len(...) of arrays)
    if count is None or count < 1:
        raise ConfigError(
            f"budget must be the number of samples the stage will see in the run, got {budget!r}"
        )
    budget = count
    if real_number(warmup) is None or not (0.0 <= float(warmup) < 1.0):
        raise ConfigError(f"warmup must be a fraction of the budget in [0, 1), got {warmup!r}")
    for name in ("policy", "memory", "delay"):
        if name in sifter_kwargs:
            raise ConfigError(f"recipe() sets {name}= itself; build a Sifter directly to choose it")
    policy = InfoBatch(
        ratio=ratio,
        budget=budget,
        anneal=anneal,
        guard=guard,
        graded=graded,
        min_spread=min_spread,
        noise_drop=noise_drop,
    )
    memory = ScoreMemory(capacity=capacity if capacity is not None else budget, max_age=None)
    sifter_kwargs.setdefault("unknown", "keep")
    sifter_kwargs.setdefault("remember_forward", False)
    sifter_kwargs.setdefault("cost_guard", cost_guard)
    # (the float product, not policies.fraction_of: the delay is a setting a resume checks, and
    # checkpoints made with it would be refused where the two differ by a sample; review, 2026-12-05)
    return Sifter(model, scorer, policy, memory=memory, delay=int(warmup * budget), **sifter_kwargs)
