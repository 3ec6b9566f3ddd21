"""The stage's counters as users read them: ``SiftStats``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["SiftStats"]


@dataclass(frozen=True, repr=False)
class SiftStats:
    """Counters of a stage, in samples unless the name says otherwise.

    Attributes:
        seen: Samples scored and decided (warm-up included).
        kept: Samples decided "keep".
        dropped: Samples decided "drop".
        nan: Samples whose loss was NaN or infinite (handled by ``on_nan``).
        warmup: Samples kept because they arrived during the ``delay`` warm-up.
        micro_batches: Micro-batches decided (a split after out-of-memory counts once).
        score_seconds: Wall time collating, moving and scoring micro-batches.
        decide_seconds: Wall time in the policy and bookkeeping.
        scored: Samples that needed a scoring forward pass.
        from_memory: Samples decided from the score memory, with no forward pass.
        observed: Losses handed back by the training step (``observe``).
        shards_skipped: Shards the watched pipelines' handler skipped (``warn_and_continue``),
            counted in every process that read them, DataLoader workers included (see
            ``Sifter.watch_shards``; ``.sift()`` and the source of a pass are watched for you).
            Their samples never reach the stage, so they have no audit records; the audit log's
            manifests list them. Not part of the state: counted since the pipeline was built.
        samples_skipped: Samples the watched pipelines' handler skipped because a field could
            not be decoded or was missing.
        unknown: Samples kept with no loss at all (``unknown="keep"``: the score memory did not
            know them yet).
        sifting_scale: How much of its configured dropping of learned samples the policy is
            doing now, in [0, 1]: 1 for policies without a guard; a guarded policy
            (``siftpipe.recipe``) lowers it when the samples it dropped are being forgotten, and 0
            means it prunes none for being learned because the losses do not tell samples apart
            (``InfoBatch(min_spread=...)``; also logged as a warning by ``siftpipe``), and once the
            cost guard stopped sifting (``stopped_at``: then nothing at all is pruned). Not
            lowered by the anneal (the budget's last part keeps every sample by design);
            ``InfoBatch(noise_drop=...)``, opt-in, prunes samples it takes for mislabeled
            whatever it says. It counts the
            losses ``observe()`` handed back up to the stage's last decision (the memory applies
            them before each decision).
        stage_seconds: Wall time of the stage's own work in this process: scoring, deciding,
            re-batching, handing decisions to the audit log, and ``observe()``; not the time its
            source took to produce input (paid with or without sifting). Over the run, resumes
            included (the account is in the state).
        step_seconds: Wall time between the stage handing an item on and being asked for the
            next, less ``observe()``: the training step, as the stage sees it. On an accelerator
            the device's time shows where the loop waits for it (``observe()``'s copy of the
            losses counts as step); a stage that scores waits for the step's queued kernels too,
            and charges that wait to ``stage_seconds``.
        saved_seconds: Estimated training time the dropped samples would have cost:
            ``dropped x step_seconds / samples handed on`` (it assumes a step's time grows with
            its samples). ``net_seconds`` = ``saved_seconds - stage_seconds``; when it is
            negative at the end of the second (or a later) pass that dropped samples,
            ``siftpipe`` logs a warning once. These three are left out of ``==``.
        stopped_at: The sample (``seen``) at which ``cost_guard`` stopped sifting, 0 if it has
            not: from there every sample is kept with weight 1 (counted in ``kept``, not in
            ``unknown``, though the audit log gives them reason ``unknown``) and
            ``sifting_scale`` is 0. It is in the state; a stage resumed from it with
            ``cost_guard=False`` sifts again.
        unhanded: Samples decided kept (counted in ``kept``, recorded as kept) that were never
            handed on, because their pass was left before them (``break``, ``EqualSteps`` ending
            an epoch, ``close()``) or were its short last batch under ``drop_last``: at most the
            rest of one input batch or micro-batch, and an output batch being filled, per pass.
            The audit log records their seq ranges, and
            ``read_log`` and ``replay`` read them as not kept.
        persistent_hard: With a score memory: the share of the training losses handed back for
            samples trained in an earlier epoch that stayed above twice the mean loss, as their
            last loss was (``ScoreMemory.persistent_hard``): samples the model does not learn,
            mislabeled ones most often. None before there is evidence. Like ``sifting_scale``
            it counts the losses applied by the stage's last decision. From 0.15 on, ``siftpipe``
            logs once that sifting may not pay: on siftpipe's benchmark suite it ended at most
            0.11 on tasks with clean labels and at 0.20-0.25 on classification tasks with 20% of
            the labels wrong (where it passed 0.15 in the 4th to 6th of 8 epochs), tasks on
            which sifting did not reliably save time to accuracy (docs/benchmarks.md).
    """

    seen: int
    kept: int
    dropped: int
    nan: int
    warmup: int
    micro_batches: int
    # wall-clock times: left out of == (see below)
    score_seconds: float = dataclasses.field(compare=False)
    decide_seconds: float = dataclasses.field(compare=False)
    scored: int = 0
    from_memory: int = 0
    observed: int = 0
    shards_skipped: int = 0
    samples_skipped: int = 0
    unknown: int = 0
    sifting_scale: float = 1.0
    # wall-clock estimates: left out of ==, so that two stages that decided alike compare equal
    stage_seconds: float = dataclasses.field(default=0.0, compare=False)
    step_seconds: float = dataclasses.field(default=0.0, compare=False)
    saved_seconds: float = dataclasses.field(default=0.0, compare=False)
    stopped_at: int = 0
    unhanded: int = 0
    persistent_hard: float | None = None

    @property
    def net_seconds(self) -> float:
        """saved_seconds - stage_seconds: what sifting has saved so far, net of its own cost
        (negative: it is costing more wall time than it saves)."""
        return self.saved_seconds - self.stage_seconds

    @property
    def keep_rate(self) -> float:
        """kept / seen (1.0 before anything was seen)."""
        return self.kept / self.seen if self.seen else 1.0

    def __repr__(self) -> str:
        # the dataclass repr leaves out properties: keep_rate is the figure people print stats for
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"SiftStats({fields}, keep_rate={self.keep_rate:.4f})"
