"""What the trainer integrations share: a sifted stream of batches that resumes exactly.

``SiftedStream`` feeds a per-sample ``Sifter`` from a loader that yields *lists* of samples (the
trainer's DataLoader with an identity collate function) and hands on the sifter's collated batches.
The sifter collates with the trainer's own collate function (``MetaCollate``), so a batch handed
to the training step is exactly what the trainer would have built from the kept samples, dynamic
padding included, with siftpipe's per-sample fields (key, weight) carried past the collator.

Three things make a resumed run equal an uninterrupted one:

* **The sifter's state** (policy history, generator, score memory, position in the pass): the
  stream positions the loader at ``sifter.resume_from`` itself, skipping whole batches through
  the sampler where it can.
* **Data randomness apart from training randomness.** Everything the data pipeline does in the
  training process (creating a DataLoader iterator draws a seed, a shuffling sampler without a
  generator draws one, collators and datasets may draw) runs on a random state of its own,
  swapped in around those calls and saved in the state, including its value at the start of the
  pass, so a resumed pass re-creates the same shuffle and worker seeds. The training step's
  dropout therefore sees the same generator whether or not the loader was re-created.
* **Batches handed on but not trained yet.** Trainers fetch ahead (Lightning prefetches one batch
  to know the epoch's last one). Such a batch was already emitted by the sifter, so it is part of
  the state (``unacked``) and handed on again first after a resume. This is the only sample data a
  state holds: at most the batches fetched ahead, usually one.
"""

from __future__ import annotations

import random
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

import siftpipe as sp
from siftpipe.adapters.distributed import EqualSteps, sync_memory
from siftpipe.core.batch import batch_size

__all__ = [
    "EPOCH_FIELD",
    "META_FIELD",
    "DataRng",
    "MetaCollate",
    "SiftedStream",
    "capture_rng",
    "decode_rng",
    "encode_rng",
    "key_fields",
    "restore_rng",
    "split_meta",
    "with_index_keys",
]

#: The field of each dict batch a ``SiftedStream`` hands on that holds the epoch of its pass
#: (an int), for ``Sifter.observe(..., epoch=...)``.
EPOCH_FIELD = "__sift_epoch__"

#: The field of a dict batch that lists the per-sample fields ``MetaCollate`` carried past the
#: collator under names that do not start with ``__`` (a key field such as ``"id"``): they are
#: not model inputs (``split_meta``).
META_FIELD = "__sift_meta__"

#: Opens one pass: ``(epoch, skip) -> (lists of samples, samples skipped)``. The loader starts
#: ``skip`` samples into the pass, or fewer (whole batches skipped cheaply): the stream drops the
#: rest of the first ``skip`` samples itself.
OpenPass = Callable[[int, int], tuple[Iterable[Sequence[Any]], int]]


# ---------------------------------------------------------------------- random states


def check_feedback_key(sifter: Any, feedback: bool) -> None:
    """``ConfigError`` when an integration is to hand the step's losses back (``feedback``) but
    cannot read each sample's key from the collated batch: a callable ``key`` is computed from
    the samples, which the batch does not carry, so nothing would reach the memory and a stage
    keeping unknown samples (``sp.recipe``) would never sift."""
    if feedback and callable(sifter.key):
        raise sp.ConfigError(
            "feedback hands the training step's losses back by each sample's key, read from the "
            "batch, but the sifter's key is a callable, which the collated batch cannot give: "
            "put the key in a field of each sample and pass key='<field>', or feedback=False"
        )


