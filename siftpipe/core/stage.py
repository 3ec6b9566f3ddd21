"""The sift stage: micro-batch, score with the live model, decide, hand kept samples on."""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import math
import multiprocessing
import multiprocessing.util
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate, get_worker_info

from ..errors import (
    BatchShapeWarning,
    ConfigError,
    EmptyPassWarning,
    MissingKeyError,
    PassClosedError,
    ResumeError,
    ScoreMemoryWarning,
    ScorerOutputError,
    SiftError,
    SiftInWorkerError,
)
from . import batch as _batch
from .account import CostAccount
from .decide import REASONS
from .decider import Decider
from .files import RETRY_TIMEOUT
from .hostcopy import HostCopy, host_losses
from .ledger import RECENT_BATCHES, Group, Ledger, Output, kept_seq, restored_groups
from .memory import SOURCES, ScoreMemory, check_epoch
from .passes import Passes, Superseded
from .policies import Policy, get_policy, integer_count
from .ranks import dist_info
from .resume import check_next, note_keys, note_tail, reread_groups
from .rows import memory_keys, publish_key
from .scorers import Scorer
from .scoring import (
    CPU,
    ByName,
    Scoring,
    Setting,
    not_dense,
    scoring_device,
)
from .settings import (
    check_arguments,
    resolve_policy,
    resolve_scorer,
    stage_config,
)
from .shardcounts import ShardStats, ShardWatch, follow_epoch, hand_on
from .sink import StageInfo, make_sink
from .source import END, Raised, Reader, StatefulSource
from .state import (
    COUNTS,
    RESUME_OVERRIDES,
    STATE_VERSION,
    WALL_CLOCK,
    carry_policy_state,
    check_policy_entries,
    check_state,
    config_differences,
    digest,
    override_names,
)
from .stats import SiftStats

__all__ = ["REASONS", "SiftStats", "Sifter"]


OnNan = Literal["raise", "keep", "drop"]
OnOom = Literal["raise", "split"]
KeySpec = str | int | Callable[[Any], Any] | None


def _boolean(value: Any) -> bool:
    """A yes/no value of any kind (Python's, numpy's, a bool tensor), which no number is."""
    return isinstance(value, bool | np.bool_) or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool
    )


def _model_version(value: Any) -> int:
    """``value`` as the integer tag the audit log and the state record (int64), or a
    ``ConfigError`` when it is set, not when a checkpoint written with it will not load (found
    by review, 2026-12-05: a str or None lost every audit record, a tensor or numpy integer made a
    state that would not load)."""
    number = None if _boolean(value) or isinstance(value, str | bytes) else integer_count(value)
    if number is None and not (_boolean(value) or isinstance(value, str | bytes)):
        # a whole number of another kind: torch.optim.Adam keeps its step as a float tensor
        try:
            as_float = float(value)
        except (TypeError, ValueError, RuntimeError):
            as_float = float("nan")
        if math.isfinite(as_float) and abs(as_float) < 2.0**63 and as_float == int(as_float):
            number = int(as_float)
    if number is None or not -(2**63) <= number < 2**63:
        raise ConfigError(
            f"model_version is a tag recorded with each decision, an integer that fits in 64 bits "
            f"(the optimizer step, say: sifter.model_version = step), got {value!r}"
        )
    return number


def _epoch_number(value: Any) -> int:
    """``value`` as a pass number (an integer >= 0, as a checkpoint holds it), or a ``ConfigError``
    (found by review, 2026-12-05: -1 made a state that would not load, 1.5 became 1)."""
    number = None if _boolean(value) else integer_count(value)
    if number is None or number < 0:
        raise ConfigError(f"the epoch is the pass number, an integer >= 0; got {value!r}")
    return number


_log = logging.getLogger("siftpipe")

#: Sifters that opened a pass with an audit sink in this process (``_leave_passes_at_exit``)
_AT_EXIT: weakref.WeakSet[Sifter] = weakref.WeakSet()
_at_exit_pid: list[int] = []  # the process whose exit handler is registered


def _leave_at_exit(sifter: Sifter) -> None:
    """Have the interpreter's exit leave ``sifter``'s open pass before the audit logs close."""
    _AT_EXIT.add(sifter)
    if _at_exit_pid != [os.getpid()]:
        # registered after the audit log's own exit handler (the log exists, its module is
        # loaded), so it runs first: atexit runs the handler registered last first
        _at_exit_pid[:] = [os.getpid()]
        atexit.register(_leave_passes_at_exit)
        # a multiprocessing child ends with os._exit after multiprocessing's finalizers, and
        # runs no atexit handler: there this leaves the passes, before the logs' finalizer
        # (priority 10) closes them (the review of the exit handler, 2026-12-06)
        multiprocessing.util.Finalize(None, _leave_passes_at_exit, exitpriority=20)


def _forget_at_exit() -> None:
    """In a forked child: its parent's passes are its parent's (the review of the exit handler:
    a child's exit closed the parent's DataLoader iterator through its copy, and the parent
    hung on its next read)."""
    _AT_EXIT.clear()


os.register_at_fork(after_in_child=_forget_at_exit)


def _leave_passes_at_exit() -> None:
    """Leave the open pass of each Sifter with an audit sink, as ``close()`` would, before the
    logs are closed at the interpreter's exit: its rows decided kept and never handed on are
    noted so (found by review, 2026-12-06: a script that read ``max_steps`` batches with
    ``next()`` and ended without ``close()`` left a log whose kept rows included the untrained
    ones, and ``verify`` said OK). The log's own exit handler closes the logs after it. (A
    forked child holds only the Sifters it opened passes of: ``_forget_at_exit``.)"""
    for sifter in list(_AT_EXIT):
        with contextlib.suppress(Exception):
            sifter._leave_pass("the interpreter exited while the pass was open")


class _Held:
    """Objects held weakly (one that cannot be, strongly), each once; pickled or copied as the
    ones still alive."""

    def __init__(self, objects: Iterable[Any] = ()) -> None:
        self._refs: list[Any] = []
        self.add(*objects)

    def __getstate__(self) -> dict[str, Any]:
        return {"objects": self.alive()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["objects"])  # type: ignore[misc]

    def alive(self) -> list[Any]:
        return [o for o in (r() for r in self._refs) if o is not None]

    def add(self, *objects: Any) -> None:
        live = self.alive()
        self._refs = [r for r in self._refs if r() is not None]
        for obj in objects:
            if all(obj is not o for o in live):
                live.append(obj)
                try:
                    self._refs.append(weakref.ref(obj))
                except TypeError:
                    self._refs.append(_Strong(obj))


