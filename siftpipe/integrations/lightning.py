"""Sifting in PyTorch Lightning: ``SiftCallback``.

    import siftpipe as sp
    from siftpipe.integrations.lightning import SiftCallback

    sift = SiftCallback(scorer=sp.CrossEntropy("image", "label"), memory=sp.ScoreMemory())
    trainer = L.Trainer(callbacks=[sift], ...)
    # in the LightningModule or DataModule:
    def train_dataloader(self):
        return sift.loader(DataLoader(train, batch_size=64, shuffle=True, num_workers=4))
    def training_step(self, batch, batch_idx):
        per_sample = F.cross_entropy(self(batch["image"]), batch["label"], reduction="none")
        return sift.loss(per_sample, batch)          # weights applied, losses fed back

One epoch is one pass over the data (shorter: dropped samples are not trained); under DDP every
rank ends its pass at the same step (``EqualSteps``). The stage's state (per rank), the batch
Lightning fetched ahead and the random states go into Lightning's checkpoints through the
callback's ``state_dict``, so ``trainer.fit(..., ckpt_path=...)`` continues exactly. Details:
docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)

import siftpipe as sp

from . import MissingExtraError
from ._common import (
    EPOCH_FIELD,
    MetaCollate,
    SiftedStream,
    as_list,
    capture_rng,
    check_feedback_key,
    decode_rng,
    encode_rng,
    key_fields,
    restore_rng,
    warn_stale_epochs,
    with_index_keys,
)

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:
    raise MissingExtraError.of("siftpipe.integrations.lightning", "lightning", "lightning", exc) from None

__all__ = ["SiftCallback", "SiftedLoader"]


class RankShareSampler(DistributedSampler):  # type: ignore[type-arg]
    """A ``DistributedSampler`` whose ranks keep their share of the dataset from epoch to epoch
    (fixed by ``seed``), each shuffled within per epoch (``seed`` + epoch): a rank's score memory
    knows the samples it is asked about. A ``DistributedSampler`` permutes the whole dataset per
    epoch before it deals it out, so a rank read about ``1 / world_size`` of the samples it had
    read before, and a per-rank memory knew few of them (most kept as unknown, sifting off).
    Lengths, padding and ``drop_last`` are the ``DistributedSampler``'s."""

    def __iter__(self) -> Any:
        # the share: what the DistributedSampler deals for epoch 0 (its padding and drop_last)
        epoch, self.epoch = self.epoch, 0
        try:
            mine = list(super().__iter__())
        finally:
            self.epoch = epoch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            mine = [mine[i] for i in torch.randperm(len(mine), generator=g).tolist()]
        return iter(mine)


