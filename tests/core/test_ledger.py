"""siftpipe.core.ledger: where the stage stands in a pass (pending groups, consumed and emitted
positions) and the output that hands kept rows on, on their own (no Sifter, no pass)."""

from __future__ import annotations

import numpy as np
import torch

from siftpipe.core.ledger import Group, Ledger, Output
from siftpipe.core.scoring import Scoring


def decided(items, rows, seq0, kept) -> Group:
    group = Group(items, rows=rows, seq0=seq0, snapshot=None)
    group.kept_index = np.asarray(kept, dtype=np.int64)
    return group


def per_sample(ledger, output_batch=None):
    return Output(ledger, Scoring(None, None, micro_batch=4), output_batch)


def batched(ledger, output_batch=None):
    return Output(ledger, Scoring(None, None, batched=True), output_batch)


def test_consumed_moves_only_at_group_boundaries_once_every_kept_row_is_handed_on():
    ledger = Ledger()
    output = per_sample(ledger)
    a = decided(list("abcd"), 4, 0, [0, 2])
    b = decided(list("efgh"), 4, 4, [1])
    ledger.pending.extend([a, b])
    it = output.hand_on(a)
    assert next(it) == "a" and (ledger.consumed, ledger.emitted) == (0, 1)
    assert next(it) == "c"
    assert list(it) == [] and (ledger.consumed, ledger.emitted, len(ledger.pending)) == (4, 0, 1)
    assert list(output.hand_on(b)) == ["f"] and (ledger.consumed, ledger.pending) == (
        8,
        type(ledger.pending)(),
    )
    assert output.handed == 3


def test_a_group_with_nothing_kept_is_passed_over():
    ledger = Ledger()
    output = batched(ledger)
    empty = decided([{"x": torch.arange(3)}], 3, 0, [])
    ledger.pending.append(empty)
    # consumed counts input items: one batch of three rows
    assert list(output.hand_on(empty)) == [] and ledger.consumed == 1 and not ledger.pending


def test_fixed_size_batches_span_groups_and_the_rest_comes_at_the_end():
    ledger = Ledger()
    output = batched(ledger, output_batch=4)
    groups = [decided([{"x": torch.arange(s, s + 5)}], 5, s, [0, 1, 3]) for s in (0, 5, 10)]
    ledger.pending.extend(groups)
    out = [b["x"].tolist() for g in groups for b in output.hand_on(g)]
    assert out == [[0, 1, 3, 5], [6, 8, 10, 11]]
    # the third batch still has a kept row in the buffer: it is pending, the first two are not
    assert ledger.consumed == 2 and len(ledger.pending) == 1
    assert [b["x"].tolist() for b in output.finish()] == [[13]]
    assert output.handed == 9


def test_a_re_read_group_skips_the_rows_handed_on_before_the_checkpoint():
    ledger = Ledger()
    output = per_sample(ledger, output_batch=None)
    group = decided(list("abcdef"), 6, 0, [0, 2, 4, 5])
    group.skip = 2
    ledger.pending.append(group)
    ledger.emitted = 2  # as a resumed stage stands: two of the group's kept rows went out before
    assert list(output.hand_on(group)) == ["e", "f"] and ledger.consumed == 6


def test_per_sample_output_batches_are_collated_with_the_scorings_collate_fn():
    ledger = Ledger()
    output = per_sample(ledger, output_batch=2)
    samples = [{"v": torch.tensor(i)} for i in range(5)]
    group = decided(samples, 5, 0, [0, 1, 2, 4])
    ledger.pending.append(group)
    out = [b["v"].tolist() for b in output.hand_on(group)]
    assert out == [[0, 1], [2, 4]] and ledger.consumed == 5 and output.busy >= 0
