"""The adversarial tally counts what it is told, refuses nonsense, and its own tests leave the
session's figures alone (they count inside ``tally.isolated()``)."""

import json

import pytest

from tests.conftest import pytest_terminal_summary
from tests.tally import isolated, totals, tried


def test_tried_adds_up_by_category():
    with isolated():
        tried("a")
        tried("a", 2)
        tried("b", 0)
        assert totals() == {"a": 3, "b": 0}


def test_negative_counts_are_refused_and_not_counted():
    with isolated():
        with pytest.raises(ValueError, match="cannot be negative"):
            tried("a", -1)
        assert totals() == {}


def test_counts_made_inside_isolated_never_reach_the_session():
    before = totals()
    with isolated():
        assert totals() == {}
        tried("kills survived", 5)
        tried("tally self-test", 3)
    assert totals() == before
    with pytest.raises(RuntimeError), isolated():
        tried("tally self-test")
        raise RuntimeError("a failing self-test")
    assert totals() == before and "tally self-test" not in totals()


class _Reporter:
    def __init__(self):
        self.lines = []

    def write_sep(self, sep, title):
        self.lines.append(title)

    def write_line(self, line):
        self.lines.append(line)


def test_the_terminal_summary_prints_and_writes_the_sessions_figures(tmp_path, monkeypatch):
    path = tmp_path / "tally.json"
    monkeypatch.setenv("SIFTPIPE_TALLY", str(path))
    with isolated():
        tried("kills survived", 2)
        tried("records lost", 0)
        reporter = _Reporter()
        pytest_terminal_summary(reporter, 0, None)
    assert reporter.lines == ["adversarial suite: what was tried", "kills survived: 2", "records lost: 0"]
    assert json.loads(path.read_text()) == {"kills survived": 2, "records lost": 0}
    with isolated():  # nothing tried: nothing printed, nothing written
        path.unlink()
        reporter = _Reporter()
        pytest_terminal_summary(reporter, 0, None)
    assert reporter.lines == [] and not path.exists()