class _SkipBatches(Sampler[list[int]]):
    """A batch sampler without its first ``skip`` batches (their indices only: nothing is loaded)."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


class SiftedLoader:
    """The sifted training batches of a ``SiftCallback``: return it from ``train_dataloader()``.

    Iterating it is one pass over the wrapped DataLoader's data (one Lightning epoch). It has no
    length: Lightning learns the end of the epoch by fetching one batch ahead.
    """

    def __init__(self, callback: SiftCallback, dataloader: DataLoader) -> None:  # type: ignore[type-arg]
        self.callback = callback
        self.dataloader = dataloader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.callback._stream_for(self.dataloader))


class SiftCallback(Callback):
    """Sift a Lightning training run: the loader, the loss, the checkpoints and the metrics.

    Args:
        sifter: The stage (per-sample mode, the default), or a function that builds it. Give a
            function under DDP: it is called on each process once the process group exists, so
            each rank's generator is seeded with its rank. Left at their defaults, the stage's
            ``collate_fn`` becomes the wrapped DataLoader's and its ``output_batch`` the
            DataLoader's batch size (with ``drop_last=True`` there, the stage's ``drop_last`` too:
            each pass's short last batch of kept samples is not trained); constructed with
            ``model=None`` it scores with the LightningModule.
        scorer: Instead of ``sifter``: the stage is ``Sifter(None, scorer, policy, **sifter_args)``,
            built on each process when training starts (``"cross_entropy"`` scores ``(x, y)``
            batches; ``sp.CrossEntropy("image", "label")`` dict batches).
        policy: With ``scorer``: the stage's policy (default ``RelativeProbabilistic(1.0)``).
        sifter_args: With ``scorer``: more ``Sifter`` arguments (``memory=``, ``delay=``, ...).
        feedback: ``loss()`` hands the training step's per-sample losses to ``sifter.observe``.
            Default: when the sifter has a score memory.
        sync_every: Under DDP, share loss histories across ranks every this many steps.
        restore_rng: Save the training process's random states (torch, CUDA, numpy, Python) with the
            stage and put them back at the first training batch after a resume, so that dropout
            draws the same masks as in the uninterrupted run (Lightning itself does not).
        log: Log the stage's counters (``sift/...``) with ``pl_module.log`` every training step.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        sifter: sp.Sifter | Callable[[], sp.Sifter] | None = None,
        *,
        scorer: sp.Scorer | str | None = None,
        policy: sp.Policy | str | None = None,
        feedback: bool | None = None,
        sync_every: int | None = None,
        restore_rng: bool = True,
        log: bool = True,
        **sifter_args: Any,
    ) -> None:
        if (sifter is None) == (scorer is None):
            raise sp.ConfigError(
                "give SiftCallback either a sifter (a Sifter or a function building one) or a scorer, "
                "not both or neither"
            )
        if scorer is not None:
            if "model" in sifter_args:
                raise sp.ConfigError(
                    "with scorer=, the stage scores with the LightningModule: give no model="
                )
            sifter = functools.partial(sp.Sifter, None, scorer, policy, **sifter_args)
        elif policy is not None or sifter_args:
            raise sp.ConfigError(
                f"policy= and Sifter arguments ({', '.join(sifter_args) or 'policy'}) go with scorer=; "
                "a given sifter has its own"
            )
        if not (isinstance(sifter, sp.Sifter) or callable(sifter)):
            raise sp.ConfigError(
                f"sifter must be a siftpipe.Sifter or a function returning one, got {sifter!r}"
            )
        if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
            raise sp.ConfigError(f"sync_every must be a number of steps >= 1 or None, got {sync_every!r}")
        self._factory = None if isinstance(sifter, sp.Sifter) else sifter
        self._sifter = sifter if isinstance(sifter, sp.Sifter) else None
        self._feedback = feedback
        self.sync_every = sync_every
        self.restore_rng = restore_rng
        self.log_metrics = log
        self._stream: SiftedStream | None = None
        self._source: DataLoader | None = None  # type: ignore[type-arg]
        self._inner: DataLoader | None = None  # type: ignore[type-arg]
        self._rank_share = False  # the inner loader deals with a RankShareSampler
        self._in_batch = False
        self._rng_to_restore: dict[str, Any] | None = None
        # the random states as the last training batch ended, put back after a validation run
        # inside the fit (see on_validation_start)
        self._rng_after_batch: dict[str, Any] | None = None
        self._validated = False
        self._off_clock = contextlib.ExitStack()  # open while a validation inside the fit runs
        self._restored_at_epoch_end = False
        self._pending_state: dict[str, Any] | None = None
        self._attached = False  # setup() ran: the callback is in the Trainer's callbacks
        self._trainer: pl.Trainer | None = None  # the Trainer whose setup() ran last
        self._module: pl.LightningModule | None = None  # the module setup() made the stage score with
        self._new_module = False  # this fit trains another module than the last fit did
        self._loaded = False  # a checkpoint's state was loaded since the last fit began
        self._use_distributed_sampler = True  # the Trainer's use_distributed_sampler
        self._sampler_kwargs: dict[str, Any] | None = None  # the Trainer's distributed_sampler_kwargs
        self._loss_called = False
        self._warned_no_loss = False
        self._fits = 0  # fits begun (on_train_start)
        self._read_in: tuple[int, Any] | None = None  # (fit, epoch) the stream was last read in
        # (output_batch, drop_last) as taken from the DataLoader: a reloaded one's replace them
        self._batching: tuple[int, bool] | None = None
        if self._sifter is not None:
            self._check(self._sifter)

    # ------------------------------------------------------------------ the pieces

    @property
    def sifter(self) -> sp.Sifter:
        """The stage (built by the factory on first use)."""
        if self._sifter is None:
            assert self._factory is not None
            sifter = self._factory()
            if not isinstance(sifter, sp.Sifter):
                raise sp.ConfigError(
                    f"the sifter factory returned {type(sifter).__name__}, not a siftpipe.Sifter"
                )
            self._check(sifter)
            self._sifter = sifter
        return self._sifter

    @property
    def stream(self) -> SiftedStream:
        """The sifted stream the loader iterates (its state is the callback's)."""
        if self._stream is None:
            self._stream = SiftedStream(
                self.sifter,
                self._open_pass,
                endless=False,
                lockstep=True,
                sync_every=self.sync_every,
                # a RankShareSampler keeps each rank's samples its own: nothing to share then
                share_memory=self._share_memory,
                generators=self._generators,
            )
        return self._stream

    def _share_memory(self) -> bool:
        """Whether the ranks share their score memories as a pass begins: not when each reads
        its own share of the samples every epoch (a ``RankShareSampler``). The inner loader,
        which says so, is built first: a fit resumed from a checkpoint taken at an epoch's last
        step asked before it was, shared, and decided the next epoch from other ranks' losses
        (found by review, 2026-12-06: one sample otherwise on one of 2 ranks, and the runs
        diverged from there)."""
        if self._inner is None and self._source is not None:
            self._inner = self._build_inner()
        return not self._rank_share

    @property
    def feedback(self) -> bool:
        return self.sifter.memory is not None if self._feedback is None else self._feedback

    def _check(self, sifter: sp.Sifter) -> None:
        check_feedback_key(sifter, sifter.memory is not None if self._feedback is None else self._feedback)
        if sifter.batched:
            raise sp.ConfigError(
                "SiftCallback feeds the Sifter samples and lets it collate the kept ones with the "
                "DataLoader's collate function: construct it with batched=False (the default)"
            )

    def loader(self, dataloader: DataLoader) -> SiftedLoader:  # type: ignore[type-arg]
        """Wrap the training DataLoader: its dataset, sampler, workers and collate function are
        kept; the stage sits between the workers and the training step. Return the result from
        ``train_dataloader()`` (or pass it to ``trainer.fit``)."""
        if not isinstance(dataloader, DataLoader):
            raise sp.ConfigError(
                f"SiftCallback.loader wraps a torch DataLoader, got {type(dataloader).__name__}; for other "
                "iterables, iterate sifter(...) yourself"
            )
        return SiftedLoader(self, dataloader)

    def _stream_for(self, dataloader: DataLoader) -> SiftedStream:  # type: ignore[type-arg]
        if not self._attached:
            # without its hooks nothing acknowledges trained batches or saves the state
            raise sp.ConfigError(
                "the sifted loader is iterated by a Trainer without its SiftCallback: pass the same "
                "callback in L.Trainer(callbacks=[sift, ...])"
            )
        trainer = self._trainer
        if trainer is not None and not trainer.training:
            # validation, a sanity check, test or predict: sifting them would drop samples from the
            # metric, decide them from the training samples' losses (the same index keys), and
            # close the training pass the fit is in the middle of
            raise sp.ConfigError(
                "a DataLoader wrapped with SiftCallback.loader is iterated outside training (by "
                f"the Trainer's {getattr(trainer.state.stage, 'value', 'current')} loop): sift the training "
                "DataLoader only, and return plain DataLoaders from val_dataloader(), "
                "test_dataloader() and predict_dataloader()"
            )
        epoch = (self._fits, getattr(trainer, "current_epoch", None))
        if dataloader is not self._source and self._source is not None and epoch == self._read_in:
            # found 2026-12-05: two loaders of one callback (a CombinedLoader) share its one
            # stream, and opening the second closed the first's pass: it was never trained
            raise sp.ConfigError(
                "two DataLoaders wrapped by one SiftCallback are read in one epoch (a "
                "CombinedLoader?): the callback sifts one training stream, and the second would "
                "close the first's pass. Sift one of them (the others plain DataLoaders), or "
                "join their datasets into one DataLoader (torch.utils.data.ConcatDataset)"
            )
        if dataloader is self._source and epoch == self._read_in and self.stream.trained_since_iter:
            # found by review, 2026-12-05: Lightning's CombinedLoader (its default mode) begins
            # a loader that ends first again within the epoch; the stream took the batch fetched
            # ahead for one never trained, every later ack popped the wrong batch, the audit log
            # disagreed with training and checkpoints resumed elsewhere
            raise sp.ConfigError(
                "the sifted DataLoader was begun again within one epoch after training from it: "
                "a CombinedLoader in its default mode 'max_size_cycle' begins again a loader that "
                "ends first, and sifting makes the sifted one end first. Give "
                "CombinedLoader(loaders, mode='min_size') (the epoch ends with the sifted pass) or "
                "mode='max_size' (the sifted entry is None once its pass ended), or sift one "
                "DataLoader alone"
            )
        self._read_in = epoch
        if dataloader is not self._source:
            self._source = dataloader
            self._inner = None
            sifter = self.sifter
            collate = dataloader.collate_fn
            if _unbatched(dataloader):
                # its collate_fn converts one sample at a time (the inner loader applies it): the
                # kept samples are batched as a DataLoader with a batch_size would batch them
                collate = default_collate
            if isinstance(sifter.collate_fn, MetaCollate):  # a reloaded DataLoader: its collate now
                sifter.collate_fn.collate = collate
            else:
                inner = collate if sifter.collate_fn is default_collate else sifter.collate_fn
                sifter.collate_fn = MetaCollate(
                    inner, sifter.weight_field, self.stream.collate_rng, key_fields(sifter)
                )
            if sifter.output_batch is None or self._batching == (sifter.output_batch, sifter.drop_last):
                # unset, or set from the last DataLoader: a reloaded one's batch size and drop_last
                # now (found 2026-12-05: a batch-size schedule through reloads kept the first's)
                if dataloader.batch_size is None:
                    raise sp.ConfigError(
                        "the DataLoader has no batch_size (a batch_sampler, or batch_size=None): give "
                        "the Sifter output_batch= (kept samples per training batch)"
                    )
                sifter.output_batch = dataloader.batch_size
                # the user asked for full batches only: so are the kept samples batched
                sifter.drop_last = bool(dataloader.drop_last)
                self._batching = (sifter.output_batch, sifter.drop_last)
        if self._pending_state is not None:
            # restored only now: the stage's collate_fn and output_batch come from the DataLoader
            state, self._pending_state = self._pending_state, None
            self.stream.load_state_dict(state)
            if trainer is not None and _restored_at_epoch_end(trainer):
                # a checkpoint of an epoch's last step, where the epoch ended before the pass did
                # (limit_train_batches, on_train_batch_start returning -1): Lightning opens the
                # next epoch, and the uninterrupted run began the next pass then, noting the
                # batches fetched and not trained as never trained. So does the resumed one, before
                # Lightning reads a batch (found by review, 2026-12-05: it trained them and went on
                # in the old pass, one epoch behind, other samples and other weights)
                self.stream.give_up_loaded_pass()
        return self.stream

    def _build_inner(self) -> DataLoader:  # type: ignore[type-arg]
        source = self._source
        assert source is not None
        self._rank_share = False  # (set again by _shard)
        dataset = with_index_keys(source.dataset, self.sifter.key)
        kwargs: dict[str, Any] = {
            "num_workers": source.num_workers,
            "collate_fn": as_list,
            "pin_memory": source.pin_memory,
            "timeout": source.timeout,
            "worker_init_fn": source.worker_init_fn,
            "multiprocessing_context": source.multiprocessing_context,
            "generator": source.generator,
            "persistent_workers": source.persistent_workers,
        }
        if source.num_workers > 0:
            kwargs["prefetch_factor"] = source.prefetch_factor
        if _unbatched(source):
            # automatic batching off: each item is one sample, converted by the DataLoader's collate_fn
            kwargs["collate_fn"] = _OneSample(source.collate_fn)
            if isinstance(source.dataset, IterableDataset):
                return DataLoader(dataset, batch_size=None, **kwargs)
            return DataLoader(
                dataset, batch_size=None, sampler=self._shard(source.sampler, dataset, False), **kwargs
            )
        if isinstance(source.dataset, IterableDataset):
            return DataLoader(dataset, batch_size=source.batch_size, drop_last=source.drop_last, **kwargs)
        if source.batch_size is None:
            return DataLoader(
                dataset, batch_sampler=self._shard_batches(source.batch_sampler, dataset), **kwargs
            )
        return DataLoader(
            dataset,
            batch_size=source.batch_size,
            sampler=self._shard(source.sampler, dataset, source.drop_last),
            drop_last=source.drop_last,
            **kwargs,
        )

    def _sharding(self) -> dict[str, Any] | None:
        """``DistributedSampler`` arguments when each process is to read its own share of a
        map-style dataset (as Lightning does for a plain DataLoader), else ``None``."""
        kwargs = self._sampler_kwargs
        if not self._use_distributed_sampler or not kwargs or int(kwargs.get("num_replicas", 1)) <= 1:
            return None
        return kwargs

    def _shard(self, sampler: Any, dataset: Any, drop_last: bool) -> Any:
        """``sampler``, or the share of it this process reads: what Lightning puts in a plain
        DataLoader under DDP with ``use_distributed_sampler=True`` (a ``DistributedSampler`` for a
        random or sequential sampler, seeded with the stage's ``seed`` and shuffling when the
        DataLoader does; ``DistributedSamplerWrapper`` around any other, whose order it keeps)."""
        kwargs = self._sharding()
        if kwargs is None or isinstance(sampler, DistributedSampler):
            return sampler
        if isinstance(sampler, RandomSampler | SequentialSampler):
            # with a score memory, each rank must read the same samples every epoch (its memory
            # knows only what it read): a share fixed by the seed, shuffled within per epoch
            kind = RankShareSampler if self.sifter.memory is not None else DistributedSampler
            self._rank_share = kind is RankShareSampler
            return kind(
                dataset,
                shuffle=isinstance(sampler, RandomSampler),
                seed=self.sifter.seed,
                drop_last=drop_last,
                **kwargs,
            )
        return DistributedSamplerWrapper(sampler, shuffle=False, drop_last=drop_last, **kwargs)

    def _shard_batches(self, batch_sampler: Any, dataset: Any) -> Any:
        """A DataLoader's ``batch_sampler``, or one over this process's share of its sampler."""
        if self._sharding() is None or isinstance(
            getattr(batch_sampler, "sampler", None), DistributedSampler
        ):
            return batch_sampler
        if type(batch_sampler) is not BatchSampler:
            raise sp.ConfigError(
                f"under DDP each process must read its own share of the data, and the DataLoader's "
                f"batch_sampler ({type(batch_sampler).__name__}) is not a torch BatchSampler that "
                "siftpipe can rebuild over a DistributedSampler: put a DistributedSampler (or your "
                "own per-rank sharding) inside it and set L.Trainer(use_distributed_sampler=False), "
                "or give the DataLoader batch_size= and sampler= instead"
            )
        sampler = self._shard(batch_sampler.sampler, dataset, batch_sampler.drop_last)
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)

    def _generators(self) -> list[torch.Generator]:
        """Generators that shuffle the wrapped data: their states at a pass's start are saved."""
        source = self._source
        found: list[torch.Generator] = []
        # the sampler's, also one inside a batch_sampler= (found by review, 2026-12-05: not saved,
        # so a resumed pass was shuffled anew and refused)
        batch_sampler = getattr(source, "batch_sampler", None)
        owners = (source, getattr(source, "sampler", None), getattr(batch_sampler, "sampler", None))
        for owner in owners:
            gen = getattr(owner, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def _open_pass(self, epoch: int, skip: int) -> tuple[Any, int]:
        if self._inner is None:
            self._inner = self._build_inner()
        inner = self._inner
        owners: list[Any] = [
            inner.sampler,
            inner.batch_sampler,
            getattr(inner.batch_sampler, "sampler", None),
        ]
        for owner in owners:
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
        reused = getattr(inner, "_iterator", None) is not None
        if inner.persistent_workers and inner.num_workers > 0 and reused:
            # a persistent loader's next pass reuses its iterator and workers and draws no base
            # seed, where a fresh iterator (a resumed job's) draws one before the sampler draws
            # its own: drawn here too, so that both shuffle alike (the workers' own random
            # states still differ after a resume: docs/integrations.md)
            torch.empty((), dtype=torch.int64).random_(generator=inner.generator)
        dataset = inner.dataset
        warn_stale_epochs(inner, "DataLoader(persistent_workers=False)")
        if isinstance(dataset, IterableDataset):
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            return inner, 0
        if inner.batch_size is None or skip < inner.batch_size:
            return inner, 0
        # a map-style pass skips whole batches in the sampler, without loading them
        whole = skip // inner.batch_size
        skipped = DataLoader(
            dataset,
            batch_sampler=_SkipBatches(inner.batch_sampler, whole),
            num_workers=inner.num_workers,
            collate_fn=as_list,
            pin_memory=inner.pin_memory,
            timeout=inner.timeout,
            worker_init_fn=inner.worker_init_fn,
            multiprocessing_context=inner.multiprocessing_context,
            generator=inner.generator,
            prefetch_factor=inner.prefetch_factor if inner.num_workers > 0 else None,
        )
        return skipped, whole * inner.batch_size

    # ------------------------------------------------------------------ the training step

    def loss(self, per_sample: torch.Tensor, batch: Any) -> torch.Tensor:
        """The loss to optimise from the step's per-sample losses: their mean, each weighted by its
        sample's weight when the policy sets weights; hands the losses back to the score memory.

        Args:
            per_sample: One loss per sample of ``batch`` (``reduction="none"``), shape ``[n]``.
            batch: The batch ``training_step`` received.
        """
        if not isinstance(per_sample, torch.Tensor) or per_sample.ndim != 1:
            raise sp.ScorerOutputError(
                "SiftCallback.loss needs one loss per sample, a tensor of shape [n] "
                f"(reduction='none'), got {getattr(per_sample, 'shape', type(per_sample).__name__)}"
            )
        if not self._in_batch:
            return per_sample.mean()  # not a sifted training batch (validation, say)
        sifter = self.sifter
        n = per_sample.shape[0]
        keys, weights = _meta(batch, sifter)
        for name, values in (("keys", keys), ("weights", weights)):
            if values is not None and len(values) != n:
                raise sp.ScorerOutputError(
                    f"SiftCallback.loss got {n} losses for a batch with {len(values)} {name}: pass one "
                    "loss per sample of the batch the training step received"
                )
        self._loss_called = True
        if self.feedback and keys is not None:
            # the epoch of the pass that handed the batch on (Lightning fetches one batch ahead)
            epoch = batch.get(EPOCH_FIELD) if isinstance(batch, Mapping) else None
            sifter.observe(keys, per_sample.detach(), epoch=epoch)
        if weights is None:
            return per_sample.mean()
        return (per_sample * torch.as_tensor(weights).to(per_sample)).mean()

    # ------------------------------------------------------------------ Lightning's hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._attached = True
        self._trainer = trainer
        # read here, used when the loader is built: shard a map-style dataset as Lightning would
        connector = getattr(trainer, "_accelerator_connector", None)
        self._use_distributed_sampler = bool(getattr(connector, "use_distributed_sampler", True))
        self._sampler_kwargs = trainer.distributed_sampler_kwargs
        sifter = self.sifter
        if sifter.model is None or (self._module is not None and sifter.model is self._module):
            # the module being trained, this fit's (a callback reused for another module's fit
            # follows it: scoring with the last fit's module would decide on stale weights)
            sifter.model = pl_module  # unwrapped: a DDP forward would be a collective
            if self._module is not None and pl_module is not self._module:
                self._new_module = True  # (on_train_start asks for a checkpoint's state)
            self._module = pl_module
        rank, world = sp.dist_info()
        if world > 1 and sifter.rng_seed != [sifter.seed, rank]:
            warnings.warn(
                f"the Sifter on rank {rank} was built before the process group existed, so every rank "
                "seeds its generator alike (decisions correlate across ranks): pass SiftCallback a "
                "function that builds it, lambda: sp.Sifter(...)",
                stacklevel=2,
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng_to_restore is not None:
            restore_rng(self._rng_to_restore)
            self._rng_to_restore = None
        elif self._validated and self._rng_after_batch is not None:
            restore_rng(self._rng_after_batch)
        self._validated = False
        if self._restored_at_epoch_end:
            self._restored_at_epoch_end = False
            _restart_epoch_progress(trainer)
        self._in_batch = True
        self._loss_called = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = False
        if not self._loss_called and not self._warned_no_loss:
            self._warned_no_loss = True
            warnings.warn(
                "training_step did not call SiftCallback.loss(per_sample, batch): the policy's weights "
                "are not applied to the loss and the score memory gets no losses from training",
                stacklevel=2,
            )
        stream = self.stream
        stream.ack()
        self.sifter.model_version = trainer.global_step
        # a checkpoint of this step holds these states: kept when validation runs next (see
        # on_validation_start), which costs a copy of every generator's state (~0.1 ms) then only
        self._rng_after_batch = (
            capture_rng(cuda=True) if self.restore_rng and _validation_next(trainer) else None
        )
        if self.log_metrics:
            metrics = stream.metrics(window=False)
            pl_module.log_dict(
                {f"sift/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False, batch_size=1
            )

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # validation inside the fit draws from the process's random states (its DataLoader's
        # iterator seeds its workers); a checkpoint of the step before it holds the states from
        # before, and the job resumed from it does not validate again. So the next training batch
        # starts from the states the last one ended with, resumed or not (restore_rng)
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validated = True  # (Lightning runs the sanity check on states of its own)
            # validation between training steps is not step time: off the stage's clock
            # (Sifter.off_clock: stats.step_seconds, saved_seconds and the cost guard)
            self._off_clock.close()
            self._off_clock.enter_context(self.sifter.off_clock())
        self._in_batch = False  # (a step that returned -1 from on_train_batch_start never ended)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._off_clock.close()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_batch = False  # as above: an epoch ended early by on_train_batch_start's -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a fit starts from the states it is given (seed_everything), not the last fit's end
        self._rng_after_batch, self._validated = None, False
        self._fits += 1
        if self._new_module and not self._loaded:
            # (the flag stays: a fit of this module tried again without a checkpoint is refused too)
            raise sp.ConfigError(
                "this SiftCallback sifted the fit of another LightningModule: its stage holds that "
                "run's state (score memory, counters, position in the data), and this fit would be "
                "decided from the other model's losses. Give each model's fit its own SiftCallback "
                "and Sifter, or continue a run with trainer.fit(model, ckpt_path=...), which loads "
                "the stage's state from the checkpoint"
            )
        self._new_module = self._loaded = False
        # a checkpoint taken at an epoch's last batch: Lightning resets the epoch's batch count for
        # a loader with a length only, so with none (a sifted loader) the next epoch would count on
        # from the last one and step a partial accumulation early
        self._restored_at_epoch_end = _restored_at_epoch_end(trainer)
        partial, accumulate = _restored_inside_accumulation(trainer)
        if partial:
            # Lightning saves no gradients: the batches of the accumulation step the checkpoint
            # cut were handed on and trained forward and backward, and their gradients are lost
            # (found by review, 2026-12-06: it resumed silently off the uninterrupted run)
            warnings.warn(
                f"siftpipe: the checkpoint {trainer.ckpt_path} was written after {partial} of the "
                f"{accumulate} batches of an accumulation step "
                "(accumulate_grad_batches): Lightning does not save accumulated gradients, so "
                "the resumed run's next optimizer step goes without those batches' gradients, "
                "and the audit log reads their samples as trained. It does not continue the "
                "uninterrupted run exactly. Checkpoint on step boundaries: every_n_train_steps, "
                "or a val_check_interval that is a multiple of accumulate_grad_batches",
                stacklevel=2,
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stream is not None:
            # a fit ended inside a pass (max_steps, should_stop) with the batch Lightning fetched
            # ahead handed on and never trained: noted so (stats.unhanded, the audit log), not
            # counted as trained, and not replayed by a state taken after the fit
            try:
                self._stream.discard_unacked()
            except sp.SiftError as exc:
                # the fit itself is done: the note is bookkeeping, and without it the log reads
                # the fetched rows as kept, as before 2026-12-05
                warnings.warn(
                    f"siftpipe: the batch fetched ahead of the fit's end could not be noted as never "
                    f"trained (the audit log and stats count it as kept): {exc}",
                    stacklevel=2,
                )
        self._finish()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._finish()
        except Exception as exc:  # the training error is the one to report
            warnings.warn(f"siftpipe: could not flush the audit log after {exception!r}: {exc}", stacklevel=2)

    def _finish(self) -> None:
        if self._stream is not None:
            self._stream.close()
        flush = getattr(self._sifter.audit, "flush", None) if self._sifter is not None else None
        if flush is not None:  # (a sink of one's own may have none)
            flush()

    def state_dict(self) -> dict[str, Any]:
        """Every rank's stage state, gathered into the checkpoint (Lightning writes rank 0's dict).

        A collective under DDP: every rank saves the checkpoint (as ``ModelCheckpoint`` does)."""
        stream_state = self._pending_state if self._pending_state is not None else self.stream.state_dict()
        # a checkpoint written after validation (ModelCheckpoint's default, at an epoch's or a
        # validation's end) holds the states the next training batch starts from: those the last
        # batch ended with (on_train_batch_start restores them), not validation's draws since
        after_batch = self._rng_after_batch if self._validated else None
        rng = after_batch if after_batch is not None else capture_rng(cuda=True)
        local = {"stream": stream_state, "rng": encode_rng(rng)}
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        ranks: list[Any] = [local]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, local)
        return {"version": self.STATE_VERSION, "world_size": world, "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != self.STATE_VERSION:
            raise sp.ResumeError(
                f"the checkpoint's SiftCallback state has version {state_dict.get('version')!r}; this "
                f"siftpipe reads version {self.STATE_VERSION}"
            )
        rank, world = sp.dist_info()
        saved = int(state_dict["world_size"])
        if saved != world:
            raise sp.ResumeError(
                f"the checkpoint was saved by {saved} process(es) and this run has {world}: each rank "
                f"resumes its own stage, so resume with {saved}"
            )
        mine = state_dict["ranks"][rank]
        self._pending_state = mine["stream"]
        self._loaded = True
        if self.restore_rng:
            self._rng_to_restore = decode_rng(mine["rng"])


def _validation_next(trainer: pl.Trainer) -> bool:
    """Whether the fit validates after the training batch that is ending (Lightning's own test,
    a private method: True where it cannot be asked, so that the states are kept every step)."""
    try:
        fit_loop = trainer.fit_loop
        fetcher = fit_loop._data_fetcher
        return fetcher is None or bool(fit_loop.epoch_loop._should_check_val_fx(fetcher))
    except Exception:
        return True


def _restored_at_epoch_end(trainer: pl.Trainer) -> bool:
    """The fit was restored from a checkpoint taken at an epoch's last batch (its loop's progress
    as the checkpoint left it: asked before the next epoch begins)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(trainer.ckpt_path is not None and progress.is_last_batch and progress.current.ready > 0)


def _restored_inside_accumulation(trainer: pl.Trainer) -> tuple[int, int]:
    """How many batches of an unfinished accumulation step the checkpoint the fit restored was
    taken after (0: on a step boundary, at an epoch's last batch, which steps, or not restored),
    and the batches a step accumulates."""
    if trainer.ckpt_path is None:
        return 0, 1
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        # accumulation a GradientAccumulationScheduler sets: only when the epoch starts, after
        # this (the review of the check, 2026-12-06: no warning under one)
        schedule = getattr(callback, "get_accumulate_grad_batches", None)
        if isinstance(callback, pl.callbacks.GradientAccumulationScheduler) and callable(schedule):
            accumulate = int(schedule(trainer.current_epoch))
    if accumulate <= 1:
        return 0, accumulate
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.is_last_batch:
        return 0, accumulate
    # batches trained: "processed" (a checkpoint written at a batch's end, every_n_train_steps,
    # holds it before Lightning counts the batch completed; the review of the check, 2026-12-06,
    # which read "1 of 2" at every step boundary there)
    return int(getattr(progress.current, "processed", progress.current.completed)) % accumulate, accumulate


def _restart_epoch_progress(trainer: pl.Trainer) -> None:
    """At the first batch of an epoch opened after restoring a checkpoint taken at the previous
    epoch's last batch: count this epoch's batches from this one, as Lightning does for a loader
    with a length (``accumulate_grad_batches`` counts them)."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress
    last = progress.is_last_batch
    progress.reset_on_run()
    progress.is_last_batch = last
    progress.increment_ready()  # this batch
    loop.scheduler_progress.reset_on_run()
    loop.automatic_optimization.optim_progress.reset_on_run()


def _unbatched(dataloader: DataLoader) -> bool:  # type: ignore[type-arg]
    """The DataLoader does not batch (``batch_size=None`` and no ``batch_sampler``): each item it
    reads is one sample, and its ``collate_fn`` converts one sample (``default_convert``)."""
    return dataloader.batch_size is None and dataloader.batch_sampler is None


class _OneSample:
    """The inner loader's collate function for a DataLoader that does not batch: the sample,
    converted by that DataLoader's ``collate_fn``, as a list of one (the sifter batches)."""

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        self.convert = convert

    def __call__(self, sample: Any) -> list[Any]:
        return [self.convert(sample)]


def _meta(batch: Any, sifter: sp.Sifter) -> tuple[Sequence[Any] | None, Any]:
    """The keys and weights a sifted batch carries (``None`` where it carries none)."""
    key = sifter.key
    if isinstance(batch, Mapping):
        # (any mapping: HF collators return a BatchEncoding, a UserDict, whose weights and keys
        # were read as none: trained unweighted, no feedback, nothing said)
        keys = batch.get(key) if isinstance(key, str) else None
        return keys, batch.get(sifter.weight_field)
    if isinstance(batch, tuple | list):
        keys = batch[key] if isinstance(key, int) and not isinstance(key, bool) else None
        if not sifter.attach_weight:
            weights = None
        elif hasattr(batch, "_fields"):
            weights = getattr(batch, sifter.weight_field)  # a namedtuple holds it in its own field
        else:
            weights = batch[-1]
        return keys, weights
    return None, None