class _Strong:
    """A strong reference, called as a weak one is."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class _WeightSetting(Setting):
    """``attach_weight``: None (the default) means the policy says (its ``weighted``), now and
    whenever the policy is set again; reads as the bool in effect."""

    def __set__(self, obj: Any, value: Any) -> None:
        decider = self._part(obj)
        decider.weight_auto = value is None
        if value is None:
            decider.follow_policy()
        else:
            decider.attach_weight = value


class _PolicySetting(ByName):
    """``policy``: a name or a ``Policy``; while ``attach_weight`` follows the policy, setting one
    sets it too (found by review, 2026-12-05: a ``PruneEasy`` set after construction decided
    weights that were never attached, so easy samples trained under-weighted, biasing the
    gradient)."""

    def __set__(self, obj: Any, value: Any) -> None:
        super().__set__(obj, value)
        self._part(obj).follow_policy()


class Sifter:
    """Drop the samples the live model has already learned; hand the rest on.

    Iterating ``sifter(source)`` reads ``source`` in micro-batches, scores each with
    ``scorer(model, batch)`` on the model's device (eval mode, ``torch.no_grad``), lets
    ``policy`` decide per sample, and yields the kept samples in input order and format.

    Args:
        model: The live ``nn.Module`` being trained (``None`` for scorers that need no model).
            A ``DistributedDataParallel`` wrapper is scored through the module it wraps (the
            scorer is given ``ddp.module``); a sharded model (FSDP, DeepSpeed) is refused for a
            scoring forward, whose collectives ranks would make unequally (``ConfigError``).
        scorer: ``(model, batch) -> Tensor[n]`` losses, or a registered scorer name.
        policy: A ``Policy`` or registered policy name. Default: ``RelativeProbabilistic(1.0, 500)``.
        micro_batch: Samples per scoring forward pass. In ``batched`` mode an input batch larger
            than this is scored in chunks of ``micro_batch``; ``None`` scores each whole batch.
        delay: Warm-up, in samples seen by this stage: the first ``delay`` samples are all kept
            (reason ``"warmup"``) while the policy's loss history fills.
        seed: Seed of the stage's random generator (the only randomness in decisions). On a
            multi-process job each rank's generator is seeded with ``[seed, rank]``.
        batched: Input items are collated batches (dict of tensors/lists, tuple of tensors)
            from DataLoader workers rather than single samples.
        output_batch: Hand on collated batches of exactly this many kept samples (the last one
            of a pass may be short). ``None``: single samples, or in ``batched`` mode one
            filtered batch per input batch (input batches with nothing kept are skipped).
        drop_last: With ``output_batch``: the short batch a pass ends with is not handed on, so
            every batch has exactly ``output_batch`` rows (a sifted pass keeps a different number
            of samples each epoch, and each new batch size costs a ``cudnn.benchmark`` autotune,
            a ``torch.compile`` recompile or an XLA graph). Its samples, fewer than
            ``output_batch`` per pass, are counted in ``stats.unhanded`` and noted in the audit
            log as not handed on (``read_log`` and ``replay`` read them as not kept); so is a pass
            that ends with an error. Like ``DataLoader(drop_last=True)``, a pass that keeps fewer
            than ``output_batch`` samples hands on nothing (an ``EmptyPassWarning`` says so once).
        hold: Batches handed on that the consumer may still hold, untrained, when it takes a
            state (a prefetcher between the stage and the training step: its depth). The stage
            keeps the input samples they came from (their memory) until that many newer
            batches are handed on, so that ``state_dict(held=k)``, ``k <= hold``, resumes
            before the last ``k`` batches, which the resumed job then hands on and trains.
            With ``output_batch``, or in ``batched`` mode. 0 (default): nothing kept; at most 64.
        collate_fn: Collates a list of samples into a batch (default ``default_collate``).
        pad_micro_batch: Pad a short micro-batch to ``micro_batch`` rows by repeating its last
            row, so XLA/Neuron and ``torch.compile`` see one shape. Padding is never counted,
            logged or handed on.
        device: Where to score; default the device of the model's first parameter (else CPU).
        autocast: dtype for ``torch.autocast`` while scoring (e.g. ``torch.bfloat16``), or None.
        pin_memory: Page-lock micro-batches before moving them to an accelerator
            (``non_blocking`` copies are used whenever the batch is pinned).
        eval_mode: Score in eval mode (dropout off, batch-norm frozen), then put each module
            back in the mode it was in (a layer the user froze with ``.eval()`` stays frozen).
            A scoring forward is the model's own forward: hooks fire, and state it changes
            whatever the mode (a counter, an attribute like ``aux_loss``) changes too.
            ``False`` scores in the model's own mode: in train mode, batch-norm's running
            statistics then move with every scored micro-batch, dropped samples included.
        on_nan: What to do with a NaN or infinite loss: ``"raise"`` (``NonFiniteLossError``),
            ``"keep"`` or ``"drop"`` the sample (counted in ``stats.nan``, reason ``"nan"``,
            never added to the loss history).
        on_oom: ``"split"`` re-scores a micro-batch in halves when the scorer runs out of
            memory, down to single samples; ``"raise"`` reports it as ``ScorerError``.
        key: Where a sample's key is: a dict field (default ``"__key__"``), a tuple position, a
            callable ``sample -> key``, or ``None`` for no keys. Keys name samples in errors and
            are required by the audit log.
        weight_field: Dict field (or namedtuple field) that carries a kept sample's weight.
        attach_weight: Attach weights to kept samples (dict samples: ``weight_field``; tuples:
            an extra last element; namedtuples: their field ``weight_field``, else a plain
            tuple with the weight last, said once with a warning; tensors: a
            ``(tensor, weight)`` tuple; dict batches: a ``weight_field`` column; tuple batches:
            a last tensor). Default (None): if the policy reweights (``PruneEasy``), the policy
            set later too.
        audit: An ``AuditLog`` or a URL to write one record per decided sample to.
        track_source: Save the source's own state (``state_dict``/``load_state_dict``, e.g. a
            ``StatefulDataLoader``) inside this stage's state, taken at micro-batch boundaries,
            so that one state dict resumes both. Default: when the source supports it.
        memory: A ``ScoreMemory``: samples whose key it remembers a recent loss for (handed back
            by ``observe``, or from an earlier scoring forward) are decided from it without a
            forward pass. Part of this stage's state.
        remember_forward: Also remember the losses of scoring forward passes (then a sample is
            re-scored once its remembered loss is older than ``memory.max_age`` epochs:
            Selective Backprop's stale mode).
        unknown: What happens to a sample the score memory has no usable loss for: ``"score"``
            (a scoring forward pass) or ``"keep"`` (kept with no forward, reason ``"unknown"``,
            source ``"none"``, counted in ``stats.unknown``; its loss arrives when the training
            step hands it back through ``observe``: InfoBatch's way, and ``siftpipe.recipe``'s).
        cost_guard: Stop sifting for the rest of the run once it is not paying for itself: when
            the stage's own time has exceeded the training time its dropped samples would have
            cost (``stats.net_seconds`` < 0, judged at the end of the second and later passes
            that dropped samples; in one endless pass, at each ``set_epoch`` after an epoch that
            dropped samples), every later sample is handed on with weight 1, no loss looked
            up and ``observe()`` a no-op (``stats.sifting_scale`` 0, ``stats.stopped_at`` the
            sample it stopped at, kept in the state; logged; in the audit log as kept, reason
            ``unknown``, no loss). When that happens depends on
            measured time, so two runs may stop at different passes. ``siftpipe.recipe`` turns
            it on. Not compared on resume: it is about this machine's speed. The account behind
            it is in the state, so a job restarted from checkpoints is judged on its whole run
            (a checkpoint taken mid-pass carries the time up to the last group handed on). Each
            rank of a distributed job judges its own time.
    """

    STATE_VERSION = STATE_VERSION
    #: Settings ``load_state_dict(state, override=...)`` accepts: this stage's then wins over the
    #: checkpoint's.
    RESUME_OVERRIDES: ClassVar[tuple[str, ...]] = RESUME_OVERRIDES

    # settings the scoring part keeps (see siftpipe.core.scoring): read and set them here as usual
    # (a setting set after construction is checked as the constructor checks it, when a pass opens)
    model = Setting("_scoring", Scoring)
    scorer = ByName("_scoring", Scoring, resolve_scorer)
    micro_batch = Setting("_scoring", Scoring)
    collate_fn = Setting("_scoring", Scoring)
    pad_micro_batch = Setting("_scoring", Scoring)
    autocast = Setting("_scoring", Scoring)
    pin_memory = Setting("_scoring", Scoring)
    eval_mode = Setting("_scoring", Scoring)
    on_oom = Setting("_scoring", Scoring)
    # settings the deciding part keeps (see siftpipe.core.decider)
    policy = _PolicySetting(
        "_decider", Decider, lambda policy: get_policy(policy) if isinstance(policy, str) else policy
    )
    memory = Setting("_decider", Decider)
    delay = Setting("_decider", Decider)
    on_nan = Setting("_decider", Decider)
    key = Setting("_decider", Decider)
    weight_field = Setting("_decider", Decider)
    attach_weight = _WeightSetting("_decider", Decider)
    remember_forward = Setting("_decider", Decider)
    unknown = Setting("_decider", Decider)
    cost_guard = Setting("_decider", Decider)
    #: A tag recorded with each decision (set it to the optimizer step, say): an integer, or a
    #: whole number such as the float tensor ``torch.optim.Adam`` keeps its step in.
    model_version = ByName("_decider", Decider, _model_version)
    #: The pass (epoch) number recorded with each decision, an integer >= 0; see ``set_epoch``.
    epoch = ByName("_decider", Decider, _epoch_number)
    #: Where decisions go (the audit log): a ``DecisionSink``; a URL given here became an ``AuditLog``.
    audit = Setting("_decider", Decider)

    #: The yes/no settings, checked to be True or False (``attach_weight``: or None) when made and
    #: when a pass opens.
    FLAGS: ClassVar[tuple[str, ...]] = (
        "batched", "pad_micro_batch", "pin_memory", "eval_mode", "attach_weight", "remember_forward",
        "cost_guard",
    )  # fmt: skip

    def __init__(
        self,
        model: nn.Module | None,
        scorer: Scorer | str,
        policy: Policy | str | None = None,
        *,
        micro_batch: int | None = 64,
        delay: int = 0,
        seed: int = 0,
        batched: bool = False,
        output_batch: int | None = None,
        drop_last: bool = False,
        hold: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pad_micro_batch: bool = False,
        device: torch.device | str | None = None,
        autocast: torch.dtype | None = None,
        pin_memory: bool = False,
        eval_mode: bool = True,
        on_nan: OnNan = "raise",
        on_oom: OnOom = "raise",
        key: KeySpec = "__key__",
        weight_field: str = "__sift_weight__",
        attach_weight: bool | None = None,
        audit: Any = None,
        track_source: bool | None = None,
        memory: ScoreMemory | None = None,
        remember_forward: bool = True,
        unknown: Literal["score", "keep"] = "score",
        cost_guard: bool = False,
    ) -> None:
        given = locals()
        flags = {name: given[name] for name in self.FLAGS}
        check_arguments(
            model, micro_batch, batched, delay, output_batch, on_nan, on_oom, memory, key, unknown,
            pad_micro_batch, seed, autocast, drop_last=drop_last, flags=flags,
        )  # fmt: skip
        micro_batch = None if micro_batch is None else int(micro_batch)
        output_batch = None if output_batch is None else int(output_batch)
        delay = int(delay)
        if device is not None:
            device = scoring_device(device)

        if "_scoring" not in self.__dict__:  # (a subclass may have set a setting already)
            self._scoring = Scoring()
        if "_decider" not in self.__dict__:
            self._decider = Decider()
        self._decider.scoring = self._scoring
        self.model = model
        self.scorer = resolve_scorer(scorer)
        self.policy = resolve_policy(policy, memory)
        self.micro_batch = micro_batch
        self.delay = delay
        self.seed = int(seed)
        self._scoring.batched = batched  # fixed for the stage's life: positions count it
        self.output_batch = output_batch
        self.drop_last = drop_last
        count = integer_count(hold)
        if count is None or not 0 <= count <= RECENT_BATCHES:
            raise ConfigError(
                f"hold is a number of batches from 0 to {RECENT_BATCHES} (a prefetcher's depth), got {hold!r}"
            )
        if hold and not batched and output_batch is None:
            raise ConfigError(
                "hold counts batches the stage hands on: it needs output_batch (or batched=True); "
                "a stage handing on single samples has none to hold back"
            )
        self.hold = count
        self.collate_fn = collate_fn or default_collate
        self.pad_micro_batch = pad_micro_batch
        self._device = torch.device(device) if device is not None else None
        self.autocast = autocast
        self.pin_memory = pin_memory
        self.eval_mode = eval_mode
        self.on_nan = on_nan
        self.on_oom = on_oom
        self.key = key
        self.weight_field = weight_field
        self.attach_weight = attach_weight  # None: the policy's weighted, now and when it is set
        self.track_source = track_source
        self.memory = memory
        self.remember_forward = remember_forward
        self.unknown = unknown
        self.cost_guard = bool(cost_guard)
        self.model_version = -1
        self.epoch = 0
        self.audit = None if audit is None else make_sink(audit)
        self._sink_bound: Any = None  # the sink bound to this stage (a new one is bound again)
        self._warned_gap = False  # set_epoch skipped epoch numbers (said once)

        #: The generator's seed: ``seed``, or ``[seed, rank]`` on a multi-process job so that ranks
        #: draw independently (read again when the first pass opens: a stage made before
        #: ``init_process_group`` in a spawned worker, with no ``$RANK``, saw rank 0 of 1).
        self.rng_seed: int | list[int] = self._rank_seed()
        self._decider.rng = np.random.default_rng(self.rng_seed)  # (its counters start at zero)
        self._rng_untouched = True  # nothing drawn from it, no state loaded into it
        self._account = CostAccount()  # wall time the stage costs and saves (stats, a warning)
        self._resume_overrides: frozenset[str] = frozenset()  # override_on_resume()
        self._ledger = Ledger()  # groups decided and not yet all handed on; positions in the pass
        self._passes = Passes(self._ledger)  # the pass open, its source; a loaded checkpoint's place
        self._shards = ShardWatch()  # see watch_shards
        # the pipelines watch_shards was given, for set_epoch: weakly (a loader made for one
        # pass is let go with its workers' shared memory and threads: found by review,
        # 2026-12-06, kept for the stage's life, open files grew by 9 an epoch)
        self._watched = _Held()
        # when this run began (a PreDecodeFilter takes no publication made before it, which
        # another run made); a loaded checkpoint's replaces it (None: one from before 2026-12-05)
        self._run_began: float | None = time.time()
        # after load_state_dict: the checkpoint's epoch, and when this process loaded it (a
        # PreDecodeFilter takes no publication of a later epoch made before then: the run this
        # job resumed made it, from training the resume rolled back)
        self._resumed: tuple[int, float] | None = None
        self._warned_empty = False  # EmptyPassWarning given
        self._warned_shapes = False  # BatchShapeWarning given
        self._warned_backwards = False  # ScoreMemoryWarning for set_epoch going back given
        self._output: Output | None = None  # the last pass's output (Sifter.discard_last)
        # rows handed to observe() since the pass of _output began: what state_dict() compares
        # with the rows that pass handed on
        self._observed_rows = 0
        self._fed_back = False  # observe() was called (the memory is fed from the training step)
        self._warned_all_dropped = False  # EmptyPassWarning for a pass drop_last emptied given

    # ------------------------------------------------------------------ public

    @property
    def batched(self) -> bool:
        """Whether input items are collated batches (fixed at construction)."""
        return self._scoring.batched

    def __copy__(self) -> Sifter:
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        new._scoring = copy.copy(self._scoring)  # a copy's settings are its own, as attributes were
        new._ledger = copy.copy(self._ledger)  # its positions too (the pending groups are shared)
        new._passes = copy.copy(self._passes)
        new._passes.ledger = new._ledger
        new._decider = copy.copy(self._decider)  # (its counters are shared, as they were)
        new._decider.scoring = new._scoring
        return new

    @property
    def device(self) -> torch.device:
        """The device micro-batches are scored on."""
        if self._device is not None:
            return self._device
        if self.model is not None:
            for param in self.model.parameters():
                return param.device
            for buffer in self.model.buffers():
                return buffer.device
        return torch.device("cpu")

    @property
    def stats(self) -> SiftStats:
        """A snapshot of the counters (cheap: read it every step if you like)."""
        c, account = self._decider.counts, self._account
        shards_skipped, samples_skipped = self._shards.skipped()
        return SiftStats(
            c["seen"],
            c["kept"],
            c["dropped"],
            c["nan"],
            c["warmup"],
            c["micro_batches"],
            self._decider.seconds[0],
            self._decider.seconds[1],
            c["scored"],
            c["from_memory"],
            c["observed"],
            shards_skipped,
            samples_skipped,
            c["unknown"],
            0.0 if self._decider.stopped else self.policy.sifting_scale(),
            account.stage_seconds,
            account.step_seconds,
            account.saved_seconds(),
            c["stopped_at"],
            c["unhanded"],
            None if self.memory is None else self.memory.persistent_hard(),
        )

    def watch_shards(self, *pipelines: Any) -> None:
        """Count what the shard readers in ``pipelines`` skip in ``stats`` and the audit log.

        ``pipelines``: a ``WebDataset`` or ``WebLoader`` (or any webdataset pipeline or DataLoader
        holding one), a ``ShardSource`` or the torchdata nodes above it. Their counters live in
        shared memory, so shards skipped inside DataLoader workers are counted too. ``.sift()``
        and ``SiftNode`` call this for you, and so does each pass for the source it is given.
        ``set_epoch`` hands its epoch to the ``PreDecodeFilter``s in them (a ``.sift()`` chain over
        a ``WebLoader`` starts its workers before the stage opens its pass).
        """
        self._shards.watch(*pipelines)
        self._watched.add(*pipelines)
        for pipeline in pipelines:  # (a .sift() chain's filters learn when the run began here)
            self._tell_run(pipeline)

    def _tell_run(self, pipeline: Any) -> None:
        """Tell the ``PreDecodeFilter``s in ``pipeline`` when this run began; the decider then
        knows filters mark the rows it is handed."""
        if hand_on(pipeline, "follow_sifter_run", self._run_began):
            self._decider.upstream_filters = True
            if self._resumed is not None:  # (a second walk of the graph only after a resume)
                hand_on(pipeline, "follow_sifter_resume", self._resumed)

    def describe(self) -> StageInfo:
        """The settings that decide, as plain data (what a sink records about the stage)."""
        policy = self.policy
        return StageInfo(
            policy=policy.name or type(policy).__name__,
            policy_config=policy.config(),
            weighted=bool(self.attach_weight),
            micro_batch=self.micro_batch,
            batched=self.batched,
            delay=self.delay,
            seed=self.seed,
            rng_seed=self.rng_seed,
            on_nan=self.on_nan,
            scorer=repr(self.scorer)[:200],
            output_batch=self.output_batch,
            drop_last=bool(self.drop_last),
            world_size=dist_info()[1],
        )

    def shard_stats(self) -> ShardStats | None:
        """What the watched shard readers counted, over every process (``None`` if none is watched)."""
        return self._shards.stats()

    @property
    def consumed(self) -> int:
        """Input items (samples, or batches in ``batched`` mode) of the current pass fully handed
        on or dropped: where to restart the source from when resuming from ``state_dict()``."""
        self._ledger.trim()
        return self._ledger.consumed

    @property
    def resume_from(self) -> int | None:
        """After ``load_state_dict`` of a mid-pass checkpoint whose source was not tracked: the
        input item (``state["consumed"]``) the next call's source must start at. ``None`` when no
        resume is pending or the tracked source is repositioned by the stage itself."""
        return self._passes.resume_from(self.track_source)

    @property
    def pass_steps(self) -> int:
        """Training steps a consumer has counted in the open pass (``EqualSteps`` sets it at each
        step, and schedules its loss-history syncs by it). It is in the state, so a consumer of a
        pass resumed mid-way goes on counting from the checkpoint's step instead of from 0; 0 when
        a new pass opens."""
        return self._passes.steps

    @pass_steps.setter
    def pass_steps(self, steps: int) -> None:
        self._passes.steps = int(steps)

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` with the decisions from now on (the next pass does not add one).

        Also where one endless pass (``fixed_steps`` over resampled shards) numbers its epochs:
        the stage says then, as at a pass's begin and end, what the score memory's last epoch
        showed (``stats.persistent_hard``'s warning)."""
        epoch = _epoch_number(epoch)
        if self.memory is not None:
            check_epoch(int(epoch))
            newest = self.memory.newest_epoch()
            if newest is not None and int(epoch) < newest and not self._warned_backwards:
                self._warned_backwards = True
                warnings.warn(
                    f"siftpipe: set_epoch({int(epoch)}) goes back before epoch {newest}, in which the "
                    "score memory stored losses: a loss decides only later epochs, so every sample "
                    f"it holds from epochs {int(epoch)}..{newest} counts as unknown (kept or scored, "
                    "not sifted) until the epochs pass it. Number epochs upward over the whole run "
                    "(a resumed run goes on from its checkpoint's epoch; a run that carries over "
                    "another's memory goes on from that run's last epoch + 1)",
                    ScoreMemoryWarning,
                    stacklevel=2,
                )
            elif int(epoch) > self.epoch + 1 and self._passes.count and not self._warned_gap:
                # found by review, 2026-12-05: with set_epoch(2 * e) every sample trained in the
                # last pass counted as skipped, and the recipe's forgetting guard never acted
                self._warned_gap = True
                warnings.warn(
                    f"siftpipe: set_epoch({int(epoch)}) after epoch {self.epoch} skips epoch numbers: "
                    "the score memory counts a loss's age in epochs (max_age, and the forgetting "
                    "guard's 'trained last epoch'), so with gaps every loss looks older than it is "
                    "and the guard cannot tell trained samples from skipped ones. Number passes "
                    "0, 1, 2, ... (set_epoch(epoch), not a step count)",
                    ScoreMemoryWarning,
                    stacklevel=2,
                )
        for pipeline in self._watched.alive():
            follow_epoch(pipeline, int(epoch), hook="follow_sifter_set_epoch")
            self._tell_run(pipeline)
        if int(epoch) != self.epoch:
            self._decider.epoch_changes()
            if self._passes.open:
                # one endless pass numbering its epochs: the cost guard judges each, as a pass
                stopping = self._guard_may_stop()
                self._judged(self._account.epoch_ends(stopping=stopping), stopping)
        self.epoch = int(epoch)
        self._passes.epoch_set = True

    @contextlib.contextmanager
    def off_clock(self) -> Iterator[None]:
        """Leave the block's wall time out of the stage's account of your training step.

        The stage times your step as the time between handing a batch on and being asked for
        the next (``stats.step_seconds``), and from it what its dropped samples would have cost
        (``stats.saved_seconds``, what ``cost_guard`` weighs against the stage's own time). An
        evaluation, a checkpoint or a long log write in the training loop, between two batches,
        would count as step time and make sifting look more worth it than it is: wrap it::

            for step, batch in enumerate(loader):
                train_step(batch)
                if step % 1000 == 0:
                    with sifter.off_clock():
                        evaluate(model)

        Changes no decision by itself; outside a pass (between epochs) it does nothing, since
        nothing is timed there. Blocks nested (a trainer integration's evaluation already is) or
        open in several threads at once leave their time out once.
        """
        account = self._account  # (a state loaded inside the block brings another)
        account.off_begins()
        try:
            yield
        finally:
            account.off_ends()

    def observe(self, keys: Sequence[Any], losses: Any, epoch: int | None = None) -> None:
        """Hand back per-sample losses the training step computed anyway, for later epochs.

        They go into the score memory (``memory=``), tagged with the epoch of the pass that
        handed the samples on; from the next epoch until ``memory.max_age`` epochs later, these
        samples are decided from them with no scoring forward (audit source ``feedback``).
        Non-finite losses are ignored, and so are losses beyond float32's range (above about
        3.4e38 in size), which the memory's float32 holds as infinite. The memory applies them
        before it is next read (the stage's next decision, at the latest: see
        ``ScoreMemory.defer_keys``), so the several training steps one input batch feeds cost
        one update.

        Call it once per trained batch, after its step, with the keys of a batch the stage
        handed on (not a validation batch's: those take room in the memory, and a full memory
        turns training samples away, said once) and their losses in the same order. A key's
        last loss handed over is the one kept (a late call for an older pass overwrites a newer
        loss); calling it twice for one batch, or per accumulation micro-step with the same
        keys, counts as repeated keys (``RepeatedKeyWarning``).

        Args:
            keys: The samples' keys (``batch["__key__"]``): a list, or an integer tensor or
                array of the samples' indices (read as one array: the fastest form).
            losses: One loss per key, in the keys' order: a tensor (any device; detached here)
                or an array.
            epoch: The epoch (``set_epoch`` number) of the pass that handed these samples on;
                None: the current one. A consumer that fetches ahead trains a pass's last
                batches after the next pass began (``set_epoch`` already called): give their
                pass's epoch, or those samples count as trained in the next pass, where they
                come again (then they are kept unscored there, and counted in
                ``memory.repeated``). The trainer integrations do this themselves. It cannot be
                later than the current epoch.
        """
        if epoch is not None:
            if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer):
                raise ConfigError(
                    f"observe(epoch=...) is the set_epoch() number of the pass that handed the "
                    f"samples on, an int, got {epoch!r}"
                )
            epoch = int(epoch)
            check_epoch(epoch)
            if epoch > self.epoch:
                raise ConfigError(
                    f"observe(epoch={epoch}) is later than the current epoch {self.epoch}: give the "
                    "epoch of the pass that handed the samples on (set_epoch() before each pass)"
                )
        _check_observed(keys, losses)
        if isinstance(losses, list | tuple) and any(isinstance(v, torch.Tensor) for v in losses):
            # a loss per sample as 0-d tensors (a per-sample loop): detached and joined, as one
            # tensor would be (a list with one that requires grad raised torch's "Can't call
            # numpy() on Tensor that requires grad"; found by review, 2026-12-05)
            try:
                # (a loss per micro-batch of a gradient accumulation, each a vector: joined)
                losses = torch.cat([torch.as_tensor(v).detach().reshape(-1) for v in losses])
            except (RuntimeError, TypeError, ValueError) as exc:
                raise ScorerOutputError(
                    f"observe() got a list of losses it cannot stack into one tensor ({exc}); pass "
                    "one loss per sample as one tensor or array"
                ) from exc
        if isinstance(losses, torch.Tensor):
            # a CUDA tensor's copy is queued behind the step and waited for when the memory
            # applies it (before its next read), so the host can queue the next step meanwhile;
            # float32 is what the memory keeps
            values: np.ndarray | HostCopy = host_losses(losses)
        else:
            try:
                values = np.asarray(losses, dtype=np.float32).reshape(-1)
            except (TypeError, ValueError) as exc:  # a dict, a generator, ragged lists
                raise ScorerOutputError(
                    f"observe() cannot read losses from a {type(losses).__name__} ({exc}); pass one "
                    "real loss per sample as a tensor, an array or a list of numbers"
                ) from exc
        memory = self.memory
        waited = memory.waited if memory is not None else 0.0
        t0 = time.perf_counter()
        # keys read as the stage reads a batch's keys, so both name each sample alike
        named = memory_keys(keys)
        if type(named) is list and None in named:
            # refused now: deferred, it would fail at the stage's next decision, far from here
            raise MissingKeyError(
                f"observe(): the key is None at position {named.index(None)}; the score memory "
                "would give every such sample one loss. Hand observe() the keys the stage handed "
                "on with the batch (batch['__key__'], or sp.shard_key(batch))"
            )
        self._decider.observe(named, values, epoch)
        self._observed_rows += len(named)
        self._fed_back = True
        elapsed = time.perf_counter() - t0
        # waiting for a device copy (a flush of DEFER_ROWS losses) is the step's time, not the stage's
        self._account.observe += elapsed - ((memory.waited - waited) if memory is not None else 0.0)

    def publish_memory(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        keep: int | None = 2,
        retry_timeout: float = RETRY_TIMEOUT,
    ) -> str:
        """Publish the score memory for ``PreDecodeFilter`` stages in DataLoader workers.

        Call it at the end of each epoch; workers load the newest publication when they next
        start iterating and decide from it (see ``siftpipe.predecode``). Returns its version.
        Once ``cost_guard`` has stopped sifting, and while the stage's warm-up (``delay``)
        runs, the publication tells workers to keep every sample (beta 0). Each rank publishes
        to its own ``url``: the publication names its rank, and a filter of another rank
        refuses it. ``keep``: how many of this memory's
        publications under ``url`` to keep, the new one included (older ones are deleted; the
        default 2 keeps the one a worker may still be loading; ``None``: delete none; see
        ``ScoreMemory.publish``). ``retry_timeout``: seconds each file is written again while
        storage fails in a way that may pass (an outage), then ``SiftError``.
        """
        if self.memory is None:
            raise ConfigError(
                "publish_memory() needs a score memory: Sifter(..., memory=sp.ScoreMemory(...))"
            )
        beta = getattr(self.policy, "beta", None)
        if beta is None:
            raise ConfigError(
                "sifting before decode uses the relative-probabilistic rule; give the Sifter a "
                f"RelativeProbabilistic policy (it has {type(self.policy).__name__})"
            )
        if self._decider.stopped or self._decider.counts["seen"] < self.delay:
            # the cost guard stopped sifting, or the stage's warm-up (delay) runs on: workers keep
            # every sample too (percentile ** 0 = 1). Until 2026-12-05 a warm-up longer than an
            # epoch was cut short by the workers' drops (found by review)
            beta = 0.0
        return self.memory.publish(
            url,
            storage_options,
            epoch=self.epoch,
            seed=self.seed,
            beta=float(beta),
            audit_directory=_directory_of(self.audit),
            rank=dist_info()[0],
            keep=keep,
            run_began=self._run_began,
            key=publish_key(self.key),
            retry_timeout=retry_timeout,
        )

    def __call__(self, source: Iterable[Any]) -> Iterator[Any]:
        """Sift ``source``: an iterator over the kept samples (or batches), in input order.

        A fresh call starts a new pass (``epoch`` + 1 after the first, unless ``set_epoch`` was
        called), and hands that epoch to a ``ShardSource`` inside ``source`` (``set_epoch``: its
        shard order, which a DataLoader's fresh workers copy from the object here). After
        ``load_state_dict`` the call resumes: feed ``source`` from item ``state["consumed"]`` on
        (a tracked stateful source is repositioned for you).
        """
        return self._open(source, surface=False)

    def _give_up_loaded_pass(self, handed_from: int | None = None, handed_rows: int = 0) -> bool:
        """A mid-pass checkpoint loaded and not read from since, given up for a new pass (a
        torchdata node's ``reset(None)`` after ``reset(state)``: "from the beginning"; Lightning
        opening the next epoch after a checkpoint of an epoch its ``limit_train_batches`` cut
        short): its rows decided kept and never handed on are noted as a pass left early notes
        them (``stats.unhanded``, the audit log), and the next call starts the pass after it.

        Args:
            handed_from: The seq of the first of ``handed_rows`` kept rows the checkpoint's run
                had handed on and its consumer never trained (a trainer's batches fetched ahead,
                which a job resumed inside the pass would train first): noted with the pending
                ones (the kept rows from it up to the checkpoint are all of them).
            handed_rows: How many, in samples.

        True if there was a pass to give up or rows to note."""
        passes = self._passes
        restore = passes.restore
        if restore is not None and restore.get("pass_open") and restore.get("noted"):
            # close() noted its rows already (_leave_pass): only the handed ones are new (the
            # review of that: a reset(None) after close() counted them twice)
            self._forget_restore()
            if handed_from is not None and handed_rows > 0:
                self._note_given_up(handed_from, handed_rows)
            return True
        if handed_from is not None and handed_rows > 0 and (restore is None or not restore.get("pass_open")):
            self._note_given_up(handed_from, handed_rows)
            return True
        if restore is None or not restore.get("pass_open"):
            return False
        passes.close_active("the checkpoint's pass was given up for a new one before it was read")
        ledger = self._ledger
        ledger.drop_pending(consumed=int(restore["consumed"]))
        ledger.pending.extend(restored_groups(restore))
        ledger.emitted = int(restore["emitted"])
        if handed_from is not None and handed_rows > 0:
            pending = sum(group.n_kept for group in ledger.pending) - ledger.emitted
            self._note_given_up(handed_from, handed_rows + max(0, pending))
        else:
            self._unhanded()
        ledger.drop_pending()
        self._forget_restore()
        return True

    def _leave_pass(self, why: str) -> None:
        """Close the running pass for the reason ``why`` (``Passes.close_active``). Of a loaded
        mid-pass checkpoint not read since (its pass opened and not read, its iterator dropped,
        or never opened), the rows decided kept and never handed on are noted so (found by
        review, 2026-12-06: a job resumed and stopped again before its first batch left no note,
        and its log read those rows as trained, verify OK). The checkpoint's position stays:
        ``state_dict()`` after this still resumes inside its pass."""
        passes = self._passes
        passes.close_active(why)
        restore = passes.restore  # (a pass that started reading has re-read it, and let it go)
        ledger = self._ledger
        if restore is None or not restore.get("pass_open") or restore.get("noted") or ledger.pending:
            return
        # noted, and kept: a state taken after close() still resumes the checkpoint's pass (the
        # review of the fix: giving the pass up lost its position, 92 samples of the epoch never
        # trained); the resumed attempt re-reads those rows, and its notes decide them
        restore["noted"] = True
        before = self._decider.counts["unhanded"]
        consumed = ledger.consumed
        ledger.pending.extend(restored_groups(restore))
        ledger.emitted = int(restore["emitted"])
        try:
            self._unhanded()
        finally:
            ledger.drop_pending(consumed=consumed)
            restore["noted_rows"] = self._decider.counts["unhanded"] - before

    def _handed_until(self) -> int:
        """The seq before which every row decided kept has been handed on: the first kept row
        the pending groups still hold (a loaded checkpoint's, while its pass is not read yet),
        or the next seq to decide (``AuditLog.track_handed``)."""
        ledger = self._ledger
        seq = ledger.seq_at(ledger.emitted)
        restore = self._passes.restore
        if seq < 0 and restore is not None and restore.get("pass_open") and not ledger.pending:
            seq = kept_seq(restored_groups(restore), int(restore["emitted"]))
        return seq if seq >= 0 else int(self._decider.counts["seen"])

    def _note_given_up(self, first: int, count: int) -> None:
        """``count`` kept rows from seq ``first`` to the loaded checkpoint's last decision, never
        trained: counted (``stats.unhanded``) and noted in the audit log (one range: the rows
        decided after ``first`` that the checkpoint's run kept are all of them)."""
        self._decider.counts["unhanded"] += count
        note = getattr(self.audit, "unhanded", None)
        if note is not None:
            note(int(first), max(int(first), self._decider.counts["seen"] - 1), int(count))

    def _surviving(self, source: Iterable[Any]) -> Iterator[Any]:
        """``self(source)``, whose pass outlives an error its source raises: the error comes out
        as a ``Raised`` item (its consumer raises it), after the samples read before it are
        decided and handed on, and the next read asks the source again (a torchdata node's
        consumer goes on after an error: ``SiftNode``)."""
        return self._open(source, surface=True)

    def _open(self, source: Iterable[Any], surface: bool) -> Iterator[Any]:
        _check_not_in_worker()
        # settings may be set after construction (sifter.micro_batch = ...): checked as the
        # constructor checks them, before a pass runs with them (micro_batch = 0 trained nothing)
        flags = {name: getattr(self, name) for name in self.FLAGS}
        check_arguments(
            self.model, self.micro_batch, self.batched, self.delay, self.output_batch, self.on_nan,
            self.on_oom, self.memory, self.key, self.unknown, self.pad_micro_batch, self.seed,
            self.autocast, self.policy, drop_last=self.drop_last, flags=flags,
        )  # fmt: skip
        resolve_scorer(self.scorer)  # callable (set as a name, it was resolved then)
        self._decider.follow_policy()  # (the policy may have changed since it was set)
        if self.policy.uses_memory:  # set since: checked for a memory and bound to it, as made
            resolve_policy(self.policy, self.memory)
        # where this scorer's losses come from, for the audit log (a proxy scorer says "proxy")
        self._decider.loss_source = SOURCES.index(getattr(self.scorer, "loss_source", "forward"))
        device = self.device
        if device.type == "meta" and self._device is None:
            raise ConfigError(
                "the model's parameters are on the meta device (shapes without data), so it cannot "
                "score: materialise it first (model.to_empty(device=...) and load its weights)"
            )
        if self._rng_untouched:
            self._rng_untouched = False
            self._seed_by_rank()
        tracked = self._tracks(source)
        restore = self._passes.restore
        if restore is not None and restore.get("noted"):
            # a closed Sifter read again: close() noted the loaded pass's undelivered rows never
            # handed on, so this pass does not resume it and hand them on (the review of that
            # fix); as after close() of a pass that was read, the next pass starts. (A state
            # taken before this still resumes it, in a new Sifter with a new log.)
            self._forget_restore()
        resume, advance = self._passes.begin(source, tracked, self.track_source)
        if advance:
            self.epoch += 1
        if resume is None:
            # a loss history merged across ranks (sp.sync_history) is of the pass it was merged
            # in: a new pass decides by this rank's own window until its first sync. Kept on, a
            # pass shorter than EqualSteps' sync_every never synced, and the history merged in
            # an early epoch (losses of a model that had not learned yet) decided every later
            # one (found by review, 2026-12-05: keep rates of 0.06 where the ranks' own windows
            # kept 0.4). Cleared as the pass opens, so a checkpoint taken any time after holds
            # what the pass decides by
            clear = getattr(self.policy, "clear_reference", None)
            if callable(clear):
                clear()
        unread = resume is not None and not resume.get("pass_read", True)
        if resume is None or not self._passes.source_restored or unread:
            # a ShardSource's shard order is its epoch's: its copies in a DataLoader's fresh
            # workers learn the epoch from the object here (a pass resumed mid-way from the
            # source's own state reads the epoch that state says; one that had read nothing
            # holds the state the last epoch ended with, so it is told too: found by review,
            # 2026-12-05, a resumed epoch 1 read in epoch 0's shard order)
            follow_epoch(source, self.epoch)
        # (every pass: a filter's copies in fresh workers learn it from the object here)
        self._tell_run(source)
        self._shards.watch(source)  # (not kept for set_epoch: a pass's source is the pass's)
        if self.audit is not None:
            if self._sink_bound is not self.audit:
                # once a sink: what the log records about the stage is its first pass's. (A sink
                # given later, in place of a closed one or to load a checkpoint into, is bound
                # too: until 2026-12-06 its claim and manifests held no settings; review.)
                self.audit.bind(self.describe(), self._shards.report)
                self._sink_bound = self.audit
                track_handed = getattr(self.audit, "track_handed", None)
                if callable(track_handed):  # (an AuditLog: its manifests say what was handed on)
                    track_handed(self._handed_until)
            self.audit.start()
            _leave_at_exit(self)
        self._scoring.device = CPU if device.type == "cpu" else device
        reader = Reader(source, self._passes.began_reading)
        if resume is not None:
            # its source gives the checkpoint's item `consumed` next: errors the checkpoint's pass
            # handed on after it come again and are passed over
            reader.pulled = int(resume["consumed"])
            reader.skips = list(self._passes.raised)  # (the state holds only those it meets again)
        gen = self._run(reader, resume, surface, self._passes.id, (threading.get_ident(), os.getpid()))
        self._passes.attach(gen, reader)
        return gen

    def _seed_by_rank(self) -> None:
        """While nothing was drawn: ranks known now that were not when the stage was made draw
        each their own (every rank drew alike before, while its checkpoints named their ranks)."""
        seed = self._rank_seed()
        if seed != self.rng_seed:
            self.rng_seed = seed
            self._decider.rng = np.random.default_rng(seed)

    def _rank_seed(self) -> int | list[int]:
        rank, world = dist_info()
        return self.seed if world <= 1 else [self.seed, int(rank)]

    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """Everything needed to continue exactly: plain tensors, lists, strings and numbers.

        Args:
            held: The last batches handed on that the consumer has not trained (a prefetcher
                holds them), at most ``hold`` (the constructor's): the state resumes before
                them, so the resumed job hands them on again. Raises ``SiftError`` if the stage
                cannot (``hold`` smaller, fewer batches handed on in this pass, or the pass ended:
                take that state before the prefetcher reads the pass to its end).

        It holds no sample data; samples decided but not yet handed on are described by their
        keep mask, weights and keys, and are re-read from the source on resume (never
        re-scored). Safe for ``torch.load(..., weights_only=True)``.

        Taken inside a pass (while its iterator is alive, before its first item or after any
        item), a stage loaded with it continues that pass. When no decided sample is waiting to
        be handed on, it reads the next input item ahead (the pass takes it first) to record its
        key, so that a resumed source fed from the wrong position is caught. Taken after the pass
        ended, or after it was abandoned (``break`` out of the loop, ``close()``, an exception),
        the next call starts a new pass, as it would in this process. Leaving a ``for`` loop with
        ``break`` abandons the pass when the loop's iterator dies with it (``for x in
        sifter(data)``); an iterator held in a variable lives on, and a state taken then continues
        its pass: close it first (``batches.close()``) to take one that starts the next.

        Take it between items, from the thread that reads the pass (or with that thread paused):
        another thread caught inside ``next()`` (a group half decided) makes it raise
        ``PassClosedError``, and so does a read that begins and ends while the state is being
        taken (the state would mix two moments). These are checks, not a lock: pause the reading
        thread, or take the state from it, rather than retry.

        A stage whose score memory the training step feeds (``observe()``, as the recipe's is)
        takes it after ``observe()`` for the batch just trained: losses still in the loop's hands
        are in no state, and a job resumed from it decides otherwise than this one goes on to.
        A state taken inside a pass that handed on more rows than ``observe()`` got since the
        pass began, beyond the ``held`` batches, says so with a ``ScoreMemoryWarning``.
        """
        return self._state(held, 0)

    def _state(self, held: int, coming: int) -> dict[str, Any]:
        """``state_dict(held)``; ``coming``: rows handed on and not yet trained that the caller's own
        state hands on again after a resume (a trainer integration's unacknowledged batches),
        whose losses observe() gets then."""
        # (before and after: a state taken while another thread decides a group would be refused
        # only when loaded, as damaged; found by review, 2026-12-05)
        waiting = "take the state between items: pause the thread reading the pass first"
        self._passes.check_not_running(doing=waiting)
        if self._rng_untouched:
            # a checkpoint before the first pass of a stage made before the process group:
            # saved the shared seed's state, and every rank resumed with the same draws (found
            # by review, 2026-12-05); its own rank's now, as the pass would have drawn
            self._seed_by_rank()
        moment = self._moment()
        held_rows = self._held_rows(held)
        self._warn_unobserved(held_rows + coming)
        state = {
            "version": self.STATE_VERSION,
            "config": stage_config(self),
            "policy": self.policy.state_dict(),
            "rng": self._decider.rng.bit_generator.state,
            "counts": self._saved_counts(),
            "seconds": list(self._decider.seconds),
            "epoch": self.epoch,
            "model_version": self.model_version,
            **self._passes.position(
                self._decider.keys, self.batched, self.key, held_rows, self._held_steps(held)
            ),  # _passes.POSITION
            "audit": None if self.audit is None else self.audit.state_dict(),
            "memory": None if self.memory is None else self.memory.state_dict(),
            # wall time, like "seconds": not digested (it cannot be checked against anything)
            "account": self._account.state_dict(),
            # when the run began (unix s): a resumed run takes no publication older than it
            "run_began": self._run_began,
        }
        # An entry damaged, or swapped in from another checkpoint (another rank's decisions, say),
        # can look as well formed as the right one: the digests tell them apart.
        state["checks"] = {name: digest(value) for name, value in state.items() if name not in WALL_CLOCK}
        self._passes.check_not_running(doing=waiting)
        if self._moment() != moment:
            # a read that began and ended while the entries above were taken (neither check saw
            # it running): they may describe two moments (found by review, 2026-12-05)
            raise PassClosedError(
                "another thread read the pass while its state was being taken, so the state "
                f"could mix two moments and is not returned; {waiting}"
            )
        return state

    def _last_handed(self) -> tuple[int, int] | None:
        """The rows and first seq of the batch this process handed on last in the open pass, by
        the stage's own record (None: none, one taken back, or a stage handing on single
        samples): a trainer integration's note of each batch it hands the trainer."""
        out = self._output
        if out is None or not out.recent:
            return None
        rows, first, _ = out.recent[-1]
        return rows, first

    def _warn_unobserved(self, held_rows: int) -> None:
        """A state taken inside a pass that handed on more rows than ``observe()`` got since it
        began (beyond ``held_rows``, which the resumed job hands on again), by a stage whose
        memory the training step feeds: their losses are in no state, and the resumed job decides
        otherwise than this one would (found by review, 2026-12-06: a checkpoint between the
        step and observe(), silently). Rows counted, not keys compared: a batch observed twice
        hides one never observed."""
        out = self._output
        if (
            self.memory is None
            or not (self._fed_back or not self.remember_forward)
            or out is None
            or not (self._passes.open and self._passes.is_current(out.pass_id))
        ):
            # (a pass ended or left: the state starts the next one; a batch read and never
            # trained there is discard_last()'s, and rows cut downstream at the end the consumer's)
            return
        missing = out.handed - self._observed_rows - held_rows
        if missing > 0:
            warnings.warn(
                f"siftpipe: state_dict() was taken with {missing} rows of this pass handed on "
                "and not yet given to observe(): their losses are in no state, so a job resumed "
                "from it remembers none of them and decides its samples otherwise than this "
                "run goes on to (no sample is lost: they count as trained). Take the state after "
                "observe() for the batch just trained, or, for batches handed on and not yet "
                "trained (a prefetcher's), with state_dict(held=k)",
                ScoreMemoryWarning,
                stacklevel=4,
            )

    def _forget_restore(self) -> None:
        """Forget a loaded mid-pass checkpoint given up (``_give_up_loaded_pass``), or whose
        undelivered rows ``close()`` noted (``_leave_pass``): the next call starts a new pass."""
        passes = self._passes
        restore = passes.restore
        assert restore is not None
        passes.restore = None
        passes.open = False
        if not restore.get("pass_read", True):
            # a pass that had read nothing, given up: the next one is the same epoch, as in the
            # process that took the state (found by review, 2026-12-05: one epoch ahead)
            passes.unstarted = True

    def _saved_counts(self) -> dict[str, Any]:
        """The counters a state holds: a loaded checkpoint's rows that ``close()`` noted never
        handed on (``_leave_pass``) and whose position the state still holds are the checkpoint's
        pending rows again, which the resumed run hands on: not counted unhanded (the review of
        the fix: ``stats.unhanded`` grew by them at each load, close and save)."""
        counts = dict(self._decider.counts)
        restore = self._passes.restore
        if restore is not None and restore.get("noted"):
            counts["unhanded"] -= int(restore.get("noted_rows", 0))
        return counts

    def _moment(self) -> tuple[int, int, int, int, bool]:
        """What a read of the pass moves: its position (rows and items handed on), the samples
        decided, the pass. Equal before and after ``state_dict`` built its entries: no read
        happened in between."""
        ledger = self._ledger
        ledger.trim()
        passes = self._passes
        return ledger.consumed, ledger.emitted, self._decider.counts["seen"], passes.id, passes.open

    def _held_steps(self, held: int) -> int:
        """Of the last ``held`` batches handed on (checked by ``_held_rows``), those the consumer
        counted a step for (``pass_steps``): ``EqualSteps`` read them already when a prefetcher
        around it holds them, not when the prefetcher sits between it and the stage. The state
        resumes before them, and its step count too (found by review, 2026-12-05: the resumed
        steps ran ahead by the held batches, so ``sync_every``'s syncs fell at other steps and
        the ranks trained other samples)."""
        passes = self._passes
        out = self._output
        if not held or out is None or not passes.open:
            return 0
        # the stage's batches the consumer counted in this process, one step each, against those
        # trained: all handed on but the held ones
        counted = passes.steps - passes.steps_opened
        # (at most the held batches: steps counted for items not the stage's, EqualSteps'
        # replayed ones, are not among them)
        return min(int(held), max(0, counted - (out.batches - int(held))))

    def _held_rows(self, held: int) -> int:
        """Rows of the last ``held`` batches handed on in the open pass (``state_dict(held=)``)."""
        count = integer_count(held)
        if count is None or count < 0:
            raise ConfigError(f"held is a number of batches >= 0, got {held!r}")
        held = count
        if not held:
            return 0
        out = self._output
        # (hold set after construction is not checked there: past RECENT_BATCHES the stage does
        # not remember the batches, and a state would resume from the wrong row; review, 2026-12-05)
        if held > min(self.hold, RECENT_BATCHES):
            raise SiftError(
                f"state_dict(held={held}): the stage keeps what resuming before {held} batches "
                f"needs only with Sifter(..., hold={held}) or more (it has hold={self.hold}; at "
                f"most {RECENT_BATCHES})"
            )
        if out is None or not self._passes.is_current(out.pass_id) or not self._passes.open:
            raise SiftError(
                f"state_dict(held={held}): no pass is open (a prefetcher that read the pass to its "
                "end closes it): a state that resumes before batches still held is taken inside "
                "their pass. In an epoch's last steps, checkpoint after its last step instead "
                "(state_dict(), nothing held then), or not at all"
            )
        if held > out.batches or self._passes.restore is not None:
            raise SiftError(
                f"state_dict(held={held}): this process handed on {out.batches} batches of the "
                "pass since it opened (or resumed): it cannot resume before more"
            )
        return sum(rows for rows, _, _ in out.last(held))

    def override_on_resume(self, *names: str) -> None:
        """Settings (``Sifter.RESUME_OVERRIDES``) in which this stage may differ from the
        checkpoint it is next loaded from, on purpose, as ``load_state_dict(override=names)``
        takes them: for a checkpoint that a loader or trainer loads (``SiftNode`` through a
        torchdata ``Loader``, ``StatefulDataLoader``, the Lightning callback, ``SiftTrainer``),
        where no call of the user's takes ``override=`` (found by review, 2026-12-05: the
        ``ResumeError``'s advice could not be followed there). Kept for every later load; call
        it with no names to clear them."""
        self._resume_overrides = frozenset(override_names(names))

    def load_state_dict(self, state: Mapping[str, Any], *, override: Iterable[str] = ()) -> None:
        """Restore a ``state_dict()``; the next ``sifter(source)`` call continues from it.

        The checkpoint must come from a stage set up alike: every setting that changes decisions
        or positions is compared, and a difference raises ``ResumeError`` naming it (``batched``,
        ``micro_batch``, ``output_batch``, ``delay``, ``on_nan``, ``seed``, ``key``, the policy's
        type and configuration, the score memory's presence, ``capacity``, ``max_age`` and
        ``remember_forward``, and the rank and world size). Settings that only change how losses
        are computed or what is handed on (``scorer``, ``device``, ``autocast``, ``pin_memory``,
        ``eval_mode``, ``on_oom``, ``pad_micro_batch``, ``drop_last``, ``collate_fn``, ``attach_weight``,
        ``weight_field``) are not compared: moving a job to other hardware must stay possible.
        The whole state is checked before anything is loaded: a partial or damaged one raises
        ``ResumeError`` naming the entry and leaves the stage (its running pass included) as it was.

        Args:
            state: What ``state_dict()`` returned (through ``torch.save``/``torch.load``).
            override: Names of settings (``Sifter.RESUME_OVERRIDES``) in which this stage may
                differ from the checkpoint on purpose; this stage's setting then wins, and the
                resumed run no longer decides as the uninterrupted one would. ``"policy"``: the
                checkpoint's loss history is carried over when both policies keep one (resized
                to this policy's window), else the policy starts empty. ``"seed"``: the generator
                restarts from this stage's seed. ``"memory"``: the checkpoint's remembered losses
                are loaded into this memory as far as they fit (none if either stage has none).
                ``"rank"``: a checkpoint of another rank or world size is loaded as it is (not
                with an audit log, which would write into the other rank's stream). ``"key"``:
                re-read samples are not checked by key. ``batched`` cannot be overridden.
                Added to those named with ``override_on_resume``.
        """
        check_state(state, self.batched)
        if state["version"] >= 2:
            check_policy_entries(self.policy, state)
        if self.audit is not None:
            self.audit.check_state(state["audit"])
        allowed = override_names(override) | self._resume_overrides
        differ = config_differences(state, stage_config(self), self.memory is not None)
        refused = [d for d in differ if d[0] not in allowed]
        if refused:
            names = sorted({d[0] for d in refused if d[0] in RESUME_OVERRIDES})
            fix = "construct the Sifter with the checkpoint's setting to resume exactly"
            if names:
                fix += (
                    f", or pass override={tuple(names)!r} to resume with this stage's on purpose "
                    "(where a loader or trainer loads the checkpoint: "
                    f"sifter.override_on_resume({', '.join(repr(n) for n in names)}) before it does)"
                )
            raise ResumeError(
                "the checkpoint was made with other settings, so decisions would differ: "
                + "; ".join(d[1] for d in refused)
                + f"; {fix}"
            )
        # Everything else was checked above; what can still fail (the policy's own loading, the
        # audit log's own checks) goes first, and is undone, so that a refused state leaves the
        # stage exactly as it was (its running pass included).
        before = self.policy.state_dict()
        loading = "policy"
        try:
            if "policy" in allowed and any(d[0] == "policy" for d in differ):
                carry_policy_state(self.policy, state["policy"])
            else:
                self.policy.load_state_dict(state["policy"])
            loading = "audit"
            if self.audit is not None:
                self.audit.load_state_dict(state["audit"], resumed_from=int(state["counts"]["seen"]))
                rereads = getattr(self.audit, "rereads_from", None)
                if callable(rereads) and state["pending"]:
                    rereads(int(state["pending"][0]["seq0"]))
        except Exception as exc:
            self.policy.load_state_dict(before)
            if isinstance(exc, ResumeError):
                raise
            why = f"{type(exc).__name__}: {exc}"
            raise ResumeError(
                f"the checkpoint's policy state does not fit policy {self.policy!r}: {why}; load a "
                "state this policy's state_dict() wrote"
                if loading == "policy"
                else f"the stage's audit sink {type(self.audit).__name__} could not load the "
                f"checkpoint's audit entry: {why}"
            ) from exc
        self._passes.close_active("load_state_dict() loaded a checkpoint into the stage")
        self._output = None  # its batches are not the checkpoint's to take back
        if self.memory is not None and state["memory"] is not None:
            self.memory.load_state_dict(state["memory"], fit="memory" in allowed)
            self._decider.memory_loaded()
        self._rng_untouched = False
        if "seed" in allowed and any(d[0] == "seed" for d in differ):
            self.rng_seed = self._rank_seed()
            self._decider.rng = np.random.default_rng(self.rng_seed)
        else:
            self._decider.rng.bit_generator.state = state["rng"]
        # from zeros: counters a state written before they existed load as 0, not as this stage's
        self._decider.counts = {**dict.fromkeys(COUNTS, 0), **{k: int(v) for k, v in state["counts"].items()}}
        # an earlier process ran passes: they count as evidence for the stage's warnings
        self._decider.passes_ended = 1 if self._decider.counts["seen"] else 0
        self._decider.seconds = [float(v) for v in state["seconds"]]
        self._account = CostAccount()  # the checkpoint's (states written before it: afresh)
        if "account" in state:
            self._account.load_state_dict(state["account"])
        self.epoch = int(state["epoch"])
        self.model_version = int(state["model_version"])
        # when the run the checkpoint is of began: its publications, and none older, are its own
        # (a state written before 2026-12-05 does not say: any publication is taken)
        began = state.get("run_began")
        self._run_began = (
            float(began) if isinstance(began, int | float) and not isinstance(began, bool) else None
        )
        self._resumed = (self.epoch, time.time())
        for pipeline in self._watched.alive():
            self._tell_run(pipeline)
        # the checkpoint's keys were read with another key setting: nothing to compare
        self._passes.load(state, forget_keys="key" in allowed and any(d[0] == "key" for d in differ))

    def close(self) -> None:
        """Stop the active pass and flush and close the audit log (if any). Reading the stopped
        pass's iterator on raises ``PassClosedError``."""
        self._leave_pass("the Sifter was closed (close(), or the end of a with block)")
        self._output = None
        if self.audit is not None:
            self.audit.close()

    def __enter__(self) -> Sifter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Sifter(scorer={self.scorer!r}, policy={self.policy!r}, micro_batch={self.micro_batch}, "
            f"delay={self.delay}, batched={self.batched}, output_batch={self.output_batch}, "
            f"device={self.device})"
        )

    # ------------------------------------------------------------------ the pass

    def _run(
        self,
        reader: Reader,
        resume: dict[str, Any] | None,
        surface: bool,
        opened: int,
        thread: tuple[int, int],
    ) -> Generator[Any, None, None]:
        self._check_thread(thread)  # before a resumed pass re-reads its groups, too
        if not self._passes.is_current(opened):
            # never read before the stage opened another pass (or loaded a state, or closed)
            raise self._closed_error()
        out = Output(
            self._ledger, self._scoring, self.output_batch, resumed=resume is not None, hold=self.hold
        )
        self._output = out
        self._observed_rows = 0
        groups = self._reread(reader, resume) if resume is not None else []
        this_pass = out.pass_id = self._passes.run_begins(resume)
        finished = closed = False
        seen_before = self._decider.counts["seen"]
        # a pass opened and never read before the cut is a whole pass: what the state says was
        # dropped before it is the previous pass's start (found by the review of the fix)
        self._account.pass_begins(resumed=resume is not None and bool(resume.get("pass_read", True)))
        self._decider.pass_begins(whole=resume is None)
        try:
            mark = yield from self._account.timed(self._outputs(out, reader, groups, surface, thread), out)
            self._ledger.trim()
            finished = True
            self._pass_ended(mark)
            self._decider.pass_ends()
            if resume is None and seen_before and self._decider.counts["seen"] == seen_before:
                self._warn_empty_pass(reader.source)
        except Superseded:
            closed = True  # the stage closed this pass (Passes.close_active)
        finally:
            # ended, abandoned, closed or failed: the next call starts a new pass, and so does a
            # stage loaded with a state taken from now on (unless a newer pass or a load came
            # first: a pass left in a reference cycle is closed whenever the garbage collector
            # gets to it)
            if not finished and self._passes.is_current(this_pass):
                # left early (a break, EqualSteps): still evidence, but the time since the last
                # group is not the stage's (the pass may be closed long after it was left)
                self._pass_ended(None)
                self._unhanded()
            # self._output stays: a prefetcher may have read the pass to its end before its
            # consumer discards a batch of it (discard_last); the next pass replaces it
            self._passes.run_ends(this_pass, finished, reader)
        if closed:
            # cleaned up; its consumer reading on is told why, not handed a quiet end of epoch
            # (the rest of the epoch untrained): this yield answers the stage's throw()
            reader.release()
            del reader, out, groups
            yield None
            raise self._closed_error()

    def handed_on_seq(self, batches: int) -> int | None:
        """Where the batch handed on ``batches`` batches ago began (1: the last one): the seq of
        its first row, a position in the pass's input in samples. ``None`` if the stage does not
        remember it: no batch handed on that far back in this process, a stage handing on
        single samples, or more than ``RECENT_BATCHES`` (64) back. A trainer integration notes
        with it where the batches it fetched and did not train begin."""
        out = self._output
        if out is None or batches < 1:
            return None
        recent = out.last(batches)
        return int(recent[0][1]) if len(recent) == batches else None

    def discard_last(self, fetched: int | None = None) -> int:
        """The consumer did not train the batch it read last from this stage's pass, and will read
        no more of the pass: note that batch's rows, and those of any batch handed on after it,
        as never handed on, as a pass left early notes the rest of its input (``stats.unhanded``;
        the audit log's note, which ``read_log``, ``replay`` and ``verify_log`` read as not
        kept), and end the pass if it is still open, as leaving it would (the next
        ``sifter(...)`` call starts a new one; a checkpoint from now on resumes there, as the
        uninterrupted run goes on). ``EqualSteps(..., sifter=)`` calls this for the batch a rank
        fetched for a step no rank takes, the one that ends the epoch.

        Args:
            fetched: Batches of this pass the consumer has read, the discarded one included,
                counted from when it began reading the pass (in this process). ``None``: the
                batch the stage handed on last. Fewer than the stage handed on means something
                between them read ahead (a prefetcher, in the same thread or not): the batches
                it holds after the discarded one were never trained either and are noted too.

        For a stage that hands on batches (``batched=True``, or ``output_batch``); the batch may
        be up to ``RECENT_BATCHES`` (64) behind the last one handed on, and the pass may have
        ended since (a prefetcher read it to its end). Returns the rows noted, in samples: 0,
        and nothing changed, when there is none to take back (no pass, a stage handing on
        single samples, or the batch already taken back). Raises ``SiftError`` (and notes
        nothing) if ``fetched`` is more than the stage handed on (something between them cuts or
        joins its batches: each item the consumer reads must be one batch of the stage's), or the
        batch is too far behind; ``PassClosedError`` if another thread is reading the pass this
        moment. Reading the ended pass's iterator again raises ``PassClosedError``.

        A checkpoint taken between reading the batch and this call records it as handed on: a
        job resumed from that checkpoint does not train it either, but its audit log reads the
        rows its re-read groups hold as kept (take checkpoints with ``state_dict(held=)``, which
        resumes before the batches a prefetcher holds)."""
        out = self._output
        if out is None or not out.recent:
            return 0
        handed = out.batches
        n = handed if fetched is None else int(fetched)
        if n > handed or n < 1:
            raise SiftError(
                f"discard_last(fetched={fetched}): the consumer read {n} batches of this pass but "
                f"the stage handed on {handed}; the batches it reads must be the stage's own, one "
                "for one (pass EqualSteps the sifted stream itself, or no sifter= where something "
                "between them re-batches: the audit log then reads the discarded rows as kept); "
                "nothing was noted"
            )
        behind = handed - n  # batches handed on after the discarded one (a prefetcher holds them)
        if behind >= len(out.recent):
            raise SiftError(
                f"discard_last(fetched={fetched}): the discarded batch is {behind} batches behind the "
                f"last one the stage handed on; it remembers the last {len(out.recent)}. Read "
                "ahead less between the stage and the consumer; nothing was noted"
            )
        self._passes.check_not_running()
        taken = out.last(behind + 1)
        out.recent.clear()  # taken back: not twice
        rows = sum(entry[0] for entry in taken)
        first, last = taken[0][1], taken[-1][2]
        assert first >= 0 and last >= first, (first, last)  # every handed batch's seqs are known
        self._decider.counts["unhanded"] += rows
        note = getattr(self.audit, "unhanded", None)
        if note is not None:
            note(first, last, rows)
        if self._passes.is_current(out.pass_id):
            # the rest of the pass, never to be read: noted as a pass left early is, and closed
            # (not a newer pass, opened after a prefetcher read this one to its end)
            self._passes.close_active(
                "discard_last() ended it (EqualSteps ended the epoch): the batch read last was not trained"
            )
        return rows

    def _unhanded(self) -> None:
        """The pass was left with rows decided kept (and recorded so) that were never handed on:
        count them, and tell the audit sink their seqs (one range: rows are handed on in order)."""
        ledger = self._ledger
        self._note_unhanded(ledger.emitted, sum(group.n_kept for group in ledger.pending))

    def _note_unhanded(self, start: int, stop: int) -> None:
        """Count kept rows ``start..stop-1`` of the pending groups (in the order they are handed
        on) as never handed on, and tell the audit sink their seqs (one range: rows are handed on
        in seq order)."""
        skip = start
        count = stop - start
        if count <= 0:
            return
        first = last = -1
        left = count
        for group in self._ledger.pending:
            index = group.kept_index
            if skip >= index.size:
                skip -= index.size
                continue
            if first < 0:
                first = group.seq0 + int(index[skip])
            take = min(index.size - skip, left)
            last = group.seq0 + int(index[skip + take - 1])
            left -= take
            skip = 0
            if not left:
                break
        count -= left
        if first < 0 or not count:
            return
        self._decider.counts["unhanded"] += count
        note = getattr(self.audit, "unhanded", None)
        if note is not None:
            note(first, last, count)

    def _closed_error(self) -> PassClosedError:
        return PassClosedError(
            f"this pass's iterator was read after the stage closed the pass: "
            f"{self._passes.closed_why}. What it had not handed on yet is not trained this epoch. "
            "Each sifter(...) call opens a new pass and closes the one before: read "
            "each pass to its end (or break out of it) before calling again, and make one Sifter "
            "per pipeline (a training and a validation stream cannot share one)"
        )

    def _warn_empty_pass(self, source: Any) -> None:
        """Warn once: a whole pass read nothing from its source, though earlier passes read
        samples (a spent iterator given again trains nothing that epoch, silently)."""
        if self._warned_empty:
            return
        self._warned_empty = True
        # an iterator (a generator, a torchdata node) is spent once read; an iterable starts over
        spent = isinstance(source, Iterator)
        why = (
            "a spent iterator given again (a generator, iter(loader), a torchdata node without a "
            "Loader or reset(None)) yields nothing: give each pass an iterable that starts over (a "
            "list, a DataLoader, a Loader(node))"
            if spent
            else "was it fed from a checkpoint's state['consumed'] after a checkpoint taken at a "
            "pass's end (the next pass reads the whole source: sifter.resume_from is None then), or "
            "did its reader skip every shard (shard_stats())?"
        )
        warnings.warn(
            f"siftpipe: pass of epoch {self.epoch} read nothing from its source (a "
            f"{type(source).__name__}), though earlier passes read {self._decider.counts['seen']:,} "
            f"samples, so nothing is trained this epoch: {why}",
            EmptyPassWarning,
            stacklevel=3,
        )

    def _pass_ended(self, mark: float | None) -> None:
        """Let the account judge the run so far (``mark``: when the stage last resumed, for a pass
        that ran to its end); with ``cost_guard``, stop sifting if it is not paying."""
        stopping = self._guard_may_stop()
        self._judged(self._account.pass_ends(mark, stopping=stopping), stopping)

    def _judged(self, logged: bool, stopping: bool) -> None:
        """After the account judged the run (``logged``: it found sifting not paying): stop if
        the guard may; say why not when it is on and may not (one rank of several)."""
        if not logged:
            return
        if stopping:
            self._decider.counts["stopped_at"] = self._decider.counts["seen"]
        elif self.cost_guard and not self._decider.counts["stopped_at"]:
            _log.warning(
                "siftpipe: cost_guard is on but does not stop sifting on one rank of %d: ranks step "
                "together, so a rank that stopped alone would save no step (its epochs would be cut "
                "instead); turn sifting off on every rank if it does not pay",
                dist_info()[1],
            )

    def _guard_may_stop(self) -> bool:
        """Whether the cost guard may stop sifting now: it is on, has not stopped, and this is the
        job's only process. On one rank of several it only logs: ranks step together (DDP,
        ``EqualSteps``), so a rank that stopped alone saves no step, and the pass's end then cuts
        its data at random instead of by loss (found by review, 2026-12-05)."""
        return self.cost_guard and not self._decider.counts["stopped_at"] and dist_info()[1] == 1

    def _check_thread(self, thread: tuple[int, int]) -> None:
        """``SiftInWorkerError`` if the pass opened in ``thread`` (its id and its process's) is
        read in another process, or in another thread and the stage would use the model or the
        score memory there."""
        ident, pid = thread
        if os.getpid() != pid:
            # a pass opened here and read in a forked copy (a DataLoader worker iterating the
            # stream made before it started): that thread's id is the same, its model a stale
            # copy (found by review, 2026-12-05: each worker scored and handed on every sample)
            _check_not_in_worker()
            raise SiftInWorkerError(_OTHER_PROCESS.format(opened=pid, here=os.getpid()))
        if threading.get_ident() != ident and (self.model is not None or self.memory is not None):
            raise SiftInWorkerError(_OTHER_THREAD.format(thread=threading.current_thread().name))

    def _outputs(
        self, out: Output, reader: Reader, groups: list[Group], surface: bool, thread: tuple[int, int]
    ) -> Iterator[Iterator[Any]]:
        """The items to hand on, group by group: the re-read groups', then each fresh group's
        once decided, then what the output still holds. ``surface``: an error reading the source
        is handed on as a ``Raised`` item and the pass goes on (``_surviving``). ``thread``: the
        one that opened the pass, which every group is decided in (``_check_thread``)."""
        for group in groups:
            yield out.hand_on(group)
        while True:
            self._check_thread(thread)  # a pass handed to another thread after its first items
            try:
                fresh = self._read(reader)
            except Exception as exc:
                if not surface:
                    # the pass ends with the error: rows waiting for a full output batch are
                    # handed on first (a short batch; with drop_last noted unhanded instead), as
                    # the samples read before it were
                    yield self._finish(out)
                    raise
                # the pass goes on: waiting rows come out in the next output batch; an end read
                # after the error is the source's own (it went on), not the error's
                reader.failed = None
                self._passes.raised_at(reader.pulled)
                self._ledger.error_held = False
                yield iter((Raised(exc),))
                del exc
                continue
            if fresh is None:
                break
            seen = self._decider.counts["seen"]
            try:
                self._decider.decide(fresh)
            except BaseException as exc:
                # a scorer's error, a non-finite loss: the pass ends with it, but the rows kept
                # before it and waiting for a full output batch are handed on first (recorded as
                # kept, they are trained; with drop_last noted unhanded), as on a source's error.
                # A group that failed before it was counted (its scoring, its losses) is not
                # pending (consumed stops before it); one counted is (its kept rows unhanded).
                # A KeyboardInterrupt too, though nothing more is handed on then
                pending = self._ledger.pending
                if self._decider.counts["seen"] == seen and pending and pending[-1] is fresh:
                    pending.pop()
                if isinstance(exc, Exception):
                    yield self._finish(out)
                raise
            if self._decider.device_wait:
                # waiting for the losses observe() queued on a CUDA device: the steps' time
                self._account.to_step(self._decider.device_wait)
            self._account.dropped += fresh.rows - fresh.kept_index.size
            yield out.hand_on(fresh)
        yield self._finish(out)

    def _finish(self, out: Output) -> Iterator[Any]:
        """The rows the output still holds as the pass ends (or fails): a short batch, or with
        ``drop_last`` nothing (the rows noted unhanded, as a left pass's are: audit, stats)."""
        if out.buffered:
            if self.drop_last:
                # always, as DataLoader(drop_last=True) does (a rule on what this pass handed on
                # before would hand a pass resumed after its last full batch a short one)
                if not out.handed and not out.resumed and not self._warned_all_dropped:
                    self._warned_all_dropped = True
                    warnings.warn(
                        f"siftpipe: the pass of epoch {self.epoch} kept {out.buffered} samples, fewer "
                        f"than output_batch={self.output_batch}, and drop_last=True dropped them "
                        "all: nothing was handed on (stats.unhanded counts them). Lower "
                        "output_batch, or pass drop_last=False",
                        EmptyPassWarning,
                        stacklevel=4,
                    )
                self._unhanded()
                out.drop()
            elif out.handed:
                self._warn_new_shapes()
        elif self.batched and self.output_batch is None and out.handed:
            self._warn_new_shapes(every_batch=True)
        return out.finish()

    def _warn_new_shapes(self, every_batch: bool = False) -> None:
        """Warn once: the pass ends with a short output batch while ``cudnn.benchmark`` is on
        with a CUDA device, so each epoch's new last-batch size is autotuned again
        (``every_batch``: batched mode without ``output_batch``, whose every batch handed on is
        the kept part of an input batch, of its own size)."""
        if self._warned_shapes or not torch.backends.cudnn.benchmark or not torch.cuda.is_available():
            return
        self._warned_shapes = True
        what = (
            "every batch this stage hands on is the kept rows of one input batch, so batch sizes "
            "change from step to step (batched=True without output_batch)"
            if every_batch
            else "this pass ends with a short batch, and its size changes every epoch (sifting "
            "keeps a different number of samples)"
        )
        fix = "output_batch=<the training batch size> and drop_last=True" if every_batch else "drop_last=True"
        warnings.warn(
            f"siftpipe: {what}: with torch.backends.cudnn.benchmark on, each "
            "new size is autotuned again (about 1-2 s per size for a small ResNet on an H200, "
            "measured by tools/bench_gpu.py; torch.compile recompiles likewise). Pass "
            f"Sifter(..., {fix}) to hand on only full output_batch batches",
            BatchShapeWarning,
            stacklevel=3,
        )

    def _read(self, reader: Reader) -> Group | None:
        if reader.has_ahead:
            snapshot = reader.ahead_snapshot
        else:
            # the tracked source's state is taken after iter() started this pass (before it, a
            # loader whose last pass was left mid-way would restore into that pass)
            t0 = time.perf_counter()
            try:
                reader.iterate()
            finally:
                # the source's time, paid with or without sifting (a DataLoader starting its
                # workers, a shard listing): charged to the stage, it stopped sifting that paid
                self._account.source += time.perf_counter() - t0
            snapshot = self._passes.snapshot()
            reader.snapshot_taken()
        t0 = time.perf_counter()
        if self.batched:
            try:
                batch = reader.next()
            finally:  # a read that fails is the source's time too (a pass may go on after it)
                self._account.source += time.perf_counter() - t0
            if batch is END:
                return None
            seen = self._decider.counts["seen"]
            batch, n = _batch.rows(batch, seen)
            group = Group([batch], n, seen, snapshot)
            if reader.skipped:
                group.skipped = tuple(reader.skipped)
        else:
            try:
                items = reader.take(self.micro_batch)  # type: ignore[arg-type]
            finally:
                self._account.source += time.perf_counter() - t0
            if not items:
                return None
            group = Group(items, len(items), self._decider.counts["seen"], snapshot)
            if reader.skipped:
                group.skipped = tuple(reader.skipped)
            if isinstance(reader.ahead, Raised):
                # the source raised after these: they are decided first and the error is raised
                # at the next read; a checkpoint until then resumes before this group (the
                # ledger keeps it), so that the resumed pass meets the error too
                reader.ahead_snapshot = self._passes.snapshot()
                reader.snapshot_taken()
                self._ledger.error_held = True
        if self._ledger.tail is not None:
            note_tail(group, self.batched, self.key)
        elif self.key is not None:
            note_keys(group, self.batched, self.key)
        self._ledger.pending.append(group)
        return group

    def _reread(self, reader: Reader, state: Mapping[str, Any]) -> list[Group]:
        """Re-read the samples decided before the checkpoint but not yet handed on.

        Raises ``ResumeError`` with the stage as it was (the checkpoint still to be resumed) if the
        source does not give them."""
        try:
            weight_field = self.weight_field if self.attach_weight else None
            passes = self._passes
            groups = reread_groups(
                reader, state, self._ledger, self.batched, self.key, weight_field,
                passes.snapshot if passes.source is not None else None,
            )  # fmt: skip
            if not groups:
                check_next(reader, state, self._passes.source, self.batched, self.key)
            return groups
        except BaseException:
            self._ledger.drop_pending()
            raise

    # ------------------------------------------------------------------ helpers

    def _tracks(self, source: Any) -> bool:
        able = isinstance(source, StatefulSource)
        if self.track_source is None:
            return able
        if self.track_source and not able:
            raise ConfigError(
                f"track_source=True but the source ({type(source).__name__}) has no "
                "state_dict/load_state_dict"
            )
        return self.track_source


