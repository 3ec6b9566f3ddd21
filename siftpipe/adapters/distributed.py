"""Sifting on every rank of a torch.distributed job: equal steps, shared score memories, and an
opt-in global loss history.

Each rank sifts its own stream with its own history and memory. Three problems follow, and this
module solves them:

* **Unequal steps.** Ranks keep different numbers of samples, so a naive epoch ends at different
  steps on different ranks and DistributedDataParallel deadlocks in the next all-reduce.
  ``EqualSteps`` makes every rank take the same number of steps: before each step, one all-reduce
  of a single integer agrees whether *every* rank still has a batch; the epoch ends for all at
  the first step some rank cannot take. (Or, over resampled shards, take a fixed number of steps
  per epoch: ``fixed_steps``.)
* **Local memories.** A ``DistributedSampler(shuffle=True)`` deals the samples to ranks anew
  each epoch, so a rank's ``ScoreMemory`` would know the losses of about ``1 / world`` of the
  samples it meets next epoch and keep the rest unknown, unsifted. ``sync_memory`` sends each
  rank's new entries to every other rank; ``EqualSteps(sifter=...)`` calls it at the end of
  each epoch when the sifter has a memory.
* **Local percentiles.** With ``sync_every=k``, every k steps the ranks all-gather a sketch of
  their loss windows (``quantiles`` numbers each) and every rank's policy then takes percentiles
  against the merged, global distribution. The exchange rides on the same lockstep as the step
  agreement, so ranks whose micro-batch counts differ can never meet mismatched collectives.

Collective-call contract: ``EqualSteps`` makes exactly one collective call per step it yields
plus one at the end of the epoch, on every rank, and a sync step makes one more (an all-gather of
``quantiles + 1`` float64 per rank); with a score memory to share, the end of the epoch makes
two more (``sync_memory``: an all-gather of one count, then of 16 bytes per new entry). Nothing
else in siftpipe calls a collective after construction (an ``AuditLog`` built without a run id
broadcasts rank 0's id once, in its constructor; the Lightning callback's ``state_dict`` and its
memory sharing when a pass begins).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..core.memory import ScoreMemory
from ..core.policies import HistoryPolicy
from ..core.ranks import dist_info
from ..errors import ConfigError, ScoreMemoryWarning, SiftError

__all__ = ["EqualSteps", "dist_info", "exit_process", "fixed_steps", "sync_history", "sync_memory"]

T = TypeVar("T")


def _device_for(group: Any) -> torch.device:
    """Where collective tensors must live for the group's backend (CUDA for NCCL)."""

    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync_history(sifter: Any, group: Any = None, quantiles: int = 256) -> np.ndarray:
    """All-gather every rank's loss-window sketch and make the merged one this rank's reference.

    A collective: every rank of ``group`` must call it at the same point (``EqualSteps`` does).
    Each rank contributes ``quantiles`` evenly spaced quantiles of its window and the window's
    length; in the merged reference each quantile weighs ``length / quantiles``, so a rank with
    more history weighs more. ``RelativeProbabilistic`` then takes percentiles against the
    reference and ``PruneEasy`` compares losses to its mean, until the next sync. The reference is
    part of the policy's state, so a resumed run decides exactly as before.

    Returns:
        The merged reference's loss values, sorted.
    """

    policy = sifter.policy
    if not isinstance(policy, HistoryPolicy):
        raise ConfigError(
            "a global loss history needs a policy with a loss window (a HistoryPolicy such as "
            f"RelativeProbabilistic or PruneEasy), not {type(policy).__name__}"
        )
    history = policy.history
    sketch = np.full(quantiles + 1, np.nan)
    if len(history):
        sketch[:quantiles] = history.quantiles(np.linspace(0.0, 1.0, quantiles))
    sketch[quantiles] = len(history)
    device = _device_for(group)
    mine = torch.from_numpy(sketch).to(device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g.cpu().numpy() for g in gathered]
    values = np.concatenate([r[:quantiles] for r in rows])
    # each of a rank's quantiles stands for an equal share of that rank's window
    weights = np.concatenate([np.full(quantiles, r[quantiles] / quantiles) for r in rows])
    policy.set_reference(values, weights)
    return np.sort(values[np.isfinite(values)])


