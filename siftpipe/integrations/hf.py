"""Sifting in the Hugging Face ``Trainer``: ``SiftTrainer``, ``SiftTrainerMixin`` and ``ModelLoss``.

    import siftpipe as sp
    from siftpipe.integrations.hf import ModelLoss, SiftTrainer

    sifter = sp.Sifter(model, ModelLoss(), sp.RelativeProbabilistic(1.0), memory=sp.ScoreMemory(100_000))
    trainer = SiftTrainer(model=model, args=args, train_dataset=train, sifter=sifter)   # args.max_steps > 0
    trainer.train()                          # or trainer.train(resume_from_checkpoint=True)

The stage runs in the training process, after the DataLoader: the Trainer's DataLoader (its sampler,
workers, sharding across processes) yields lists of samples, the stage scores them with the live
model, and collates the kept ones with the Trainer's data collator into batches of
``per_device_train_batch_size`` kept samples. Details, caveats and what ``max_steps`` means:
docs/integrations.md.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, IterableDataset, default_collate

import siftpipe as sp

from . import MissingExtraError
from ._common import (
    EPOCH_FIELD,
    MetaCollate,
    SiftedStream,
    as_list,
    check_feedback_key,
    key_fields,
    split_meta,
    warn_stale_epochs,
    with_index_keys,
)

try:
    from accelerate import skip_first_batches
    from accelerate.data_loader import IterableDatasetShard
    from transformers import Trainer, TrainerCallback
    from transformers.models.auto import modeling_auto
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:
    raise MissingExtraError.of("siftpipe.integrations.hf", "hf", "transformers and accelerate", exc) from None

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["STATE_FILE", "ModelLoss", "SiftTrainer", "SiftTrainerMixin"]

#: The stage's state in each checkpoint folder, one file per process: ``STATE_FILE.format(rank=r)``.
STATE_FILE = "siftpipe-rank{rank}.pt"

KINDS = ("causal_lm", "tokens", "classification", "regression", "multi_label")


def _names(*mappings: Mapping[str, Any]) -> frozenset[str]:
    out: set[str] = set()
    for mapping in mappings:
        for value in mapping.values():
            out.update((value,) if isinstance(value, str) else value)
    return frozenset(out)


_CAUSAL = _names(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
_TOKENS = _names(
    modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)
_CLASSIFY = _names(
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES,
)
_PROBLEMS = {
    "regression": "regression",
    "single_label_classification": "classification",
    "multi_label_classification": "multi_label",
}


def _even_batches(loader: Any, size: int) -> bool:
    """Whether every batch of ``loader`` but the last holds ``size`` samples: its batch sampler
    (under accelerate's wrappers) is a torch ``BatchSampler`` of that size. Another one (the
    Trainer's ``train_sampling_strategy="batch_rebalance"``) makes batches of other sizes, and
    skipping ``skip // size`` of them would land elsewhere than ``skip`` samples in."""
    sampler = getattr(loader, "batch_sampler", None)
    while sampler is not None and type(sampler) is not BatchSampler and hasattr(sampler, "batch_sampler"):
        if getattr(sampler, "split_batches", False):
            return False  # accelerate's split_batches: each process takes a slice of each batch
        sampler = sampler.batch_sampler  # accelerate's BatchSamplerShard, SkipBatchSampler
    return type(sampler) is BatchSampler and sampler.batch_size == size


@functools.lru_cache(maxsize=64)
def _takes_use_cache(model_class: Any) -> bool:
    """Whether the model class's ``forward`` names a ``use_cache`` parameter."""
    try:
        return "use_cache" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


class ModelLoss:
    """A scorer: the per-sample loss that a ``transformers`` model's own training loss is made of.

    The model's loss is a mean (or, with gradient accumulation, a sum divided by the step's token
    count) over per-token or per-sample terms; ``terms`` returns each sample's sum of terms and
    their count, and calling the scorer returns their mean, one loss per sample. Scoring with it
    and feeding back the training step's losses (``SiftTrainer`` does) therefore puts the same
    quantity into the score memory either way.

    Args:
        kind: How the model computes its loss: ``"causal_lm"`` (token cross-entropy, labels
            shifted by one), ``"tokens"`` (masked LM, token classification, encoder-decoder),
            ``"classification"``, ``"regression"``, ``"multi_label"``, or ``"auto"``: from the
            model's class (its ``loss_type``, else the auto-model mappings) and config.
        labels: The batch field with the labels (not passed to the model when scoring).
        ignore_index: Label value that is not a target (padding, prompt tokens).
    """

    def __init__(self, kind: str = "auto", labels: str = "labels", ignore_index: int = -100) -> None:
        if kind != "auto" and kind not in KINDS:
            raise sp.ConfigError(f"ModelLoss kind must be 'auto' or one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.labels = labels
        self.ignore_index = ignore_index

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, _ = split_meta(batch)
        labels = inputs.pop(self.labels, None)
        if labels is None:
            raise KeyError(
                f"the batch has no labels field {self.labels!r} (it has {', '.join(map(repr, batch))})"
            )
        inner = getattr(model, "module", model)
        if getattr(getattr(inner, "config", None), "is_encoder_decoder", False) and not (
            {"decoder_input_ids", "decoder_inputs_embeds"} & set(inputs)
        ):
            # an encoder-decoder model makes its decoder's inputs from the labels (shifted right),
            # which scoring does not pass: made here as its training forward makes them (found
            # by review, 2026-12-05: T5 failed, "You must specify exactly one of input_ids...")
            prepare = getattr(inner, "prepare_decoder_input_ids_from_labels", None)
            if callable(prepare):
                inputs["decoder_input_ids"] = prepare(labels=labels)
            else:
                inputs["labels"] = labels  # its forward shifts them; its own loss is unused
        if (
            "use_cache" not in inputs
            and getattr(getattr(inner, "config", None), "use_cache", False)
            and _takes_use_cache(cast(Any, type(inner)))
        ):
            # a decoder in eval mode keeps every layer's keys and values for generation: about the
            # logits' memory again, never read here (found by review, 2026-12-05)
            inputs["use_cache"] = False
        sums, counts = self.terms(model, model(**inputs), labels)
        return sums / counts.clamp(min=1)

    def resolve(self, model: nn.Module, labels: torch.Tensor) -> str:
        """The loss ``kind`` for ``model`` (a ``DistributedDataParallel`` wrapper is looked through)."""
        if self.kind != "auto":
            return self.kind
        model = getattr(model, "module", model)
        name = type(model).__name__
        loss_type = getattr(model, "loss_type", None)
        config = getattr(model, "config", None)
        if loss_type in ("ForCausalLM", "ForConditionalGeneration") or name in _CAUSAL:
            return "tokens" if getattr(config, "is_encoder_decoder", False) else "causal_lm"
        if loss_type in ("ForMaskedLM", "ForTokenClassification") or name in _TOKENS:
            return "tokens"
        if (isinstance(loss_type, str) and loss_type.endswith("Classification")) or name in _CLASSIFY:
            problem = getattr(config, "problem_type", None)
            if problem is None:
                if getattr(config, "num_labels", 2) == 1:
                    problem = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    problem = "single_label_classification"
                else:
                    problem = "multi_label_classification"
            return _PROBLEMS[problem]
        raise sp.ConfigError(
            f"cannot tell how {name} computes its loss (loss_type={loss_type!r}); pass "
            f"ModelLoss(kind=...) with one of {KINDS}, or your own scorer and sample_loss"
        )

    def terms(
        self, model: nn.Module, outputs: Any, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's sum of loss terms and their count, from the model's ``outputs``.

        Differentiable in the logits: with weights, the trained loss is rebuilt from these sums.
        """
        logits = getattr(outputs, "logits", None)
        if logits is None and isinstance(outputs, Mapping):
            logits = outputs.get("logits")
        if not isinstance(logits, torch.Tensor):
            raise sp.ScorerOutputError(
                f"the model's output ({type(outputs).__name__}) has no logits tensor; ModelLoss needs "
                "outputs with .logits (return_dict=True)"
            )
        kind = self.resolve(model, labels)
        labels = labels.to(logits.device)
        n = logits.shape[0]
        if kind in ("causal_lm", "tokens"):
            if kind == "causal_lm":
                # as the model does: the prediction at t is scored against the label at t + 1
                labels = F.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]
            tokens = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]),
                labels.reshape(-1),
                ignore_index=self.ignore_index,
                reduction="none",
            ).reshape(n, -1)
            return tokens.sum(dim=1), (labels != self.ignore_index).reshape(n, -1).sum(dim=1).to(tokens.dtype)
        if kind == "classification":
            loss = F.cross_entropy(logits.float().reshape(n, -1), labels.reshape(n), reduction="none")
            return loss, torch.ones_like(loss)
        if kind == "regression":
            err = (logits.float().reshape(n, -1) - labels.float().reshape(n, -1)) ** 2
        else:
            err = F.binary_cross_entropy_with_logits(
                logits.float().reshape(n, -1), labels.float().reshape(n, -1), reduction="none"
            )
        return err.sum(dim=1), torch.full((n,), float(err.shape[1]), device=err.device)

    def __repr__(self) -> str:
        return f"ModelLoss(kind={self.kind!r}, labels={self.labels!r})"


def _split_tails(loader: Any) -> None:
    """Make the ``IterableDatasetShard`` ``loader`` reads (several processes, an iterable
    dataset) split each pass's short last global batch among the processes as it is, where
    accelerate completes it with the pass's first batch: each process then trained those samples
    a second time in the pass, after another process had (found by review, 2026-12-06: 32
    decisions a pass for 30 samples, samples trained on both ranks in one pass). The sifted
    stream never ends before ``max_steps``: processes need no equal counts."""
    shard: Any = getattr(loader, "dataset", None)
    if type(shard) is IterableDatasetShard and shard.num_processes > 1 and not shard.drop_last:
        shard.__class__ = TailSplitShard


class TailSplitShard(IterableDatasetShard):  # type: ignore[misc]
    """accelerate's ``IterableDatasetShard``, whose pass's short last batch is split among the
    processes as it is (a process may get fewer rows, or none), not completed. At module level:
    DataLoader workers started by spawn or forkserver pickle it by name (the review of the fix:
    a class made inside a function could not be pickled)."""

    def __iter__(self) -> Iterator[Any]:
        dataset: Any = self.dataset
        if not hasattr(dataset, "set_epoch") and isinstance(
            getattr(dataset, "generator", None), torch.Generator
        ):
            dataset.generator.manual_seed(self.epoch)  # (as accelerate's own does)
        whole = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        share = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = slice(self.process_index * share, (self.process_index + 1) * share)
        batch: list[Any] = []
        for element in dataset:
            batch.append(element)
            if len(batch) == whole:
                yield from batch[mine]
                batch = []
        yield from batch[mine]  # the short last batch: this process's rows of it, if any


class _TrainLoader:
    """What the Trainer iterates: the sifted stream. It has no length: the Trainer runs ``max_steps``."""

    def __init__(self, stream: SiftedStream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[Any]:
        return iter(self.stream)


if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object


def _weights_other_than_1(weights: Any) -> Any:
    """The batch's weights, or None where it carries none or all are 1 (nothing to apply)."""
    return None if weights is None or bool((weights == 1).all()) else weights


class SiftTrainerMixin(_Base):
    """Sift the training batches of a ``transformers.Trainer`` (or a subclass of one).

    ``class MyTrainer(SiftTrainerMixin, SomeTrainer)`` adds sifting to any Trainer; ``SiftTrainer``
    is the mixin over the plain ``Trainer``. All Trainer arguments are accepted, plus:

    Args:
        sifter: The stage, in per-sample mode (``batched=False``, the default). Left at their
            defaults, its ``collate_fn`` becomes the Trainer's data collator and its
            ``output_batch`` the per-process batch size, so every batch holds
            ``per_device_train_batch_size`` kept samples (the last of a pass may hold fewer;
            with ``dataloader_drop_last=True`` the stage's ``drop_last`` is set too, and it is
            not handed on).
            Constructed with ``model=None`` or the Trainer's model, it scores with ``trainer.model``.
        sample_loss: Splits the model's loss into per-sample terms, for the feedback into the score
            memory and for weights (``ModelLoss`` by default; the sifter's scorer if that is one).
        feedback: Hand the training step's per-sample losses to ``sifter.observe`` (no second
            forward for trained samples). Default: when the sifter has a score memory.
        sync_every: Under torch.distributed, share loss histories across processes every this many
            optimizer steps (``sp.sync_history``); ``None`` keeps them per process.
        memory_sync_every: Under torch.distributed, share the sifter's score memory across
            processes every this many optimizer steps (``sp.sync_memory``): the Trainer's sampler
            deals samples to processes anew each pass, and a process's own memory would know
            about ``1 / world`` of the samples it meets next. Only new entries travel (16 bytes
            each). ``None``: never (each process always reads the same samples).

    The Trainer needs ``args.max_steps > 0``: with samples dropped, the number of steps in a pass
    is not known in advance. ``args.ignore_data_skip`` is set: on resume the stage positions the
    data itself, from the state saved in the checkpoint folder (``STATE_FILE``).
    """

    def __init__(
        self,
        *args: Any,
        sifter: sp.Sifter,
        sample_loss: ModelLoss | None = None,
        feedback: bool | None = None,
        sync_every: int | None = None,
        memory_sync_every: int | None = 50,
        **kwargs: Any,
    ) -> None:
        if not isinstance(sifter, sp.Sifter):
            raise sp.ConfigError(f"sifter must be a siftpipe.Sifter, got {type(sifter).__name__}")
        if sifter.batched:
            raise sp.ConfigError(
                "the Trainer integration feeds the Sifter samples and lets it collate the kept ones with "
                "the Trainer's data collator: construct it with batched=False (the default)"
            )
        for name, every in (("sync_every", sync_every), ("memory_sync_every", memory_sync_every)):
            if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
                raise sp.ConfigError(
                    f"{name} must be a number of optimizer steps >= 1 or None, got {every!r}"
                )
        super().__init__(*args, **kwargs)
        targs = self.args
        if targs.max_steps is None or targs.max_steps <= 0:
            raise sp.ConfigError(
                "sifting drops samples, so the Trainer cannot know how many steps a pass over the data "
                "takes: set TrainingArguments(max_steps=N), N optimizer steps of gradient_accumulation_steps "
                "x per_device_train_batch_size kept samples per process (num_train_epochs is not used)"
            )
        if targs.auto_find_batch_size:
            raise sp.ConfigError(
                "auto_find_batch_size would change the batch size under the Sifter's output_batch"
            )
        if targs.n_gpu > 1:
            raise sp.ConfigError(
                "sifting does not support DataParallel (several GPUs in one process): launch one process "
                "per GPU with torchrun or accelerate"
            )
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            raise sp.ConfigError(
                "sifting scores with the model between steps, and a sharded model (FSDP, DeepSpeed) "
                "gathers its parameters with collectives that processes keeping different numbers of "
                "samples would not all reach: use DistributedDataParallel"
            )
        config = self.accelerator.dataloader_config
        if config.dispatch_batches:
            raise sp.ConfigError(
                "accelerator_config dispatch_batches=True sends every batch from process 0 with a "
                "collective per batch; sifting processes read different numbers of batches: set it False"
            )
        # an IterableDataset would otherwise be read by process 0 and dispatched (see above)
        config.dispatch_batches = False
        if not getattr(config, "use_seedable_sampler", True) and self.accelerator.num_processes > 1:
            # found by review, 2026-12-06: 2 processes hung at the first pass boundary, one in
            # the step's all_gather, the other in the broadcast the loader's rng sync makes
            raise sp.ConfigError(
                "accelerator_config use_seedable_sampler=False makes the training loader "
                "synchronise its random state across processes (a broadcast) each time a pass "
                "starts, and sifting processes start their passes at different steps: they would "
                "wait for each other for good. Leave use_seedable_sampler on (the default)"
            )
        for name in ("save_strategy", "eval_strategy"):
            if str(getattr(targs, name, "")).lower().endswith("epoch"):
                warnings.warn(
                    f"{name}='epoch': with sifting the Trainer's one epoch spans all max_steps (like an "
                    "IterableDataset), so this happens only at the end; use 'steps'",
                    stacklevel=2,
                )
        targs.ignore_data_skip = True

        if isinstance(sifter.collate_fn, MetaCollate):
            # its collate function, output batch and (when it follows one) model were set from
            # the trainer it serves: a second trainer would collate with the first's collator and
            # score with the first's model, from the first run's state
            raise sp.ConfigError(
                "this Sifter already serves another trainer (a SiftTrainer or SiftCallback set its "
                "collate_fn, output_batch and model from that trainer): build a new Sifter, with a "
                "new score memory, for each trainer (a new run numbers its epochs from 0 again, and "
                "a loss remembered from a later epoch of the other run decides nothing in them)"
            )
        self.sifter = sifter
        self.sift_sample_loss = sample_loss or (
            sifter.scorer if isinstance(sifter.scorer, ModelLoss) else ModelLoss()
        )
        # the ModelLoss chosen here (None: one given); sift_sample_loss set later is one's own
        self._sift_default_terms = None if sample_loss is not None else self.sift_sample_loss
        if sifter.attach_weight:
            self._sift_check_terms()
        self.sift_feedback = sifter.memory is not None if feedback is None else bool(feedback)
        if self.sift_feedback and sifter.memory is None:
            raise sp.ConfigError(
                "feedback=True needs a score memory: Sifter(..., memory=sp.ScoreMemory(...))"
            )
        check_feedback_key(sifter, self.sift_feedback)
        self.sift_sync_every = sync_every
        self.sift_memory_sync_every = memory_sync_every if sifter.memory is not None else None
        #: Score-memory entries received from other processes (``memory_sync_every``), in all.
        self.sift_memory_received = 0
        self._sift_follows_model = sifter.model is None or sifter.model is self.model
        self._sift_inner: Any = None
        # whether the running training step's compute_loss reached this class's (training_step)
        self._sift_loss_ran = False
        self._sift_said_override = False
        self.sift_stream = SiftedStream(sifter, self._sift_open_pass, endless=True)

        user_collator = self.data_collator
        # the key is carried past the collator (which may drop or fail on it) and never reaches the model
        fields = key_fields(sifter)
        collate = user_collator if sifter.collate_fn is default_collate else sifter.collate_fn
        sifter.collate_fn = MetaCollate(collate, sifter.weight_field, self.sift_stream.collate_rng, fields)
        if sifter.output_batch is None:
            sifter.output_batch = targs.train_batch_size
            if targs.dataloader_drop_last:
                # as the Trainer's own loader would: every batch full (one shape), each pass's
                # short last batch untrained (stats.unhanded; the audit log reads it as not kept)
                sifter.drop_last = True
        # evaluation batches may carry the key field too (it survives column removal, below)
        self.data_collator = MetaCollate(user_collator, sifter.weight_field, fields=fields)
        self.add_callback(_SiftCallback(self))

    # ------------------------------------------------------------------ data

    def _set_signature_columns_if_needed(self) -> None:
        # the Trainer keeps only the columns the model's forward takes; the key must survive too
        super()._set_signature_columns_if_needed()
        key = self.sifter.key
        columns = self._signature_columns
        if isinstance(key, str) and columns is not None and key not in columns:
            columns.append(key)

    def get_train_dataloader(self) -> Any:
        """The sifted training batches: an iterable without a length (the Trainer runs ``max_steps``)."""
        dataset, collator = self.train_dataset, self.data_collator
        self.train_dataset = with_index_keys(dataset, self.sifter.key)
        self.data_collator = as_list  # type: ignore[assignment]
        # accelerate's even_batches fills each process's short last batch of a pass with samples
        # from the pass's start, for equal batch counts, which the endless sifted stream does not
        # need: each process then trained those samples twice in the pass (found by review,
        # 2026-12-05, 2 processes, 50 samples, batch 4). Off for the training loader alone: the
        # evaluation loop gathers per batch and needs equal counts
        config = self.accelerator.dataloader_config
        even = config.even_batches
        config.even_batches = False
        try:
            self._sift_inner = super().get_train_dataloader()
        finally:
            self.train_dataset, self.data_collator = dataset, collator
            config.even_batches = even
        _split_tails(self._sift_inner)
        return _TrainLoader(self.sift_stream)

    def _sift_open_pass(self, epoch: int, skip: int) -> tuple[Any, int]:
        inner: Any = self._sift_inner
        if inner is None:
            raise sp.SiftError(
                "the sifted stream was iterated before get_train_dataloader() built its loader"
            )
        warn_stale_epochs(inner, "TrainingArguments(dataloader_persistent_workers=False)")
        inner.set_epoch(epoch)
        # as the Trainer does: accelerate's set_epoch misses a batch sampler wrapped for sharding
        underlying: Any = getattr(getattr(inner, "batch_sampler", None), "batch_sampler", None)
        if hasattr(underlying, "set_epoch"):
            underlying.set_epoch(epoch)
        size = self.args.train_batch_size
        if skip < size or isinstance(inner.dataset, IterableDataset) or not _even_batches(inner, size):
            # the stream drops the first `skip` samples itself (they are loaded, not decided)
            return inner, 0
        # a map-style pass skips whole batches in the sampler, without loading them
        whole = skip // size
        loader: Any = skip_first_batches(inner, whole)
        loader.set_epoch(epoch)
        return loader, whole * size

    def _sift_check_terms(self) -> None:
        """Refuse weights where the Trainer's loss is not the model's own and no ``sample_loss``
        says how to split it: at construction, and at each weighted step (a weighting policy or
        a ``compute_loss_func`` set later; found by review, 2026-12-05: trained silently wrong)."""
        default = self.sift_sample_loss is self._sift_default_terms
        if default and (self.args.label_smoothing_factor or self.compute_loss_func):
            raise sp.ConfigError(
                "the policy weights samples, and label_smoothing_factor / compute_loss_func change the "
                "loss away from the model's own, which ModelLoss splits into per-sample terms: pass "
                "sample_loss= an object whose terms(model, outputs, labels) match your loss (its "
                "labels attribute names the labels field, 'labels' where it has none)"
            )

    # ------------------------------------------------------------------ training

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """``Trainer.training_step``, checking that the step's ``compute_loss`` reached this
        class's: a subclass's ``compute_loss`` that does not call it trained the kept samples
        unweighted and handed no loss back, nothing said, while the audit log recorded the
        weights (found by review, 2026-12-06). Weights other than 1 left unapplied are refused
        (``ConfigError``), losses not handed back are said once."""
        self._sift_loss_ran = False
        # (checked once the step returned: an error before the loss, an out-of-memory in moving
        # the batch, propagates as it is, not as a ConfigError blaming compute_loss; the review
        # of the check)
        loss = super().training_step(model, inputs, *args, **kwargs)
        if not self._sift_loss_ran:
            self._sift_bypassed(inputs)
        return loss

    def _sift_bypassed(self, inputs: Mapping[str, Any]) -> None:
        """A training step whose ``compute_loss`` did not call ``SiftTrainerMixin.compute_loss``
        (nor ``mark_sift_loss_handled``): see ``training_step``."""
        _, meta = split_meta(inputs)
        sifter = self.sifter
        weighted = _weights_other_than_1(meta.get(sifter.weight_field)) is not None
        keys = meta.get(sifter.key) if isinstance(sifter.key, str) else None
        fix = (
            f"{type(self).__name__}.compute_loss does not call super().compute_loss(model, inputs, "
            "...): call it for the loss (it applies the weights and hands the losses back, and keeps "
            f"siftpipe's fields from the model), or apply inputs[{sifter.weight_field!r}] and call "
            "self.sifter.observe(keys, per_sample_losses) yourself, then self.mark_sift_loss_handled()"
        )
        if weighted:
            raise sp.ConfigError(f"the batch's samples carry weights that were not applied: {fix}")
        if self.sift_feedback and keys is not None and not self._sift_said_override:
            self._sift_said_override = True
            warnings.warn(f"siftpipe: the step's per-sample losses were not handed back: {fix}", stacklevel=3)

    def mark_sift_loss_handled(self) -> None:
        """Say that this training step's ``compute_loss`` of one's own applied the weights
        (``inputs["__sift_weight__"]``) and handed the per-sample losses back
        (``self.sifter.observe``) itself, without ``super().compute_loss``: no error or warning
        about it (see ``training_step``)."""
        self._sift_loss_ran = True

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The Trainer's loss on the kept samples, times their weights; hands their losses back.

        Without weights (or with all weights 1) the loss is exactly the Trainer's. With weights each
        term of sample ``i`` counts ``w_i`` times, at the Trainer's own normalization: the loss is
        ``L + L / sum(s) * sum((w_i - 1) s_i)`` for the per-sample sums of terms ``s_i``, so terms
        of ``L`` that are not per sample (an auxiliary loss) keep their gradient.
        """
        inputs, meta = split_meta(inputs)
        self._sift_loss_ran = True
        sifter = self.sifter
        keys: list[Any] | None = meta.get(sifter.key) if isinstance(sifter.key, str) else None
        weights = _weights_other_than_1(meta.get(sifter.weight_field))
        observe = self.sift_feedback and keys is not None and model.training
        if weights is None and not observe:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if weights is not None:
            self._sift_check_terms()
        # read before the Trainer's compute_loss, which takes the labels out of the inputs it is
        # given when it computes the loss itself (label_smoothing_factor, compute_loss_func)
        field = getattr(self.sift_sample_loss, "labels", "labels")  # (a sample_loss of one's own)
        labels = inputs.get(field)
        if labels is None:
            raise sp.ConfigError(
                f"weights and feedback need the labels field {field!r} in the "
                f"batch (it has {', '.join(map(repr, inputs))}): collate the labels into it, or pass "
                "sample_loss=ModelLoss(labels='<field>')"
            )
        loss, outputs = super().compute_loss(model, dict(inputs), True, num_items_in_batch)
        with torch.set_grad_enabled(weights is not None and torch.is_grad_enabled()):
            sums, counts = self.sift_sample_loss.terms(self.model or model, outputs, labels)
        if observe and keys is not None:
            # the epoch of the pass that handed the batch on: the Trainer fetches ahead, so a
            # pass's last batch is trained after the next pass began
            epoch = meta.get(EPOCH_FIELD)
            # a row with no loss terms (every label -100: a masking collator that masked none of
            # a short row's tokens this time) has no loss to remember: NaN, which observe passes
            # over (found by review, 2026-12-06: remembered as 0.0, the most learned sample)
            per_sample = sums.detach() / counts.clamp(min=1)
            per_sample = per_sample.masked_fill(counts == 0, float("nan"))
            sifter.observe(keys, per_sample, epoch=epoch)
        if weights is not None:
            total = sums.detach().sum()
            if total > 0:
                # the model's loss is a fixed multiple of the sum of the terms (its normalization,
                # gradient accumulation, averaging across processes): add each sample's terms
                # w_i - 1 more times at that multiple. The loss keeps its own gradient path, so a
                # term that is not per sample (an MoE router's aux loss, a z-loss) keeps its
                # gradient; with all weights 1 it is exactly the model's loss.
                scale = loss.detach() / total
                loss = loss + scale * (sums * (weights.to(sums) - 1)).sum()
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        inputs, _ = split_meta(inputs)
        return super().prediction_step(model, inputs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluate``, off the stage's clock: an evaluation between training steps is
        not step time (``Sifter.off_clock``: ``stats.step_seconds``, ``saved_seconds`` and the
        cost guard's judgement would count it otherwise)."""
        with self.sifter.off_clock():
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        # a checkpoint between steps is not step time either (as evaluate, above)
        with self.sifter.off_clock():
            return super()._save_checkpoint(*args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, plus the stage's counters (``sift/...``) with every training loss."""
        if "loss" in logs:
            logs = {**logs, **{f"sift/{k}": v for k, v in self.sift_stream.metrics().items()}}
        super().log(logs, *args, **kwargs)

    def train(
        self, resume_from_checkpoint: str | os.PathLike[str] | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; resuming also restores the stage from the checkpoint folder."""
        if isinstance(resume_from_checkpoint, os.PathLike):
            # a pathlib.Path, as the Trainer takes it: the stage's state is in that folder too
            # (found by review, 2026-12-05: the Trainer resumed and the stage started afresh)
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
        if resume_from_checkpoint is True and self.args.output_dir and os.path.isdir(self.args.output_dir):
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, str):
            self.sift_load(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------ state

    def sift_save(self, folder: str) -> str:
        """Write this process's stage state into checkpoint ``folder``; returns the file's path."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=self.args.process_index))
        state = {"stream": self.sift_stream.state_dict(), "world_size": self.args.world_size}
        partial = f"{path}.partial-{os.getpid()}"
        torch.save(state, partial)
        os.replace(partial, path)  # a checkpoint holds the whole state or none
        return path

    def sift_load(self, folder: str) -> None:
        """Restore this process's stage state from checkpoint ``folder``."""
        name = STATE_FILE.format(rank=self.args.process_index)
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise sp.ResumeError(
                f"checkpoint {folder} has no siftpipe state for process {self.args.process_index} ({name}): "
                "it was saved by a Trainer without sifting, by fewer processes, or interrupted while "
                "saving; resume from an earlier checkpoint, or start a new sifted run from its weights "
                "(from_pretrained) without resume_from_checkpoint"
            )
        state = torch.load(path, weights_only=True)
        world = int(state.get("world_size", 1))
        if world != self.args.world_size:
            raise sp.ResumeError(
                f"checkpoint {folder} was saved by {world} process(es) and this run has "
                f"{self.args.world_size}: each process resumes its own stage, so resume with {world}"
            )
        self.sift_stream.load_state_dict(state["stream"])


class SiftTrainer(SiftTrainerMixin, Trainer):
    """``transformers.Trainer`` with sifting; see ``SiftTrainerMixin`` for the extra arguments."""


class _SiftCallback(TrainerCallback):
    """The stage's part of the Trainer's events: steps taken, checkpoints, the end of training."""

    def __init__(self, trainer: SiftTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self.trainer
        if trainer._sift_follows_model:
            trainer.sifter.model = trainer.model  # unwrapped: a DDP forward would be a collective
        trainer.sifter.model_version = state.global_step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self.trainer
        # every batch fetched for this step has been trained: none is carried into a checkpoint
        trainer.sift_stream.ack_all()
        trainer.sifter.model_version = state.global_step
        every = trainer.sift_sync_every
        if every and state.global_step % every == 0 and args.world_size > 1:
            sp.sync_history(trainer.sifter)
        every = trainer.sift_memory_sync_every
        if every and state.global_step % every == 0 and args.world_size > 1:
            # every process ends optimizer step N together: the collective meets
            trainer.sift_memory_received += sp.sync_memory(trainer.sifter)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        folder = os.path.join(args.output_dir or ".", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.trainer.sift_save(folder)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self.trainer
        trainer.sift_stream.close()
        flush = getattr(trainer.sifter.audit, "flush", None)  # a sink of one's own may have none
        if flush is not None:
            flush()