def _check_observed(keys: Any, losses: Any) -> None:
    """Refuse what ``observe()`` would pair wrongly: keys that are not one ordered sequence of
    keys (a string would be split into letters, a set pairs keys and losses in no order), and
    losses with more than one dimension longer than 1 (flattening a (batch, tokens) loss pairs
    tokens with keys). A (B, 1) key tensor is B keys, as the stage reads the batch's."""
    if not isinstance(keys, Iterable) or isinstance(keys, str | bytes | set | frozenset | Mapping):
        raise ConfigError(
            f"observe() takes the batch's keys as one ordered sequence (a list, a tuple, or an "
            f"integer tensor or array), got {type(keys).__name__}: pass batch['__key__']"
        )
    if getattr(keys, "ndim", None) == 0:
        # (found by review, 2026-12-05: "TypeError: object of type 'int' has no len()")
        raise ConfigError(
            f"observe() takes the batch's keys as one ordered sequence, got a 0-d "
            f"{type(keys).__name__} (one key): pass observe([key], [loss]), or the batch's keys"
        )
    parts = (
        list(losses)
        if isinstance(losses, list | tuple) and any(isinstance(v, torch.Tensor) for v in losses)
        else [losses]
    )
    for part in parts:  # (a list of loss tensors is joined: each is checked as one would be)
        _check_losses_part(part)
    if isinstance(losses, list | tuple) and losses and all(type(v) is bool for v in losses):
        raise ScorerOutputError(_BOOLEAN_LOSSES)


