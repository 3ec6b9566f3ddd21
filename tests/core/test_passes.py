"""siftpipe.core.passes: the stage's passes part, on its own (no Sifter)."""

import numpy as np
import pytest
import torch

import siftpipe as sp
from siftpipe.core.ledger import Group
from siftpipe.core.passes import POSITION, Passes
from siftpipe.core.source import Reader


class Stateful:
    """A source that says where it is."""

    def __init__(self, n=6):
        self.n, self.at, self.loaded = n, 0, None

    def __iter__(self):
        while self.at < self.n:
            self.at += 1
            yield {"__key__": f"k{self.at - 1}"}

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.at = state["at"]


def keys(group):
    return [item["__key__"] for item in group.items]


def test_a_new_pass_advances_the_epoch_only_after_a_pass_that_opened_and_without_set_epoch():
    p = Passes()
    assert p.begin([], False, None) == (None, False)  # the first pass
    p.unstarted = False  # it read
    assert p.begin([], False, None) == (None, True)
    p.unstarted = False
    p.epoch_set = True
    assert p.begin([], False, None) == (None, False)
    assert p.begin([], False, None) == (None, False)  # re-opening an unread pass


def test_the_position_between_passes_has_every_entry_and_no_pending_groups():
    p = Passes()
    place = p.position(keys, False, "__key__")
    assert tuple(place) == POSITION
    assert place["pending"] == [] and place["consumed"] == 0 and not place["pass_open"]
    assert not place["opened"] and place["pass_read"]


def test_a_pending_group_is_described_by_its_keep_mask_weights_and_keys_and_loads_back():
    source = Stateful()
    p = Passes()
    p.begin(source, True, None)
    g = Group([{"__key__": "k0"}, {"__key__": "k1"}], 2, 0, {"at": 0})
    g.keep, g.kept_index, g.weight = np.array([True, False]), np.array([0]), np.array([2.0, 1.0])
    p.ledger.pending.append(g)
    place = p.position(keys, False, "__key__")
    assert place["read"] == 2 and place["source"] == {"at": 0} and place["pass_open"]
    (desc,) = place["pending"]
    assert desc["keys"] == ["k0", "k1"] and desc["keep"].tolist() == [True, False]
    assert desc["weight"].dtype == torch.float64

    q = Passes()
    q.load(place, forget_keys=True)
    assert q.open and q.restore is not None and q.restore["pending"][0]["keys"] is None
    assert q.resume_from(track_source=None) is None  # the tracked source is moved by the stage
    assert q.resume_from(track_source=False) == 0
    resumed = Stateful()
    resume, advance = q.begin(resumed, True, None)
    assert resume is not None and not advance and resumed.loaded == {"at": 0}


def test_a_tracked_position_needs_a_source_that_can_load_it():
    p = Passes()
    p.load({**Passes().position(keys, False, "__key__"), "source": {"at": 3}}, forget_keys=False)
    with pytest.raises(sp.ResumeError, match="has no load_state_dict.*track_source=False"):
        p.begin([1, 2, 3], False, None)


def test_a_pass_left_before_its_sources_end_marks_the_source_abandoned():
    source = Stateful()
    p = Passes()
    p.begin(source, True, None)
    reader = Reader(source, p.began_reading)
    run = p.run_begins(None)
    reader.iterate()
    reader.take(2)
    p.run_ends(run, finished=False, reader=reader)
    assert p.source_abandoned and not p.open
    p.run_ends(run - 1, finished=True, reader=reader)  # an older pass ending changes nothing
    assert p.source_abandoned
