"""siftpipe.core.scoring: the stage's scoring part on its own (no Sifter, no pass): one float64
loss per row, in micro-batches, in eval and inference mode, with the scorer's output checked and
out-of-memory errors split in halves when asked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from siftpipe.core.ledger import Group
from siftpipe.core.scoring import Scoring
from siftpipe.errors import ScorerError, ScorerOutputError


def names(at: np.ndarray) -> list[str]:
    return [f"k{i}" for i in at.tolist()]


def samples(n: int) -> list[dict]:
    return [{"x": torch.tensor([float(i)]), "loss": torch.tensor(float(i))} for i in range(n)]


def carried(model, batch):
    """Each row's loss is the value it carries: what was scored is visible in the result."""
    return batch["loss"].double()


class Recorder(nn.Module):
    """Records, on each forward, the mode it ran in and how many rows it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), len(x)))
        return x[:, 0]


def test_per_sample_rows_are_collated_scored_and_returned_as_float64():
    scoring = Scoring(None, carried, micro_batch=4)
    group = Group(samples(4), rows=4, seq0=100, snapshot=None)
    losses = scoring.rows(group, None, names)
    assert losses.dtype == np.float64 and losses.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert scoring.rows(group, np.array([3, 1]), names).tolist() == [3.0, 1.0]


def test_a_short_micro_batch_is_padded_to_the_fixed_size_and_the_padding_dropped():
    shapes = []

    def scorer(model, batch):
        shapes.append(len(batch["loss"]))
        return batch["loss"].double()

    scoring = Scoring(None, scorer, micro_batch=8, pad_micro_batch=True)
    group = Group(samples(3), rows=3, seq0=0, snapshot=None)
    assert scoring.rows(group, None, names).tolist() == [0.0, 1.0, 2.0]
    assert shapes == [8]


def test_a_batched_group_is_scored_in_micro_batches_of_rows():
    rows = []

    def scorer(model, batch):
        rows.append(len(batch["loss"]))
        return batch["loss"].double()

    batch = {"loss": torch.arange(10, dtype=torch.float32)}
    scoring = Scoring(None, scorer, micro_batch=4, batched=True)
    group = Group([batch], rows=10, seq0=0, snapshot=None)
    assert scoring.rows(group, None, names).tolist() == list(map(float, range(10)))
    assert rows == [4, 4, 2]
    rows.clear()
    assert scoring.rows(group, np.array([9, 0, 5]), names).tolist() == [9.0, 0.0, 5.0]
    assert rows == [3]


def test_the_forward_runs_in_eval_and_inference_mode_and_the_models_mode_comes_back():
    model = Recorder().train()
    scoring = Scoring(model, lambda m, b: m(b["x"]), micro_batch=2)
    scoring.rows(Group(samples(2), rows=2, seq0=0, snapshot=None), None, names)
    assert model.seen == [(False, False, True, 2)] and model.training
    model.seen.clear()
    keep_mode = Scoring(model, lambda m, b: m(b["x"]), micro_batch=2, eval_mode=False)
    keep_mode.rows(Group(samples(2), rows=2, seq0=0, snapshot=None), None, names)
    assert model.seen == [(True, False, True, 2)] and model.training


def test_the_models_mode_comes_back_when_the_scorer_raises():
    model = Recorder().train()

    def broken(m, b):
        raise ValueError("no such field")

    scoring = Scoring(model, broken, micro_batch=2)
    with pytest.raises(
        ScorerError, match=r"raised ValueError: no such field .* at seq 7 \(keys \['k0', 'k1'\]\)"
    ):
        scoring.rows(Group(samples(2), rows=2, seq0=7, snapshot=None), None, names)
    assert model.training


@pytest.mark.parametrize(
    "output, expected",
    [
        (lambda b: [0.0, 1.0], "returned a list .* it must return a torch.Tensor of shape \\[2\\]"),
        (lambda b: b["loss"].reshape(2, 1), "returned shape \\[2, 1\\] .* use reduction='none'"),
        (lambda b: b["loss"][:1], "returned shape \\[1\\] .* exactly one loss per sample"),
        (lambda b: b["loss"].long(), "returned dtype torch.int64 .* \\(return loss.float\\(\\)\\)"),
    ],
)
def test_a_wrong_scorer_output_is_an_error_naming_the_micro_batch_and_the_fix(output, expected):
    scoring = Scoring(None, lambda m, b: output(b), micro_batch=2)
    with pytest.raises(ScorerOutputError, match=expected) as caught:
        scoring.rows(Group(samples(2), rows=2, seq0=40, snapshot=None), None, names)
    assert "micro-batch at sample seq 40" in str(caught.value)


def test_a_batch_that_cannot_be_collated_names_its_keys_and_the_fix():
    scoring = Scoring(None, carried, micro_batch=2)
    group = Group([{"loss": torch.tensor(1.0)}, {"other": 1}], rows=2, seq0=5, snapshot=None)
    with pytest.raises(
        ScorerError, match=r"collating micro-batch at sample seq 5 \(keys \['k0', 'k1'\]\).*collate_fn"
    ):
        scoring.rows(group, None, names)


def test_losses_that_need_grad_come_back_detached():
    scoring = Scoring(None, lambda m, b: b["loss"].requires_grad_(), micro_batch=2)
    with torch.inference_mode(False):
        losses = scoring.rows(Group(samples(2), rows=2, seq0=0, snapshot=None), None, names)
    assert losses.tolist() == [0.0, 1.0]


def test_out_of_memory_is_split_in_halves_when_asked_and_named_when_not():
    """A scorer that runs out of memory above 2 rows: with on_oom='split' each row is scored
    once, in halves, in order; by default the error says how to split."""
    seen = []

    def scorer(model, batch):
        if len(batch["loss"]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen.append(batch["loss"].tolist())
        return batch["loss"].double()

    group = Group(samples(7), rows=7, seq0=0, snapshot=None)
    split = Scoring(None, scorer, micro_batch=7, on_oom="split")
    assert split.rows(group, None, names).tolist() == list(map(float, range(7)))
    assert [v for part in seen for v in part] == list(map(float, range(7)))
    with pytest.raises(ScorerError, match="on_oom='split'"):
        Scoring(None, scorer, micro_batch=7).rows(group, None, names)