_BOOLEAN_LOSSES = (
    "observe() got boolean losses (a mask, a correctness flag?); pass one real loss per sample: "
    "loss(reduction='none') of the training step"
)


def _check_losses_part(losses: Any) -> None:
    """``_check_observed``'s checks of the losses, or of one tensor of a list of them."""
    if not isinstance(losses, torch.Tensor):
        array = None
        if isinstance(losses, np.ndarray):
            array = losses
        elif isinstance(losses, list | tuple) and losses:
            try:
                array = np.asarray(losses)
            except (TypeError, ValueError):  # ragged: refused by name where they are read
                array = None
        kind = array.dtype.kind if array is not None else None
        if kind == "O" and array is not None:
            # numbers, and None among them (no loss: NaN, ignored, as before), read as numbers
            text = any(isinstance(v, str | bytes) for v in array.reshape(-1).tolist())
            kind = "U" if text else None
        if kind in ("U", "S"):
            # numpy reads "0.5" as 0.5: a column of text handed as losses passed unseen (review)
            raise ScorerOutputError(
                "observe() got losses that are not numbers (text); pass one real loss per "
                "sample: a float tensor or array"
            )
        if kind == "b":
            raise ScorerOutputError(_BOOLEAN_LOSSES)
    if getattr(losses, "dtype", None) is torch.bool:
        raise ScorerOutputError(_BOOLEAN_LOSSES)
    if isinstance(losses, torch.Tensor):
        problem = not_dense(losses)
        if losses.is_meta:
            what, fix = "on the meta device (shapes without values)", "compute them on a real device"
        elif problem is not None:
            what, fix = f"as a {problem[0]} tensor", problem[1]
        if losses.is_meta or problem is not None:
            raise ScorerOutputError(
                f"observe() got the losses {what}; it takes one loss per key in a dense tensor "
                f"or array: {fix}"
            )
    dtype = getattr(losses, "dtype", None)
    if dtype is not None and (getattr(dtype, "is_complex", False) or getattr(dtype, "kind", "") == "c"):
        raise ScorerOutputError(f"observe() got complex losses ({dtype}); pass one real loss per sample")
    shape = getattr(losses, "shape", None)
    if shape is not None and sum(1 for d in shape if d != 1) > 1:
        raise ScorerOutputError(
            f"observe() takes one loss per sample, got losses of shape {list(shape)}: reduce them "
            "per sample first (e.g. loss.mean(dim=1) for per-token losses)"
        )