def sync_memory(sifter: Any, group: Any = None) -> int:
    """Send the losses this rank's score memory stored since the last sync to every rank of
    ``group``, and merge theirs into it.

    A collective: every rank of ``group`` must call it at the same point (``EqualSteps`` does, at
    the end of each epoch). Under ``DistributedSampler(shuffle=True)`` (or shards dealt to ranks
    anew each epoch) a sample is trained on one rank and met on another the epoch after; without
    this, that rank knows nothing of it and keeps it unknown, unsifted: about ``(world - 1) /
    world`` of the samples. Called at the same point of the same epoch on every rank
    (``EqualSteps``, the Lightning callback), it leaves every rank holding the same entries (a
    key trained on two ranks since the last sync, as ``DistributedSampler``'s padding does, keeps
    the larger loss on all; one trained again after an earlier sync of the same epoch, every so
    many steps, keeps its latest loss on all: before, the other ranks kept the stale one). An
    entry from a rank already in a later epoch (the Hugging Face Trainer's passes do not end
    together) is stored as of the epoch before this rank's, usable in its current pass; there,
    ranks' tables may differ for keys two ranks trained.
    Each rank's memory then holds the whole dataset's losses: size ``capacity`` for every rank's
    samples, not this rank's share (keys beyond it are refused, counted in ``memory.refused``,
    with a ``ScoreMemoryWarning``). Only entries stored since the last sync travel (16 bytes
    each), and which ones have is part of the memory's state, so a run resumed mid-epoch sends
    what the uninterrupted one would. Outside a process group it does nothing.

    Args:
        sifter: The stage whose ``memory`` to share (or the ``ScoreMemory`` itself).
        group: The process group (default: the world).

    Returns:
        Entries received from the other ranks.
    """

    memory = sifter if isinstance(sifter, ScoreMemory) else getattr(sifter, "memory", None)
    if not isinstance(memory, ScoreMemory):
        raise ConfigError(
            "sync_memory shares a score memory: pass a Sifter built with memory= (sp.recipe's "
            f"has one) or the ScoreMemory itself, not {type(sifter).__name__} without one"
        )
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    hashes, losses, epochs, sources = memory.changes()
    mine = np.empty((hashes.size, 2), dtype=np.int64)
    mine[:, 0] = hashes.view(np.int64)
    # loss bits, epoch and source in one int64: 32 + 16 + 8 bits
    mine[:, 1] = (
        (losses.view(np.uint32).astype(np.int64) << 24)
        | (epochs.view(np.uint16).astype(np.int64) << 8)
        | sources.view(np.uint8).astype(np.int64)
    )
    device = _device_for(group)
    world = dist.get_world_size(group)
    count = torch.tensor([hashes.size], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    if not longest:
        return 0
    padded = torch.zeros((longest, 2), dtype=torch.int64, device=device)
    padded[: hashes.size] = torch.from_numpy(mine).to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    memory.mark_synced()  # (sent: the merge below marks nothing of its own)
    me = dist.get_rank(group)
    theirs = np.concatenate(
        [g.cpu().numpy()[:n] for r, (g, n) in enumerate(zip(gathered, sizes)) if r != me and n]
        or [np.empty((0, 2), dtype=np.int64)]
    )
    packed = theirs[:, 1]
    refused = memory.refused
    memory.merge(
        theirs[:, 0].view(np.uint64),
        ((packed >> 24) & 0xFFFFFFFF).astype(np.uint32).view(np.float32),
        ((packed >> 8) & 0xFFFF).astype(np.uint16).view(np.int16),
        (packed & 0xFF).astype(np.uint8).view(np.int8),
        # another rank's later pass is as recent as this rank's (HF's passes do not end together)
        now=None if sifter is memory else getattr(sifter, "epoch", None),
        sent=hashes,  # a held entry not among them predates the last sync: what came is newer
    )
    if memory.refused > refused and not memory.warned_full_sync:
        memory.warned_full_sync = True  # once per memory, not at each epoch's sync
        warnings.warn(
            f"siftpipe: the score memory is full ({memory.capacity:,} samples) and refused "
            f"{memory.refused - refused:,} losses other ranks sent; those samples will be kept "
            "unknown here when they come to this rank. Shared across ranks, the memory holds "
            "every rank's samples: construct it with capacity = the whole dataset's size "
            "(sp.recipe(..., capacity=...)), or pass EqualSteps(..., sync_memory=False) when "
            "each rank always reads the same samples (its own shards)",
            ScoreMemoryWarning,
            stacklevel=2,
        )
    return int(theirs.shape[0])


class EqualSteps(Iterable[T]):
    """Iterate ``source`` so that every rank of ``group`` takes the same number of steps.

    Before each item it hands out, all ranks agree (one all-reduce of one integer, MIN) whether
    every rank has an item; the first step where some rank has none ends the epoch on all ranks.
    Items that other ranks had fetched for that last step are not trained on: ``discarded``
    counts them (at most one item per rank per epoch). Given the ``sifter`` whose batches
    ``source`` yields (``output_batch``, or batched mode), the discarded batch's rows are noted as
    never handed on (``Sifter.discard_last``: ``stats.unhanded``, and the audit log reads them as
    not kept), with those of the batches a prefetcher between them had read after it; each item
    of ``source`` must then be one batch of the stage's (a ``SiftError`` at the epoch's end says
    otherwise), and a prefetching *thread* between them must not be reading the stage when the
    epoch ends (``PassClosedError`` then: stop it first, or pass no ``sifter``). Without it, or
    for a stage that hands on single samples that something else batches, the audit log reads
    them as kept.

    Args:
        source: What each rank iterates (a sifted loader, typically yielding batches).
        group: The process group (default: the world).
        sifter: The stage this iterates (through ``source``): with ``sync_every``, the one whose
            history is synchronised. Given, the steps taken in its pass are kept in its state
            (``Sifter.pass_steps``), so after a mid-pass resume ``steps`` and the syncs go on
            from the checkpoint's step, as in the uninterrupted run; and a discarded batch is
            noted in its stats and audit log as never trained.
        sync_every: Every this many steps of an epoch, synchronise loss histories across ranks
            (``sync_history``); each epoch decides by each rank's own window until its first
            sync (before 2026-12-05 by the last epoch's merged one: an epoch of fewer steps never
            synced, and an early epoch's merged history decided every later one). ``None``
            keeps each rank's history local.
        quantiles: Sketch size for ``sync_history``.
        sync_memory: At the end of each epoch, share the losses each rank's score memory stored
            with every other rank (``sync_memory``), so that a sample dealt to another rank next
            epoch is decided by what it showed here. ``None`` (default): when ``sifter`` has a
            memory. ``False`` where each rank always reads the same samples (its own shards,
            Lightning's ``RankShareSampler``): sharing then costs memory and traffic for nothing.
        replayed: How many of ``source``'s first items are not the stage's batches of its pass
            (a trainer integration's stream replays the batches a checkpoint's trainer had not
            yet trained before it reads the stage): ``sifter``'s batches are counted after them.
        on_leave: A loop that leaves an epoch before its end (``break`` at a step limit) ends it
            without the memory sync; ``"warn"`` (default): say so when this rank's memory holds
            losses the others never received (``sp.sync_memory(sifter)`` on every rank after the
            loop shares them); ``"ignore"``: a trainer whose fit ends inside an epoch.
    """

    def __init__(
        self,
        source: Iterable[T],
        group: Any = None,
        *,
        sifter: Any = None,
        sync_every: int | None = None,
        quantiles: int = 256,
        sync_memory: bool | None = None,
        replayed: int = 0,
        on_leave: str = "warn",
    ) -> None:
        if on_leave not in ("warn", "ignore"):
            raise ConfigError(f"on_leave must be 'warn' or 'ignore', got {on_leave!r}")
        if sync_every is not None and (sifter is None or sync_every < 1):
            raise ConfigError("sync_every needs the sifter whose history to share, and a step count >= 1")
        if sync_memory and getattr(sifter, "memory", None) is None:
            raise ConfigError("sync_memory needs the sifter whose score memory to share (built with memory=)")
        self.source = source
        self.group = group
        self.sifter = sifter
        self.sync_every = sync_every
        self.quantiles = quantiles
        self.sync_memory = sync_memory
        self.replayed = replayed
        self.on_leave = on_leave
        #: Entries the last end-of-epoch memory sync received from other ranks.
        self.merged = 0
        #: Steps taken in the last epoch, the same on every rank (with ``sifter``, counted from the
        #: start of its pass also when it was resumed mid-way).
        self.steps = 0
        #: Items fetched for the final, untaken step of an epoch (this rank, all epochs).
        self.discarded = 0

    def _left_early(self, share_memory: bool | None) -> None:
        """The loop left an epoch before its agreed end (a ``break``): no rank shared its score
        memory, and this one says so when it holds losses the others never received (found by
        review, 2026-12-05: a loop breaking at a step limit shared none in any epoch, silently)."""
        alone = dist.get_world_size(self.group) < 2
        unshared = 0 if self.on_leave == "ignore" or alone else _unshared(self.sifter, share_memory)
        if unshared:
            warnings.warn(
                f"siftpipe: the loop left an EqualSteps epoch before its end (at step {self.steps}: "
                f"a break, or an error in the loop, which comes first), so this rank's score memory "
                f"did not share the {unshared} losses it stored since its last sync with the other "
                "ranks, whose samples it meets unknown next epoch: after a break, call "
                "sp.sync_memory(sifter) on every rank after leaving the loop, or end the epoch by "
                "the data (a sampler or stream of the steps wanted)",
                UserWarning,
                stacklevel=3,
            )

    def __iter__(self) -> Iterator[T]:

        if not (dist.is_available() and dist.is_initialized()):
            # one process: every step is taken; counted as with a group (steps, pass_steps)
            sifter = self.sifter
            self.steps = 0
            first = True
            for item in self.source:
                if first and sifter is not None:
                    self.steps = sifter.pass_steps
                first = False
                self.steps += 1
                if sifter is not None:
                    sifter.pass_steps = self.steps
                yield item
            return
        device = _device_for(self.group)
        flag = torch.zeros(1, dtype=torch.int64, device=device)
        failure: Exception | None = None
        it: Iterator[T] | None = None
        try:
            it = iter(self.source)
        except Exception as exc:
            # a loader's iter() resumes it (a torchdata Loader's reset) or starts its workers: a
            # failure there is told the others in the first step's agreement too (found by
            # review, 2026-12-05: they waited for the process group's timeout, the cause unsaid)
            failure = exc
        sifter = self.sifter
        # (the sifter's new pass decides by each rank's own window until its first sync: the
        # stage clears a merged reference as a pass opens. A sync at each pass's first step
        # instead froze the first pass's reference of a few warm-up losses, and the example kept
        # a quarter fewer samples; found 2026-12-05)
        self.steps = 0
        first = True
        fetched = 0  # items read from source this epoch: the stage's batches, one for one
        while True:
            try:
                if it is None:
                    raise failure  # type: ignore[misc]  # iter() failed: this rank has no step
                item = next(it)
                have = 1
                fetched += 1
            except StopIteration:
                have = 0
            except Exception as exc:
                # this rank's source or stage failed: the others are told in the step's agreement
                # (-1), so that every rank ends the epoch at this step and the collectives that
                # follow (the memory sync here, the job's own) meet in the same order
                failure, have = exc, -1
            if first and sifter is not None:
                # the sifter's pass has opened by now: resumed mid-way, it says how many steps
                # the checkpoint's run had taken in it, and the syncs fall where they fell there
                self.steps = sifter.pass_steps
            first = False
            flag.fill_(have)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            agreed = int(flag.item())
            if agreed <= 0:
                self.discarded += have == 1
                # a replayed item (not the stage's) is not the stage's to take back
                mine = fetched - self.replayed
                discard = getattr(sifter, "discard_last", None) if have == 1 and mine > 0 else None
                share = self.sync_memory
                if share is None:
                    share = sifter is not None and getattr(sifter, "memory", None) is not None
                try:
                    try:
                        if discard is not None:
                            # fetched, and now never trained: the stage notes its rows (and those
                            # of any batch a prefetcher between them read after it) as not handed
                            # on, and ends the pass
                            discard(fetched=mine)
                    finally:
                        if share:
                            # after the last step's observe(): the epoch's training losses are
                            # all in. Also when the discard failed (its error follows): the other
                            # ranks wait in this collective, until the process group's timeout
                            self.merged = sync_memory(sifter, self.group)
                except Exception as later:
                    if failure is None:
                        raise
                    # this rank's own first error is the one to see (it names the sample and
                    # the fix); what failed while ending the epoch after it rides along
                    failure.add_note(f"siftpipe: ending the epoch after it failed too: {later!r}")
                if failure is not None:
                    raise failure
                if agreed < 0:
                    held = "with a batch fetched and not trained (noted unhanded)" if have == 1 else "too"
                    raise SiftError(
                        f"another rank's data or stage failed at step {self.steps + 1} of this epoch "
                        f"(its own error says how): every rank ended the epoch there, this one {held}; "
                        "catch SiftError on every rank to go on, as the failing rank must"
                    )
                return
            self.steps += 1
            if sifter is not None:
                sifter.pass_steps = self.steps  # in the sifter's state from now on
            if self.sync_every and self.steps % self.sync_every == 0:
                sync_history(sifter, self.group, self.quantiles)
            try:
                yield item
            except GeneratorExit:
                self._left_early(share_memory=self.sync_memory)
                raise


def _unshared(sifter: Any, share_memory: bool | None) -> int:
    """Entries this rank's score memory stored since its last sync, where ``EqualSteps`` shares it."""
    memory = getattr(sifter, "memory", None)
    if memory is None or share_memory is False:
        return 0
    return memory.unsynced()


def fixed_steps(source: Iterable[T], steps: int) -> Iterator[T]:
    """Exactly ``steps`` items of ``source`` (an endless, resampled stream): equal on every rank.

    Raises ``SiftError`` if the stream ends first, instead of letting ranks fall out of step.
    """
    it = iter(source)
    for taken in range(steps):
        try:
            yield next(it)
        except StopIteration:
            raise SiftError(
                f"the stream ended after {taken} of {steps} steps; fixed_steps needs an endless stream "
                "(resampled=True shards) or a step count it can always reach"
            ) from None


class _Exit:
    """Where ``exit_process`` stands in this process."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.first: threading.Thread | None = None  # the thread whose call ends the process
        self.interrupted = threading.Event()  # set: a second caller parked in the main thread was hit


_exit = _Exit()
_forked = threading.Event()  # this process is a fork of the one that imported siftpipe


def _after_fork() -> None:
    _forked.set()
    _exit.reset()  # (a fork made while the parent exits, or holds the lock: the child's own)


os.register_at_fork(after_in_child=_after_fork)


def exit_process(code: int | None = 0) -> NoReturn:
    """End this process with exit status ``code`` as the end of a script would, without the
    interpreter's teardown: wait for the threads that are not daemons as the interpreter does (a
    checkpoint upload of yours; an executor not shut down is shut down), run the ``atexit``
    handlers (siftpipe's, which close audit logs still open; multiprocessing's, which end
    DataLoader workers; logging's), flush every file object of Python's own still open for
    writing (``sys.__stdout__``, a file ``open()``-ed and never closed), then ``os._exit``.
    Writers that finish their file when closed (``gzip.open``, ``zipfile.ZipFile``, tarfile,
    webdataset's ``TarWriter``/``ShardWriter``, ``fsspec.open(..., "wb")``) are not closed here,
    where a plain exit closes those a module still holds: close them before the call. Output C
    code buffered (an extension's ``printf``) is flushed. A
    standard output that cannot be written (a full disk, a pipe whose reader is gone) is said on
    stderr and makes a success exit 120, as Python's exit does. In a forked child (a rank started
    by multiprocessing with ``fork`` or ``forkserver``) the exit handlers and open files are its
    parent's: it ends as multiprocessing ends such a child, with multiprocessing's finalizers
    (siftpipe's logs are closed there) and the standard streams flushed; close the files it
    opened first. A Ctrl-C or a signal handler's exit while it waits for threads is printed,
    and the exit handlers still run.

    Call it last in a script that trains with ``DistributedDataParallel`` on the gloo backend
    (``examples/ddp_sift.py`` and ``examples/hf_lm.py`` do), after any ``destroy_process_group``. DDP
    keeps its process group alive past ``destroy_process_group`` (its reducer holds it), so gloo's
    worker threads outlive the script; one that lets go of the last collective's tensors after the
    interpreter began its teardown (a loaded machine delays it) needs the GIL there and aborts the
    process: ``terminate called without an active exception``, SIGABRT, and torchrun reports the
    job failed after all its work was done. Measured with ``python tools/stress_ddp_exit.py``: 5
    and 6 of 16 two-rank runs ending with an ``all_gather_object`` aborted on a loaded 2-core
    machine (two runs), 0 of 16 each time ending with this.

    ``code``: the exit status as ``sys.exit`` reads it: an int (0: success), ``None`` (0), or
    anything else, printed to stderr, then status 1. The first call ends the process, with its
    status: called again meanwhile from an exit handler it runs (an ``atexit`` handler of yours
    that calls it) or from a thread that is not a daemon (which the first call waits for), it
    raises ``SystemExit`` there; from another thread, it waits for the end (a Ctrl-C or a signal
    handler's exit in that wait stops the first call's wait for threads; a second ends the
    process at once, status 130).
    """
    if isinstance(code, int):
        status = code & 0xFF if code >= 0 else code % 256
    elif code is None:
        status = 0
    else:
        print(code, file=sys.stderr)
        status = 1
    here = threading.current_thread()
    with _exit.lock:
        first = _exit.first is None
        if first:
            _exit.first = here
    if not first:
        if _exit.first is here or not (here.daemon or here is threading.main_thread()):
            # an exit handler it runs called it (the loop reports SystemExit and goes on), or a
            # thread its first call waits for: that thread ends
            raise SystemExit(code)
        while True:  # the first call ends the process, with its status
            try:
                threading.Event().wait()
            except BaseException:  # (left, a Ctrl-C here would start a teardown beside it)
                _print_exception()
                if _exit.interrupted.is_set():
                    os._exit(130)  # interrupted twice: now
                _exit.interrupted.set()  # the first call stops waiting for threads
    try:
        status = _end(status)
    except BaseException:
        _print_exception()
    finally:
        os._exit(status)


def _end(status: int) -> int:
    """What ending the process runs before ``os._exit``: the status to exit with."""
    import multiprocessing
    import multiprocessing.util

    # a child multiprocessing started by fork or forkserver ends with os._exit after its
    # finalizers, never running exit handlers (those it has are its parent's: a
    # TemporaryDirectory's removal) nor closing files (its parent's buffered lines); a spawned
    # child, a script and a child of a bare os.fork end through the exit handlers
    pool_child = multiprocessing.parent_process() is not None and (
        _forked.is_set() or multiprocessing.get_start_method(allow_none=True) in ("fork", "forkserver")
    )
    try:
        if threading.current_thread() is threading.main_thread():
            threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
        else:
            for hook in reversed(list(getattr(threading, "_threading_atexits", ()))):
                with contextlib.suppress(Exception):
                    hook()  # (concurrent.futures' executors: their threads end)
            here = threading.current_thread()
            for thread in threading.enumerate():
                if thread is not here and thread is not threading.main_thread() and not thread.daemon:
                    while thread.is_alive() and not _exit.interrupted.is_set():
                        thread.join(0.1)  # (a Ctrl-C reaches a main thread parked in a second call)
    except BaseException:  # Ctrl-C, a signal handler's exit, while it waited: the rest still runs
        _print_exception()
    files: list[Any] = []
    try:
        if pool_child:
            multiprocessing.util._exit_function()  # type: ignore[attr-defined]
        else:
            atexit._run_exitfuncs()  # while the interpreter is whole (each handler's error is printed)
            files = _python_files()
    except BaseException:  # (as multiprocessing's child says an error in its finalizers)
        _print_exception()
        status = status or 1
    return _flush_streams(status, files)


def _print_exception() -> None:
    with contextlib.suppress(BaseException):
        traceback.print_exc()


def _python_files() -> list[Any]:
    """Every file object of ``io``'s own still open for writing, text layers first: what the
    teardown's closing them would have written."""
    import gc
    import io

    texts: list[Any] = []
    buffers: list[Any] = []
    own = (io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if type(obj) is io.TextIOWrapper and type(getattr(obj, "buffer", None)) in own:
            texts.append(obj)
        elif type(obj) in own:
            buffers.append(obj)
    return texts + buffers


def _flush_streams(status: int, files: list[Any]) -> int:
    """Flush stdout and stderr (those set now and the process's own), then ``files``; the status
    120 for a success whose standard output could not be written (as Python's exit says it)."""
    streams: list[Any] = []
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None and all(stream is not seen for seen in streams):
            streams.append(stream)
    for stream in streams:
        try:
            if not getattr(stream, "closed", False):
                stream.flush()
        except OSError as e:  # a full disk, a pipe whose reader is gone
            with contextlib.suppress(Exception):
                print(f"siftpipe: exit_process could not flush {stream!r}: {e!r}", file=sys.__stderr__)
            status = status or 120
        except Exception:  # (a stand-in for stdout that is no file: as Python's exit, nothing said)
            pass
    for file in files:
        with contextlib.suppress(Exception):
            if not file.closed:
                file.flush()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C's stdio: an extension's printf to a pipe or a file
    return status
