"""Deciding, the stage's part: a group's losses (score memory, upstream decisions, scoring
forwards), the policy's decisions on them (NaN, warm-up, the cost guard's stop), the counters, and
each decided group written to the sink."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import (
    ConfigError,
    NonFiniteLossError,
    PolicyError,
    PreDecodeWarning,
    RepeatedKeyWarning,
    ScoreMemoryWarning,
    ScorerOutputError,
    SiftError,
    describe_keys,
)
from .decide import UNKNOWN, Decided, decide_rows
from .hostcopy import HostCopy
from .ledger import Group
from .memory import (
    FEEDBACK,
    NONE,
    SOURCES,
    STALE,
    ScoreMemory,
    pick_keys,
)
from .policies import Policy, RelativeProbabilistic
from .rows import (
    attach_weights,
    field_of,
    key_array,
    keys_of,
    upstream_marked,
    upstream_of,
    weight_changes_type,
)
from .scoring import Scoring
from .sink import Decisions, DecisionSink
from .state import COUNTS

__all__ = ["Decider"]

_log = logging.getLogger("siftpipe")


class Decider:
    """The deciding part of the stage: it owns the settings below (the ``Sifter`` exposes them as
    its own attributes; ``Sifter`` documents them), the generator and the counters.

    ``decide(group)`` fills the group's ``keep``, ``kept_index`` and ``weight`` (and the weight
    column, when weights are attached), counts it, and writes it to ``audit``.
    """

    def __init__(self, scoring: Scoring | None = None) -> None:
        #: The scoring part the losses of samples nothing remembers come from.
        self.scoring = scoring if scoring is not None else Scoring()
        self.policy: Policy = RelativeProbabilistic()
        self.memory: ScoreMemory | None = None
        self.delay = 0
        self.on_nan = "raise"
        self.key: Any = "__key__"
        self.weight_field = "__sift_weight__"
        self.attach_weight = False
        #: attach_weight follows the policy's ``weighted``, whenever the policy is set
        #: (``Sifter(attach_weight=None)``, the default)
        self.weight_auto = False
        self.remember_forward = True
        self.unknown = "score"
        self.cost_guard = False
        #: A tag recorded with each decision (set it to the optimizer step, say).
        self.model_version = -1
        #: The pass (epoch) number recorded with each decision; see ``Sifter.set_epoch``.
        self.epoch = 0
        #: Where decisions go (the audit log).
        self.audit: DecisionSink | None = None
        #: Where the scorer's losses come from, a ``memory.SOURCES`` code (a proxy says "proxy").
        self.loss_source = SOURCES.index("forward")
        self.rng = np.random.default_rng(0)
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.seconds = [0.0, 0.0]  # scoring, deciding
        # this pass's look-ups in the memory: [usable losses when it began, looked up, found]; a
        # whole pass finding none where earlier passes left some is a mistake worth a warning
        self._lookups = [0, 0, 0]
        self._warned_memory = False
        # the memory's count of repeated keys and the losses observed when this pass began, and
        # the most losses one observe() call has handed back in it
        self._repeated = (0, 0)
        self._largest_observe = 0
        self._warned_repeats = False
        self._warned_full = False
        # the memory's refusals when the first pass since the stage was made or loaded began
        # (_warn_full; None: take them at the next pass)
        self._refused_at: int | None = None
        #: The stage reached a ``PreDecodeFilter`` in its sources (it marks every row it hands on);
        #: groups decided since without its marks, until one carries them (then: None, done)
        self.upstream_filters = False
        self._weight_type_checked = False  # attach_weight's rows checked for a type it changes
        self._unattached_said = False  # _say_unattached warned
        self._unmarked: int | None = 0
        #: Passes that ran to their end (a warning's evidence, not state: the stage counts one for
        #: a loaded state that had seen samples)
        self.passes_ended = 0
        self._seen_at_pass = 0
        self._warned_feedback = False
        self._warned_hard = False
        #: Seconds the last ``decide`` waited for losses observe() queued on a CUDA device
        self.device_wait = 0.0

    @property
    def stopped(self) -> bool:
        """The cost guard stopped sifting (in this run, or in the one the state came from) and is
        on: a stage resumed with ``cost_guard=False`` sifts again."""
        return self.cost_guard and self.counts["stopped_at"] > 0

    def keys(self, group: Group, required: bool = False, purpose: str = "the audit log") -> list[Any] | None:
        """The keys of the group's rows (``None``: the samples carry none), as first read: kept
        on the group, so that a state taken after its rows were handed on (and changed in place by
        a later stage) names the keys the source gives again."""
        if group.keys is not None:
            return group.keys
        read = group
        if group.key_column is not None:  # the batch's key column as read (note_keys)
            read = Group([{self.key: group.key_column}], group.rows, group.seq0, None)
        keys = keys_of(read, self.scoring.batched, self.key, required, purpose)
        if keys is not None:
            group.keys = keys  # (a list of its own: keys_of builds one, never the batch's)
        return keys

    def observe(
        self, keys: Sequence[Any] | np.ndarray, values: np.ndarray | HostCopy, epoch: int | None = None
    ) -> None:
        """Remember losses the training step handed back (for samples ``keys``, handed on in
        ``epoch``: this one if None; ``values`` may still be on their way from a CUDA device)."""
        memory = self.memory
        if memory is None:
            raise ConfigError(
                "observe() needs a score memory: Sifter(..., memory=sp.ScoreMemory(capacity=...))"
            )
        if len(keys) != values.size:
            raise ScorerOutputError(
                f"observe() got {len(keys)} keys but {values.size} losses; pass one loss per sample "
                "(reduction='none')"
            )
        self.counts["observed"] += values.size
        self._largest_observe = max(self._largest_observe, values.size)
        if self.stopped:  # the cost guard stopped sifting: nothing will read them
            return
        # applied before the memory is next read (the next decision, at the latest): the training
        # steps one input batch feeds cost one update, not one each
        memory.defer_keys(keys, values, self.epoch if epoch is None else epoch, FEEDBACK)

    def follow_policy(self) -> None:
        """``attach_weight`` as the policy says (its ``weighted``), while it follows the policy."""
        if self.weight_auto:
            self.attach_weight = bool(getattr(self.policy, "weighted", False))

    def _say_unattached(self, weights: np.ndarray) -> None:
        """Warn, once, of weights other than 1 that a policy not marked ``weighted`` gave kept
        samples: nothing attaches them, so the training step never sees them (found by review,
        2026-12-05: dropped without a word, while the audit log records them)."""
        if weights.size and bool((weights != 1.0).any()):
            self._unattached_said = True
            warnings.warn(
                f"policy {type(self.policy).__name__} gave kept samples weights other than 1, but "
                "its class does not say weighted = True, so they are not attached to the samples "
                "and the training step does not see them (nor does the audit log, which records "
                "the weight trained with, 1): set "
                "`weighted = True` on the policy's class, or Sifter(attach_weight=True)",
                UserWarning,
                stacklevel=3,
            )

    def decide(self, group: Group) -> None:
        """Score (or look up) and decide every row of ``group``; count it and write it to the sink."""
        t0 = time.perf_counter()
        if self.attach_weight and not self._weight_type_checked:
            # once, on the first group (a stream's items are of one type): said, not refused, as
            # code that unpacks the tuple (x, y, w = batch) works with it
            self._weight_type_checked = True
            why = weight_changes_type(group, self.scoring.batched, self.weight_field)
            if why is not None:
                warnings.warn(why, UserWarning, stacklevel=2)
        rows = group.rows
        seq0 = group.seq0
        counts = self.counts
        chunk = self.scoring.micro_batch or rows
        micro_batch0 = counts["micro_batches"]
        sources: np.ndarray | int
        if self.stopped:
            # the cost guard stopped sifting: nothing is looked up, every row is kept with weight
            # 1, and the audit log records them as samples a score memory does not know (kept,
            # reason unknown, source none, no loss: what-if replays keep them, unseen by the policy)
            losses, sources, chunk = np.full(rows, np.nan), NONE, rows
            self.device_wait = 0.0
            t1 = time.perf_counter()
            # weights are ones, not None: a weighting policy's checkpoint holds pending weights
            d = Decided(
                np.ones(rows, dtype=bool), np.ones(rows), losses, np.ones(rows),
                np.full(rows, UNKNOWN, dtype=np.int8), 1, 0, 0,
            )  # fmt: skip
        else:
            scored, from_memory, unknown = counts["scored"], counts["from_memory"], counts["unknown"]
            memory = self.memory
            waited = memory.waited if memory is not None else 0.0
            try:
                losses, sources = self._losses(group)
                t1 = time.perf_counter()
                # waiting for losses on their way from the device is the steps' time, not scoring
                self.device_wait = (memory.waited - waited) if memory is not None else 0.0
                t0 += self.device_wait
                if counts["scored"] == scored and self.policy.chunk_free:
                    # no scoring forward, so no scoring micro-batches: one call decides the batch
                    # as micro-batches would (the audit log's micro_batch is then the input batch's)
                    chunk = rows
                d = self._decide_losses(group, losses, chunk)
            except BaseException:
                # a group that was not decided (a scorer error, a non-finite loss raised) is not
                # counted, in part or whole: seen, scored and the rest stay one account, and the
                # state the stage writes next loads (it refuses more scored than seen)
                counts["scored"], counts["from_memory"], counts["unknown"] = scored, from_memory, unknown
                raise
        keep, weight = d.keep, d.weight
        counts["micro_batches"] += d.micro_batches
        counts["nan"] += d.nan
        counts["warmup"] += d.warmup
        kept_index = keep.nonzero()[0]
        n_kept = kept_index.size
        counts["seen"] += rows
        counts["kept"] += n_kept
        counts["dropped"] += rows - n_kept

        group.keep = keep
        group.kept_index = kept_index
        # kept even when not attached: the state holds it, so a resumed stage that attaches
        # weights gets the decided ones
        group.weight = weight
        batched = self.scoring.batched
        if self.attach_weight:
            attach_weights(group, batched, self.weight_field)
        elif weight is not None and self.weight_auto and not self._unattached_said:
            self._say_unattached(weight[kept_index])
        if self.audit is not None:
            self.audit.write(
                Decisions(
                    seq0=seq0,
                    epoch=self.epoch,
                    model_version=self.model_version,
                    keys=self.keys(group, required=True),
                    urls=field_of(group, batched, "__url__"),
                    workers=field_of(group, batched, "__worker__"),
                    loss=losses,
                    score=d.score,
                    prob=d.prob,
                    kept=keep,
                    # the weight the step trains with: 1 where none is attached (found by review,
                    # 2026-12-06: the policy's weights were logged that nothing handed on)
                    weight=weight if self.attach_weight else None,
                    reason=d.reason,
                    micro_batch0=micro_batch0,
                    chunk=chunk,
                    source=sources,
                    merged=bool(getattr(self.policy, "merged", False)),
                )
            )
        self.seconds[0] += t1 - t0
        self.seconds[1] += time.perf_counter() - t1

    def _decide_losses(self, group: Group, losses: np.ndarray, chunk: int) -> Decided:
        """The policy's decisions for the group's losses (NaN handling, warm-up, upstream rows)."""
        rows = group.rows
        finite = np.isfinite(losses)
        # count_nonzero: one C call, where ndarray.all() goes through a ufunc reduction
        all_finite = np.count_nonzero(finite) == rows
        unknown = group.unknown
        if (
            not all_finite
            and self.on_nan == "raise"
            and (unknown is None or np.count_nonzero(finite | unknown) != rows)
        ):
            self._raise_non_finite(group, losses, finite if unknown is None else finite | unknown)
        upstream = group.upstream
        try:
            return decide_rows(
                self.policy,
                self.rng,
                losses,
                group.seq0,
                chunk,
                self.delay,
                self.on_nan == "keep",
                finite,
                None if upstream is None else (upstream[0], upstream[2]),
                unknown,
                all_finite=all_finite,
            )
        except (SiftError, MemoryError):
            raise
        except Exception as exc:
            # a policy of one's own that raised: said with the samples it was deciding, as a
            # scorer's error is (the exception as raised is the cause)
            keys = self._error_names(group)
            raise PolicyError(
                f"policy {self.policy!r} raised {type(exc).__name__}: {exc} while deciding the "
                f"{rows} samples from seq {group.seq0} (keys {describe_keys(keys)}); fix its "
                "decide(), which must return a siftpipe.Decision for any finite losses"
            ) from exc

    def _error_names(self, group: Group) -> list[Any] | None:
        """The group's keys for an error message: ``None`` for a sample that lacks its key field
        (``keys`` gives none at all then; found by review, 2026-12-05: an error said no sample
        had a key when one of eight lacked it)."""
        keys = self.keys(group)
        spec = self.key
        if keys is not None or self.scoring.batched or spec is None or callable(spec):
            return keys
        out: list[Any] = []
        for sample in group.items:
            try:
                out.append(sample[spec])
            except (KeyError, IndexError, TypeError):
                out.append(None)
        return out if any(k is not None for k in out) else None

    def _raise_non_finite(self, group: Group, losses: np.ndarray, finite: np.ndarray) -> None:
        bad = np.flatnonzero(~finite)
        keys = self._error_names(group)
        names = [keys[i] for i in bad] if keys else None
        raise NonFiniteLossError(
            f"{bad.size} non-finite loss(es) (e.g. {losses[bad[0]]}) at sample seq "
            f"{group.seq0 + int(bad[0])}, keys {describe_keys(names)}; check the data and the "
            "scorer, or pass on_nan='keep' or 'drop' to count and skip them"
        )

    def _losses(self, group: Group) -> tuple[np.ndarray, np.ndarray | int]:
        """Losses for every row of ``group``, and where each came from (codes, or one code)."""
        source = self.loss_source
        memory = self.memory
        upstream = group.upstream = upstream_of(group, self.scoring.batched, self.upstream_filters)
        if self.upstream_filters and self._unmarked is not None:
            self._check_marked(group)
        if upstream is not None:
            # kept before decode, from the published memory: no forward, no second decision
            mask, pre_loss, _ = upstream
            losses = pre_loss.copy()
            sources = np.full(group.rows, FEEDBACK, dtype=np.int8)
            rest = np.flatnonzero(~mask)
            prekept = group.rows - rest.size
            self.counts["from_memory"] += prekept
            if rest.size and memory is None:
                losses[rest] = self._score_rows(group, rest)
                sources[rest] = source
            elif memory is not None:
                # the rows not kept before decode go the memory's way, as in a group with none
                # kept: looked up in the live memory (newer than the publication), unknown="keep",
                # forwards remembered, the lookups counted (found by review, 2026-12-06: they were
                # scored unremembered, so scored again each epoch, kept-unknown rows were scored
                # and dropped, and a false "found none" warning blamed the keys)
                self._lookups[1] += prekept
                self._lookups[2] += prekept
                if rest.size:
                    losses[rest], sources[rest] = self._remembered(group, memory, rest)
            return losses, sources
        if memory is None:
            return self._score_rows(group, None), source
        return self._remembered(group, memory, None)

    def _remembered(self, group: Group, memory: Any, at: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Losses of the rows ``at`` of ``group`` (``None``: all of them) from the memory, and
        where each came from; a row it lacks is kept unknown (``unknown="keep"``) or scored, its
        forward remembered (``remember_forward``)."""
        # integer keys stay one array (no Python object per key); anything else is a list
        keys: Any = key_array(group, self.scoring.batched, self.key)
        if keys is None:
            keys = self.keys(group, required=True, purpose="the score memory")
        assert keys is not None  # key=None with a memory is refused at construction
        if at is not None:
            keys = pick_keys(keys, at)
        losses, remembered = memory.lookup_keys(keys, self.epoch)
        rows = len(losses)
        miss = np.flatnonzero(np.isnan(losses))
        lookups = self._lookups
        lookups[1] += rows
        lookups[2] += rows - miss.size
        sources = np.where(remembered == FEEDBACK, FEEDBACK, STALE).astype(np.int8)
        if miss.size and self.unknown == "keep":
            sources[miss] = NONE
            unknown = np.zeros(group.rows, dtype=bool)
            unknown[miss if at is None else at[miss]] = True
            group.unknown = unknown
            self.counts["unknown"] += miss.size
        elif miss.size:
            fresh = self._score_rows(group, miss if at is None else at[miss])
            losses[miss] = fresh
            sources[miss] = self.loss_source
            if self.remember_forward:
                if self.on_nan == "raise" and np.count_nonzero(np.isfinite(fresh)) != miss.size:
                    # raised before the memory holds any loss of a group that is not decided;
                    # named by the group's rows (the review of the pre-kept rows' fix: the rows
                    # ``at`` were named by their places among themselves)
                    whole = losses
                    if at is not None:
                        whole = np.zeros(group.rows)
                        whole[at] = losses
                    self._raise_non_finite(group, whole, np.isfinite(whole))
                memory.update_keys(pick_keys(keys, miss), fresh, self.epoch, self.loss_source)
        self.counts["from_memory"] += rows - miss.size
        return losses, sources

    def pass_begins(self, whole: bool) -> None:
        """A pass begins (``whole``: from its start, not resumed inside it)."""
        # also here: a pass left early (EqualSteps on every rank but the shortest, a break) ends
        # without pass_ends
        self._warn_hard()
        memory = self.memory
        usable = 0
        if whole and memory is not None and not self._warned_memory:
            # counted now, not at the end: observe() re-stores this pass's keys at this epoch,
            # where they are no longer usable (one pass over the table, once a pass)
            usable = memory.usable_at(self.epoch)
        self._lookups = [usable, 0, 0]
        self._repeated = (
            memory.repeated if memory is not None else 0,
            self.counts["observed"] + self.counts["scored"],
        )
        self._largest_observe = 0
        self._seen_at_pass = self.counts["seen"]
        # (refusals before: a loaded state's, fit=True's at the load, another process's; not
        # reset at each pass: a trainer that fetches ahead observes a pass's last batch after
        # that pass ended, and its refusals fell between two passes' counts: the review of it)
        if self._refused_at is None and memory is not None:
            self._refused_at = memory.refused

    def pass_ends(self) -> None:
        """A pass ran to its end. Warn once if it looked its samples up in a memory that held
        losses it could use (stored in earlier passes, not expired) and found none: every sample
        was then scored or kept as unknown, and sifting from memory silently did nothing."""
        self._warn_repeats()
        self._warn_full()
        self.passes_ended += 1
        self._warn_no_feedback()
        self._warn_hard()
        usable, looked, found = self._lookups
        if self._warned_memory or not usable or not looked or found:
            return
        self._warned_memory = True
        warnings.warn(
            f"siftpipe: a whole pass (epoch {self.epoch}) looked up {looked:,} samples in the score "
            f"memory and found none, though it held {usable:,} usable losses from earlier passes: "
            f"every sample was {'kept unknown' if self.unknown == 'keep' else 'scored'} and "
            "nothing was sifted from memory. Either observe() gets keys in another form than the "
            "batch carries (5, '5' and an integer tensor's 5 are one key; 5.0 and 'tensor(5)' are "
            "others), or this pass read samples new to the memory: a curriculum's next dataset "
            "(nothing is wrong then), or keys that change every pass (an epoch or augmentation id "
            "in them: sifting from memory cannot work). Said once a run",
            ScoreMemoryWarning,
            stacklevel=3,  # the loop over the stage's pass
        )

    #: ``ScoreMemory.persistent_hard()`` from which the stage logs that sifting may not pay.
    HARD_WARN = 0.15

    #: Groups without a ``PreDecodeFilter``'s marks, none marked yet, before the warning: enough
    #: that a stream mixing a filter's samples into others' (``RandomMix``) shows some first.
    UNMARKED_GROUPS = 64

    def _check_marked(self, group: Group) -> None:
        """Warn once if the rows of a stage that reaches a ``PreDecodeFilter`` keep coming without
        the marks it puts on every row it hands on: something between them (a ``.map()`` that
        builds new dicts, ``to_tuple``) dropped them, so the rows the filter kept are decided
        again here and about keep-rate squared of them trained (found by review, 2026-12-05)."""
        if upstream_marked(group, self.scoring.batched):
            self._unmarked = None  # they arrive: nothing more to check this run
            return
        assert self._unmarked is not None
        self._unmarked += 1
        if self._unmarked == self.UNMARKED_GROUPS:
            self._unmarked = None  # said once: no more scanning of every group's samples for it
            warnings.warn(
                f"this stage reaches a PreDecodeFilter, but the {self.UNMARKED_GROUPS} groups of "
                "samples it decided first came without the __sift_prekept__, __sift_preloss__ and "
                "__sift_preprob__ fields the filter puts on every sample it hands on: something "
                "between them dropped them (a .map() that builds new dicts, to_tuple), so the "
                "samples the filter kept are decided a second time here and far fewer are trained "
                "than either decision meant. Carry every __sift_* field through, e.g. "
                "{**new, **{k: v for k, v in s.items() if k.startswith('__sift_')}}, and keep dict "
                "samples up to the stage (or, if the filter's samples are a small part of a mix, "
                "or the filter is not meant for this stream, ignore this)",
                PreDecodeWarning,
                stacklevel=2,
            )

    def epoch_changes(self) -> None:
        """``set_epoch`` moves to another epoch: in one endless pass the only boundary there is."""
        self._warn_hard()
        self._warn_full()  # (a pass that never ends, or is always left early: the review of it)

    def memory_loaded(self) -> None:
        """The stage loaded a state into its memory: refusals counted in it (before the
        checkpoint, or at a load into a smaller memory) are not this run's to warn of."""
        self._refused_at = None

    def _warn_hard(self) -> None:
        """Log once when a pass begins or ends, or the epoch changes, with ``HARD_WARN`` or more
        of the training losses of known samples persistently hard (mislabeled samples, most
        often): sifting trains all of them while it drops easy ones, and on siftpipe's noisy
        benchmark tasks it did not reliably pay there."""
        memory = self.memory
        if self._warned_hard or memory is None or self.stopped:
            return
        share = memory.persistent_hard()
        if share is None or share < self.HARD_WARN:
            return
        self._warned_hard = True
        dropping = getattr(self.policy, "noise_drop", None) is not None
        _log.warning(
            "siftpipe: %.0f%% of the training losses of samples seen before stayed above twice the "
            "mean loss, as they were last time (stats.persistent_hard): samples the model does not "
            "learn, as mislabeled ones stay. Sifting keeps training every one of them while it drops "
            "easy samples; on siftpipe's benchmark tasks with 20%% of the labels wrong it did not "
            "reliably save time to accuracy (docs/benchmarks.md). Compare against a run without "
            "sifting, clean the labels, or %s",
            100 * share,
            "see what noise_drop, set on this policy and pruning them from now on, does"
            if dropping
            else "try sp.recipe(..., noise_drop=0.9), which prunes them",
        )

    def _warn_no_feedback(self) -> None:
        """Warn once when a pass after the first kept samples unknown from a score memory that
        holds no loss at all while only ``observe()`` can bring losses (``unknown="keep"``: no
        scoring forward), and ``observe()`` was never called: a training loop that forgot it
        sifts nothing, ever, silently."""
        memory = self.memory
        if (
            self._warned_feedback
            or memory is None
            or self.unknown != "keep"
            or self.passes_ended < 2
            or self.counts["seen"] == self._seen_at_pass  # an empty pass: EmptyPassWarning's
            or not self.counts["unknown"]
            or len(memory)
        ):
            return
        self._warned_feedback = True
        observed = self.counts["observed"]
        if observed:
            # observe() was called, with no finite loss in all it got: the memory ignores those
            warnings.warn(
                f"siftpipe: {self.counts['unknown']:,} samples have been kept unknown by epoch "
                f"{self.epoch} and nothing was sifted: observe() got {observed:,} losses and not "
                "one was finite (NaN or inf), and the score memory ignores those. Check the "
                "training step's per-sample losses (reduction='none', before any masking that "
                "divides by zero, and in a dtype that does not overflow)",
                ScoreMemoryWarning,
                stacklevel=4,  # the loop over the stage's pass
            )
            return
        warnings.warn(
            f"siftpipe: {self.counts['unknown']:,} samples have been kept unknown by epoch "
            f"{self.epoch} and nothing was sifted: the score memory holds no loss, and with "
            "unknown='keep' (sp.recipe's) only observe() brings them. Call "
            "sifter.observe(batch['__key__'], per_sample_losses) after each training step "
            "(the step's losses with reduction='none'); the HF and Lightning integrations do it "
            "for you when the batch carries its keys (key= a field, not a callable)",
            ScoreMemoryWarning,
            stacklevel=4,  # the loop over the stage's pass
        )

    def _warn_full(self) -> None:
        """Warn once when the memory has turned losses away (full): those samples are kept
        unknown every pass, never sifted. Counted only until 2026-12-06 (found by review: a loop
        handing validation batches to observe() filled a memory sized to an epoch, and 20% of the
        samples were never sifted, nothing said; the ranks' sync already warned)."""
        memory = self.memory
        if memory is None or self._warned_full or memory.warned_full_sync or self._refused_at is None:
            return  # (the ranks' sync said it already, with the advice for a shared memory)
        grown = memory.refused - self._refused_at
        if grown <= 0:
            return
        self._warned_full = True
        warnings.warn(
            f"siftpipe: the score memory is full ({memory.capacity:,} samples) and turned away "
            f"{grown:,} losses in epoch {self.epoch}: those samples are kept unknown each pass, "
            "never sifted. "
            "Give it the capacity of the samples this stage sees in a pass (sp.recipe(..., "
            "capacity=...), sp.ScoreMemory(capacity)), and hand observe() only the keys of "
            "batches the stage handed on (not validation or evaluation batches)",
            ScoreMemoryWarning,
            stacklevel=4,  # the loop over the stage's pass
        )

    def _warn_repeats(self) -> None:
        """Warn once if training losses handed back in this pass replaced others the same key got
        earlier in the pass: the memory keeps one loss per key, so every sample of that key is
        decided next epoch by the one trained last.

        Only beyond what a pass boundary explains: a consumer that fetches the next pass's first
        batch before it observes the last one (a trainer's look-ahead) and does not pass that
        batch's epoch to ``observe(epoch=...)`` (the integrations do) stores it under the next
        epoch, where the same samples come again; so more than two observe() calls' worth and
        more than 1% of the pass's losses must repeat."""
        memory = self.memory
        if memory is None or self._warned_repeats:
            return
        repeated = memory.repeated - self._repeated[0]
        remembered = self.counts["observed"] + self.counts["scored"] - self._repeated[1]
        if repeated <= 2 * self._largest_observe or repeated * 100 <= remembered:
            return
        self._warned_repeats = True
        warnings.warn(
            f"siftpipe: {repeated:,} of the losses remembered in epoch {self.epoch} (handed to "
            "observe(), or from scoring forwards) replaced one the same key had got earlier in "
            "that epoch: the score memory keeps one loss per key, "
            "so next epoch every sample of such a key is decided by the one trained last. Call "
            "observe() once per trained batch, after its step (not per accumulation micro-step "
            "with the same keys, nor twice for one batch); make "
            "keys unique (shards that number their samples from 0 each: key=siftpipe.shard_key, "
            "and observe(siftpipe.shard_key(batch), losses)), give each pass "
            "its own set_epoch() number, or, for a stream that samples with replacement "
            "(resampled=True), where a sample may come twice in a pass, silence this with "
            "warnings.filterwarnings('ignore', category=siftpipe.RepeatedKeyWarning) "
            "(sifter.memory.repeated counts them)",
            RepeatedKeyWarning,
            stacklevel=4,  # the loop over the stage's pass
        )

    def _score_rows(self, group: Group, index: np.ndarray | None) -> np.ndarray:
        """Losses of rows ``index`` of ``group`` (all rows if None), in micro-batches."""
        self.counts["scored"] += group.rows if index is None else index.size

        def names(at: np.ndarray) -> list[Any] | None:
            keys = self._error_names(group)
            return [keys[i] for i in at.tolist()] if keys else None

        return self.scoring.rows(group, index, names)