def capture_rng(cuda: bool = False) -> dict[str, Any]:
    """The process-wide random states: torch (CPU, and every CUDA device if ``cuda``), Python, numpy."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if cuda and torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: Mapping[str, Any]) -> None:
    """Set the process-wide random states ``capture_rng`` returned."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def encode_rng(states: Mapping[str, Any]) -> dict[str, Any]:
    """``capture_rng``'s states as tensors, tuples and numbers (``torch.load(weights_only=True)``)."""
    name, keys, pos, has_gauss, cached = states["numpy"]
    version, internal, gauss = states["python"]
    out: dict[str, Any] = {
        "torch": states["torch"].clone(),
        "python": (int(version), torch.tensor(internal, dtype=torch.int64), gauss),
        "numpy": (
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
    }
    for name in ("cuda", "generators"):
        if name in states:
            out[name] = [s.clone() for s in states[name]]
    return out


def decode_rng(encoded: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``encode_rng``."""
    name, keys, pos, has_gauss, cached = encoded["numpy"]
    version, internal, gauss = encoded["python"]
    out: dict[str, Any] = {
        "torch": encoded["torch"],
        "python": (int(version), tuple(int(v) for v in internal.tolist()), gauss),
        "numpy": (name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)),
    }
    for name in ("cuda", "generators"):
        if name in encoded:
            out[name] = list(encoded[name])
    return out


class DataRng:
    """The random states the data pipeline runs on in the training process, kept apart from training.

    Args:
        seed: Seeds the states (a list of ints is fine: ``[seed, rank]``).
    """

    def __init__(self, seed: int | Sequence[int]) -> None:
        entropy = np.random.SeedSequence(seed).generate_state(2)
        one = int(entropy[0])
        self.state: dict[str, Any] = {
            "torch": torch.Generator().manual_seed(one).get_state(),
            "python": random.Random(one).getstate(),
            "numpy": np.random.RandomState(entropy).get_state(),
        }

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body on the data states; the training states are put back afterwards."""
        training = capture_rng()
        restore_rng(self.state)
        try:
            yield
        finally:
            self.state = capture_rng()
            restore_rng(training)

    def snapshot(self) -> dict[str, Any]:
        """A copy of the current data states."""
        return {
            "torch": self.state["torch"].clone(),
            "python": self.state["python"],
            "numpy": self.state["numpy"],
        }


# ---------------------------------------------------------------------- samples and batches


class _IndexKeyed(Dataset):  # type: ignore[type-arg]
    """A map-style dataset whose dict samples carry their index as the key (when they carry none)."""

    def __init__(self, dataset: Any, field: str) -> None:
        self.dataset = dataset
        self.field = field

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self._keyed(self.dataset[index], index)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # the DataLoader fetches a batch with this when the dataset has it (torch's Subset,
        # datasets.Dataset): the dataset's own, each sample keyed
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return [self._keyed(item, index) for item, index in zip(items, indices)]

    def _keyed(self, item: Any, index: int) -> Any:
        if isinstance(item, Mapping) and self.field not in item:
            item = {**item, self.field: str(index)}
        return item

    def __getattr__(self, name: str) -> Any:
        # samplers and trainers look for attributes of the dataset (lengths, column names)
        if name in ("dataset", "field"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def warn_stale_epochs(loader: Any, fix: str) -> None:
    """Warn of an iterable dataset with ``set_epoch`` read by persistent DataLoader workers whose
    epoch they may never see: they keep the copy they made at the first pass, so unless
    ``set_epoch`` reaches them through shared memory (Hugging Face ``datasets`` keep the epoch in
    a shared tensor) every pass reads the first pass's order, and a job resumed from a later
    pass (new workers, that pass's epoch) reads another and is refused by the key check (found
    by review, 2026-12-05; a refusal first, which refused Hugging Face's streaming datasets,
    whose persistent workers do see it). ``fix``: the setting to name."""
    dataset = getattr(loader, "dataset", None)
    if not (
        isinstance(dataset, IterableDataset)
        and hasattr(dataset, "set_epoch")
        and getattr(loader, "num_workers", 0) > 0
        and getattr(loader, "persistent_workers", False)
    ):
        return
    if _shares_its_epoch(dataset):
        return
    warnings.warn(
        f"siftpipe: the training dataset ({type(dataset).__name__}) is an IterableDataset with "
        "set_epoch read by persistent DataLoader workers, which keep the copy they made at the "
        "first pass: unless set_epoch reaches them through shared memory, every pass reads the "
        f"first pass's order, and a job resumed from a later pass reads another and is refused. "
        f"Pass {fix}, or keep the epoch in shared memory (a torch tensor after share_memory_(), "
        "as Hugging Face datasets do)",
        UserWarning,
        stacklevel=3,
    )


def _shares_its_epoch(dataset: Any) -> bool:
    """Whether ``dataset`` (or a dataset it wraps, ``.dataset``) keeps its epoch where its
    DataLoader workers share it with this process: an attribute named for the epoch (Hugging
    Face ``datasets``' ``_epoch``, open_clip's ``shared_epoch``) holding a shared-memory tensor or
    a ``multiprocessing`` value, or an object holding one (the review of the first version: any
    shared tensor, the data's own, silenced the warning)."""

    def shared(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return value.is_shared()
        return type(value).__module__.startswith("multiprocessing")

    for _ in range(4):
        for name, value in getattr(dataset, "__dict__", {}).items():
            if "epoch" not in name.lower():
                continue
            inner = getattr(value, "__dict__", {}).values() if not shared(value) else ()
            if shared(value) or any(shared(v) for v in inner):
                return True
        dataset = getattr(dataset, "dataset", None)
        if dataset is None:
            return False
    return False


def with_index_keys(dataset: Any, field: Any) -> Any:
    """``dataset``, or for a map-style dataset a view whose dict samples without ``field`` get
    their index (as a string) there: a key that names the same sample in every epoch, for the
    score memory and the audit log. Iterable datasets are returned as they are."""
    if not isinstance(field, str) or isinstance(dataset, IterableDataset):
        return dataset
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        return dataset
    return _IndexKeyed(dataset, field)


def as_list(samples: list[Any]) -> list[Any]:
    """A DataLoader collate function that leaves the samples uncollated (the sifter collates)."""
    return list(samples)


def split_meta(batch: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``batch`` without siftpipe's and WebDataset's per-sample fields (names starting ``__``, and
    the fields ``MetaCollate`` carried past the collator: a key field named otherwise), and those."""
    carried = batch.get(META_FIELD, ())
    plain: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for name, value in batch.items():
        is_meta = isinstance(name, str) and (name.startswith("__") or name in carried)
        (meta if is_meta else plain)[name] = value
    return plain, meta


def key_fields(sifter: Any) -> tuple[str, ...]:
    """The sifter's key when it names a field: ``MetaCollate(fields=...)`` carries it past the collator."""
    key = sifter.key
    return (key,) if isinstance(key, str) else ()


class MetaCollate:
    """Collate dict samples with ``collate`` while carrying their ``__`` fields past it.

    Collators built for model inputs (Hugging Face's pad and tensorize every field) fail on a
    string key or turn a float weight into a float64 column, and others drop fields they do not
    know. The ``__`` fields (and ``fields``) are taken out of each sample first and put back into
    the batch: the weight field as a float32 tensor, the others as lists. Carried fields whose
    names do not start with ``__`` are listed in the batch's ``META_FIELD``, so that ``split_meta``
    keeps them from the model's inputs. Samples that are not dicts are collated unchanged.

    Args:
        collate: The trainer's collate function.
        weight_field: The field that holds the sample weight.
        rng: Run ``collate`` on these data random states (collators may draw).
        fields: More per-sample fields to carry past the collator: the sifter's key when it names
            an ordinary field (``key="id"``), which the training step reads to hand losses back.
    """

    def __init__(
        self,
        collate: Callable[[list[Any]], Any],
        weight_field: str,
        rng: DataRng | None = None,
        fields: Sequence[str] = (),
    ) -> None:
        self.collate = collate
        self.weight_field = weight_field
        self.rng = rng
        self.fields = tuple(fields)

    def __call__(self, samples: list[Any]) -> Any:
        meta: dict[str, list[Any]] = {}
        if samples and isinstance(samples[0], Mapping):
            names = [k for k in samples[0] if isinstance(k, str) and (k.startswith("__") or k in self.fields)]
            if names:
                meta = {name: [s[name] for s in samples] for name in names}
                samples = [{k: v for k, v in s.items() if k not in meta} for s in samples]
        if self.rng is None:
            batch = self.collate(samples)
        else:
            with self.rng.active():
                batch = self.collate(samples)
        carried = [name for name in meta if not name.startswith("__")]
        if carried:
            meta[META_FIELD] = carried
        for name, values in meta.items():
            try:
                batch[name] = (
                    torch.tensor(values, dtype=torch.float32) if name == self.weight_field else list(values)
                )
            except TypeError:
                raise sp.ConfigError(
                    f"the collate function {self.collate!r} made a {type(batch).__name__} of dict samples; "
                    f"siftpipe carries the samples' {name!r} in the batch: return a dict from it"
                ) from None
        return batch

    def __repr__(self) -> str:
        return f"MetaCollate({self.collate!r})"


class Fetched(NamedTuple):
    """A batch the stream handed to the trainer and the trainer has not acked yet (or a loaded
    state's, to hand on again): its rows, the seq of its first row and the pass (epoch) that
    handed it on (None: not known), by the stage's record where it has one (a batch's first field
    is not always its rows)."""

    batch: Any
    rows: int
    seq: int | None
    epoch: int | None


def _count(value: Any) -> int | None:
    """``value`` if it is an int >= 0 (not a bool), else None: an entry of a saved state."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _rows_of(batch: Any) -> int:
    """Samples in a batch the stage handed on (0 where its collate function made something
    whose rows cannot be told: the audit note then says the right rows, with a count short)."""
    try:
        return batch_size(batch)
    except TypeError:
        return 0


# ---------------------------------------------------------------------- the stream


class SiftedStream:
    """Kept batches of a per-sample ``Sifter``, pass after pass, with a state that resumes exactly.

    Args:
        sifter: The stage (per-sample mode; its ``collate_fn`` builds the batches handed on).
        open_pass: Opens the loader for one pass (see ``OpenPass``).
        endless: Iterating never ends: pass follows pass (the Hugging Face ``Trainer`` counts
            optimizer steps, not passes). Otherwise one iteration is one pass (an epoch).
        lockstep: Under torch.distributed, end every rank's pass at the same step
            (``EqualSteps``: ranks keep different numbers of samples).
        sync_every: With ``lockstep``, share loss histories across ranks every this many steps.
        share_memory: With ``lockstep``, asked when each pass begins: whether to share the
            sifter's score memory across ranks then (``siftpipe.sync_memory``); None: at the end
            of each pass (``EqualSteps``' default), when it has one.
        generators: Returns the ``torch.Generator`` objects that shuffle the data (a DataLoader's
            ``generator=``): their states at the start of a pass are saved, so that a resumed pass
            is shuffled as the interrupted one was.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        sifter: sp.Sifter,
        open_pass: OpenPass,
        *,
        endless: bool,
        lockstep: bool = False,
        sync_every: int | None = None,
        share_memory: Callable[[], bool] | None = None,
        generators: Callable[[], list[torch.Generator]] | None = None,
    ) -> None:
        self.sifter = sifter
        self.generators = generators
        self.open_pass = open_pass
        self.endless = endless
        self.lockstep = lockstep
        self.sync_every = sync_every
        self.share_memory = share_memory
        self.data_rng = DataRng(sifter.rng_seed)
        # the collator's own states: it runs when the stage hands a batch on, so at a checkpoint
        # (between batches) they stand where the next batch's collation begins, whichever way
        # the resumed pass re-reads its source (found by review, 2026-12-06: sharing the loads'
        # states, a resumed pass that re-loads its samples collated with other draws)
        seed = sifter.rng_seed
        self.collate_rng = DataRng([*(seed if isinstance(seed, list) else [seed]), 1])
        #: The pass in progress (or the last one): the sifter's epoch.
        self.epoch = 0
        #: Batches fetched for a step that ``EqualSteps`` did not take (this rank, all passes).
        self.discarded = 0
        self._started = False
        self._pass_rng: dict[str, Any] | None = None
        self._resume_rng: dict[str, Any] | None = None
        self._unacked: deque[Fetched] = deque()  # handed on, not acked (oldest first)
        self._replay: deque[Fetched] = deque()  # a loaded state's, not yet handed on again
        self._active: Iterator[Any] | None = None
        self._acked_since_iter = False  # the trainer acked a batch since __iter__ last ran
        self._mine = 0  # batches the stage handed on in its current pass, in this process
        self._last = (0, 0)  # (seen, kept) at the last metrics() call

    # ------------------------------------------------------------------ iterating

    def __iter__(self) -> Iterator[Any]:
        active = self._active
        if active is not None and self._unacked and not self._acked_since_iter:
            # the last iteration handed on batches and the trainer trained none of them: it
            # fetched ahead and then began iterating again (Lightning's reload_dataloaders_every_
            # n_epochs fetches one batch in setup, then iterates anew for the epoch). Continue
            # that pass, those batches first: a new one would decide the fetched samples and
            # never train them, and number one pass too many
            gen = self._continued(active, [fetched.batch for fetched in self._unacked])
        else:
            if self._unacked:
                # the trainer trained some of the last iteration's batches and begins a new one
                # without the rest (Lightning's on_train_batch_start returning -1 ends an epoch
                # early, after fetching ahead): they are never trained. Noted so (the audit log
                # reads them as not kept) and forgotten: left here, every later ack popped one of
                # them, not the batch trained, and a checkpoint replayed trained batches (found by
                # review, 2026-12-05)
                self.discard_unacked()
                self._unacked.clear()  # (replayed from a loaded state: the last run handed them on)
            self.close()
            gen = self._active = self._endless() if self.endless else self._pass()
        self._acked_since_iter = False
        return gen

    @staticmethod
    def _continued(active: Iterator[Any], fetched: list[Any]) -> Iterator[Any]:
        """``fetched`` (handed on before, still unacked), then the rest of ``active``'s pass.
        ``next()``, not ``yield from``: an abandoned continuation, closed when it is collected,
        must not close the pass with it (``close()`` does that)."""
        yield from fetched
        while True:
            try:
                batch = next(active)
            except StopIteration:
                return
            yield batch

    def _endless(self) -> Iterator[Any]:
        while True:
            seen = self.sifter.stats.seen
            resumed = self.sifter.resume_from is not None
            handed = yield from self._one_pass()
            # a pass resumed from a checkpoint taken at its very end has nothing left: not empty data
            if not handed and self.sifter.stats.seen == seen and not resumed:
                raise sp.SiftError(
                    f"pass {self.epoch} over the training data gave no sample at all; the dataset or "
                    "stream is empty (an endless stream of passes over it would never yield a batch)"
                )

    def _pass(self) -> Iterator[Any]:
        import torch.distributed as dist

        if not (self.lockstep and dist.is_available() and dist.is_initialized()):
            yield from self._one_pass()
            return
        share = self.share_memory
        sifter = self.sifter
        if share is not None and sifter.memory is not None and sifter.resume_from is None and share():
            # when a pass begins, not when the last one ended: a trainer fetches its next batch
            # before it trains the one before, so the last batch's losses come after that end.
            # Every rank begins the pass together; one resumed inside it does not share again
            # (the run it resumes shared when the pass began)
            sync_memory(sifter)
        equal = EqualSteps(
            self._one_pass(),
            sifter=sifter,
            sync_every=self.sync_every,
            sync_memory=False if share is not None else None,
            replayed=len(self._replay),  # yielded first by _one_pass, before the stage's batches
            on_leave="ignore",  # a fit ending inside a pass (max_steps); the next shares first
        )
        before = equal.discarded
        try:
            yield from equal
        finally:
            if equal.discarded > before and self._unacked:
                # fetched from the pass (the last batch it handed on) and never handed to the
                # trainer: not a batch the trainer will ack, nor one a resumed run should replay
                self._unacked.pop()
            self.discarded += equal.discarded - before

    def _one_pass(self) -> Generator[Any, None, int]:
        sifter = self.sifter
        handed = 0
        while self._replay:
            fetched = self._replay.popleft()
            self._unacked.append(fetched)
            handed += 1
            yield fetched.batch
        skip = sifter.resume_from
        if skip is None:
            if self._started:
                self.epoch += 1
            self._started = True
            sifter.set_epoch(self.epoch)
            self._pass_rng = self.data_rng.snapshot()
            self._pass_rng["generators"] = [g.get_state() for g in self._generators()]
            self._resume_rng = None
            skip = 0
        else:
            # re-create the pass as it began (same shuffle, same worker seeds), then continue
            # from the random states the checkpoint had
            if self._pass_rng is None:
                raise sp.ResumeError("the state resumes a pass but holds no random state of its start")
            self.data_rng.state = dict(self._pass_rng)
            saved = self._pass_rng.get("generators", [])
            gens = self._generators()
            if len(saved) != len(gens):
                raise sp.ResumeError(
                    f"the checkpoint's pass was shuffled by {len(saved)} generator(s) and this loader has "
                    f"{len(gens)}: build the DataLoader as the interrupted run did"
                )
            for gen, gen_state in zip(gens, saved):
                gen.set_state(gen_state)
        with self.data_rng.active():
            lists, skipped = self.open_pass(self.epoch, skip)
            it = iter(lists)
            # the first batch too: a shuffling sampler draws its seed then, and in a resumed pass
            # it must draw from the state the pass began with
            first = next(it, None)
        if skipped:
            # batches before the cut skipped unloaded: their draws never happen, so the nearest
            # state is the checkpoint's (the re-read samples draw other values than before it)
            self._resumed()
        else:
            # every sample before the cut is loaded again from the state the pass began with (and
            # dropped): each load draws what it drew before the checkpoint, and the state at the
            # cut is the checkpoint's (found by review, 2026-12-06: an augmentation drawn at
            # num_workers=0 drew from the checkpoint's state from the first batch on)
            self._resume_rng = None
        self._mine = 0
        for batch in sifter(self._samples(first, it, skip - skipped)):
            if isinstance(batch, MutableMapping):
                # (any mapping: a BatchEncoding is a UserDict) the pass that handed it on: a trainer
                # that fetches ahead trains it after the next pass began, and its losses must still
                # count for this one (Sifter.observe)
                batch[EPOCH_FIELD] = self.epoch
            # the stage's record of it, read once (a batch's first field is not always its rows)
            recorded = sifter._last_handed()
            rows, seq = recorded if recorded is not None else (_rows_of(batch), None)
            self._unacked.append(Fetched(batch, rows, seq, self.epoch))
            self._mine += 1
            handed += 1
            yield batch
        return handed

    def _generators(self) -> list[torch.Generator]:
        return [] if self.generators is None else self.generators()

    def _samples(self, first: Sequence[Any] | None, it: Iterator[Sequence[Any]], drop: int) -> Iterator[Any]:
        samples = first
        while samples is not None:
            if drop >= len(samples):
                drop -= len(samples)
            else:
                if drop:
                    samples = samples[drop:]
                    drop = 0
                yield from samples
            with self.data_rng.active():
                samples = next(it, None)

    def _resumed(self) -> None:
        """A resumed pass has drawn what its start drew: continue on the checkpoint's random states."""
        if self._resume_rng is not None:
            self.data_rng.state = self._resume_rng
            self._resume_rng = None

    @property
    def trained_since_iter(self) -> bool:
        """Whether the trainer trained a batch since the stream was last begun (``iter``)."""
        return self._acked_since_iter

    def ack(self, batches: int = 1) -> None:
        """The trainer has trained the oldest ``batches`` batches handed on."""
        self._acked_since_iter = True
        for _ in range(min(batches, len(self._unacked))):
            self._unacked.popleft()

    def ack_all(self) -> None:
        """Every batch handed on so far has been trained."""
        self._acked_since_iter = True
        self._unacked.clear()

    def discard_unacked(self) -> int:
        """The trainer will train none of the batches handed on and not acked (its fit ended
        inside a pass with a batch fetched ahead: Lightning's ``max_steps``): the stage notes the
        rows of those it handed on as never handed on and ends its pass (``Sifter.discard_last``:
        ``stats.unhanded``; the audit log reads them as not kept), and a state taken from now on
        does not replay them (a checkpoint taken before still does: the job resumed from it trains
        them, and its audit log says so, ``rereads_from``). Batches replayed from a loaded state
        were handed on by the stage of the run that saved it, not this one: they stay. Returns the
        rows noted."""
        ours = min(len(self._unacked), self._mine)
        if not ours:
            return 0
        rows = self.sifter.discard_last(fetched=self._mine - ours + 1)
        for _ in range(ours):
            self._unacked.pop()
        self._mine -= ours
        return rows

    def give_up_loaded_pass(self) -> int:
        """The trainer will not continue the loaded state's pass: it opens the next epoch instead
        (Lightning resumed from a checkpoint of the last step of an epoch that
        ``limit_train_batches`` ended before the pass did). As the uninterrupted run did when it
        began that epoch, the batches the state would replay (fetched ahead, never trained) and
        the rows its stage decided kept and had not handed on are noted as never trained
        (``stats.unhanded``, the audit log), and the next iteration opens the next pass.
        Returns the replayed batches' rows noted (0: the state held none)."""
        sifter = self.sifter
        if self._active is not None or self._unacked:
            # a batch of the loaded state was handed on already, and will be trained: the pass
            # goes on (where the state's replayed batches begin is known, not where the rest do)
            return 0
        rows = sum(fetched.rows for fetched in self._replay)
        seq = self._anchor(self._replay) if self._replay else None
        if sifter.resume_from is None and seq is None:
            return 0
        self._replay.clear()
        sifter._give_up_loaded_pass(handed_from=seq, handed_rows=rows)
        self._resume_rng = None
        return rows

    def close(self) -> None:
        """Stop the pass in progress (its DataLoader workers end with it)."""
        gen, self._active = self._active, None
        if gen is not None:
            gen.close()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The sifter's state and the stream's, plain tensors, lists and numbers."""
        ours = min(len(self._unacked), self._mine)  # the batches this process's stage handed on
        fetched = list(self._unacked) + list(self._replay)
        return {
            "version": self.STATE_VERSION,
            # the batches not acked are in this state, handed on again after a resume and
            # trained (and observed) then: not rows the step failed to hand back. Counted by the
            # stage's record of what it handed on, not read from the batch (a time-major first
            # field read as rows said rows went unobserved; review, 2026-12-06)
            "sifter": self.sifter._state(
                0, sum(f.rows for f in list(self._unacked)[len(self._unacked) - ours :])
            ),
            "collate_rng": encode_rng(self.collate_rng.state),
            "epoch": self.epoch,
            "started": self._started,
            "data_rng": encode_rng(self.data_rng.state),
            "pass_rng": None if self._pass_rng is None else encode_rng(self._pass_rng),
            # oldest first: replayed batches handed on again (in _unacked), those not yet (in
            # _replay), then the stage's own (in _unacked: it hands on none before the replay ends);
            # with their rows and first seqs, for a resumed job that gives them up (the stage's
            # record: a batch's first field is not always its rows; review, 2026-12-06)
            "unacked": [f.batch for f in fetched],
            "unacked_rows": [f.rows for f in fetched],
            "unacked_seqs": [f.seq for f in fetched],
            "unacked_epochs": [f.epoch for f in fetched],
            "unacked_seq": self._anchor(fetched),
            "discarded": self.discarded,
        }

    def _anchor(self, fetched: Sequence[Fetched]) -> int | None:
        """Where the oldest of ``fetched`` handed on in the current pass begins (None: none, or
        not known): a resumed job's stage re-reads from there, and its audit log takes the rows
        from there as handed on again. Batches of an earlier pass, trained after this one began,
        are not (their pass's rows it left were noted never handed on, and stay so: found by
        review, 2026-12-06, an endless stream's state with the last batch of a pass and the
        first of the next unacked re-read from the older)."""
        for entry in fetched:
            if entry.epoch is None or entry.epoch == self.epoch:
                return entry.seq
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()``: the next iteration picks up where it was taken."""
        version = state.get("version") if isinstance(state, Mapping) else None
        if version != self.STATE_VERSION:
            raise sp.ResumeError(
                "not a state of siftpipe's trainer integration (or one of another version): "
                f"expected version {self.STATE_VERSION}, got {version!r}"
            )
        self.close()
        self.sifter.load_state_dict(state["sifter"])
        self.epoch = int(state["epoch"])
        self._started = bool(state["started"])
        current = decode_rng(state["data_rng"])
        # (a state from before the collator had its own: the shared one, as that run collated on)
        self.collate_rng.state = decode_rng(state["collate_rng"]) if "collate_rng" in state else dict(current)
        self._pass_rng = None if state["pass_rng"] is None else decode_rng(state["pass_rng"])
        self.data_rng.state = current
        self._resume_rng = current if self.sifter.resume_from is not None else None
        batches = list(state["unacked"])
        rows = state.get("unacked_rows")
        if not (
            isinstance(rows, list) and len(rows) == len(batches) and all(_count(r) is not None for r in rows)
        ):
            rows = [_rows_of(batch) for batch in batches]  # (a state from before they were saved)
        seqs = state.get("unacked_seqs")
        first = _count(state.get("unacked_seq"))
        if not (isinstance(seqs, list) and len(seqs) == len(batches)):
            seqs = [first] + [None] * (len(batches) - 1)  # (from before they were saved: the first's)
        epochs = state.get("unacked_epochs")
        if not (isinstance(epochs, list) and len(epochs) == len(batches)):
            epochs = [b.get(EPOCH_FIELD) if isinstance(b, Mapping) else None for b in batches]
        self._replay = deque(
            Fetched(batch, r, _count(q), _count(e))
            for batch, r, q, e in zip(batches, rows, seqs, epochs, strict=True)
        )
        self._unacked.clear()
        self._mine = 0
        # (the anchor of what was loaded, not the saved one: a state written before each batch's
        # pass was saved named the oldest batch of any pass; review, 2026-12-06)
        replay_seq = self._anchor(self._replay) if self._replay else None
        rereads = getattr(self.sifter.audit, "rereads_from", None)
        if replay_seq is not None and callable(rereads):
            # this job hands those batches on again, and trains them: an earlier attempt's note
            # that they were never handed on (written when its fit ended, after this state was
            # taken: discard_unacked) no longer holds. From there the stage re-reads its pending
            # rows too (Sifter.load_state_dict said where they begin)
            pending = state["sifter"].get("pending") or []
            rereads(min([replay_seq, *(int(g["seq0"]) for g in pending[:1])]))
        self.discarded = int(state.get("discarded", 0))
        stats = self.sifter.stats
        self._last = (stats.seen, stats.kept)

    # ------------------------------------------------------------------ metrics

    def metrics(self, window: bool = True) -> dict[str, float]:
        """Counters for the trainer's log: running totals, and the keep rate since the last call
        (``window``) or since the start."""
        stats = self.sifter.stats
        seen0, kept0 = self._last
        self._last = (stats.seen, stats.kept)
        since = stats.seen - seen0
        out = {
            "keep_rate": (stats.kept - kept0) / since if window and since else stats.keep_rate,
            "seen": float(stats.seen),
            "kept": float(stats.kept),
            "scored": float(stats.scored),
            "from_memory": float(stats.from_memory),
            "observed": float(stats.observed),
            "seconds": stats.score_seconds + stats.decide_seconds,
            "epoch": float(self.epoch),
        }
        if self.discarded:
            out["discarded"] = float(self.discarded)
        if stats.unhanded:
            out["unhanded"] = float(stats.unhanded)  # kept, never trained (docs/integrations.md)
        return out