def _directory_of(sink: Any) -> str | None:
    """The audit log's directory (where workers put their ``_predecode`` records), if the sink has
    one: the one it lets others read (an ``AuditLog`` refuses to share a URL with credentials)."""
    directory = getattr(sink, "shared_directory", None)
    if directory is None:
        directory = getattr(sink, "directory", None)
    return directory if isinstance(directory, str) else None


_OTHER_PROCESS = (
    "siftpipe.Sifter's pass was opened in process {opened} and is read in process {here}, a copy "
    "forked from it, whose model is a copy of the weights as they were then: its scores would be "
    "stale, and every copy would hand on the same samples. Sift in the training process after "
    "the loader: `for x in sifter(loader)`, or WebLoader(dataset, ...).sift(sifter)."
)
_OTHER_THREAD = (
    "siftpipe.Sifter's pass is read in thread {thread!r}, not in the thread that opened it (called "
    "sifter(...), or reset the SiftNode): a prefetching thread (torchdata's Prefetcher, PinMemory or "
    "ParallelMapper(method='thread') above a SiftNode, a background generator around the sifted "
    "stream) would score with the model while the training step uses it (the stage switches it "
    "to eval mode to score) and decide from the score memory while observe() writes to it. Read "
    "the sifted stream in the training thread: put thread-based nodes below the SiftNode "
    "(prefetch and pin the decoded input, not the sifted output), or open the pass in the thread "
    "that reads it and trains"
)


