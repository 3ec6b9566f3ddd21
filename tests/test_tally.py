"""The adversarial tally counts what it is told and refuses nonsense."""

import pytest
from tally import totals, tried


def test_tried_adds_up_by_category():
    before = totals().get("tally self-test", 0)
    tried("tally self-test")
    tried("tally self-test", 2)
    assert totals()["tally self-test"] == before + 3


def test_negative_counts_are_refused():
    with pytest.raises(ValueError):
        tried("tally self-test", -1)