def _check_not_in_worker() -> None:
    info = get_worker_info()
    if info is not None:
        raise SiftInWorkerError(
            f"siftpipe.Sifter is running inside DataLoader worker {info.id}, where the model is "
            "a copy made when the worker started: its scores would come from stale weights. "
            "Decode and batch in the workers, and sift in the training process after the "
            "loader: WebLoader(dataset, ...).sift(sifter), or `for x in sifter(loader)`."
        )
    worker = _torchdata_worker()
    if worker is not None:
        # a Sifter called in a ParallelMapper's map function: torchdata's worker processes are
        # not DataLoader workers (found by review, 2026-12-05, and documented; refused since
        # 2026-12-06: a process scored with its copy of the model, a thread raced the step)
        raise SiftInWorkerError(_TORCHDATA_WORKER.format(worker=worker))


_TORCHDATA_WORKER = (
    "siftpipe.Sifter is called inside torchdata's worker {worker} (a ParallelMapper's map "
    "function, or another torchdata node's thread or process), which only moves data: in a "
    "worker process the model is a copy made when it started, so its scores would come from "
    "stale weights; in a worker thread the stage would score with the model while the training "
    "step uses it. Decode in the mapper and sift above it, in the training loop: "
    "SiftNode(ParallelMapper(source, decode, ...), sifter), or `for x in sifter(Loader(node))`."
)


def _torchdata_worker() -> str | None:
    """``"thread <name> running <function>"`` (or ``process``) when this thread, or this process,
    runs a function of torchdata's nodes (``ParallelMapper``'s ``_apply_udf``, a prefetcher's
    loop): those only move data, never train. Read from the running ``Thread``'s and
    ``Process``'s target, which both keep while they run."""
    runners = (("thread", threading.current_thread()), ("process", multiprocessing.current_process()))
    for kind, runner in runners:
        target = getattr(runner, "_target", None)
        module = getattr(target, "__module__", None)
        if isinstance(module, str) and (module == "torchdata.nodes" or module.startswith("torchdata.nodes.")):
            name = getattr(target, "__qualname__", None) or getattr(target, "__name__", "?")
            return f"{kind} {runner.name!r} running {module}.{name}"
    return None
