"""Fixtures and hooks only: small models, sample streams, the loopback S3 server, the adversarial
tally. Helpers that tests import live in modules of their own (``common``, ``contract``, ``faults``,
``s3util``, ``tally``), never here."""

from __future__ import annotations

import pytest
import torch

from tests.common import make_samples

# (importing common sets torch to one intra-op thread, in this process and in the children
# that tests start)


@pytest.fixture
def samples():
    return make_samples(600)


@pytest.fixture
def linear_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@pytest.fixture(scope="session")
def local_s3():
    """One loopback S3 server for the session; tests that stop it use ``own_s3`` instead."""
    from tests.s3util import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture
def own_s3():
    """A loopback S3 server of this test's own, free to be stopped and restarted."""
    from tests.s3util import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture
def bucket(local_s3):
    """A new, empty bucket on the session's server: its name."""
    return local_s3.new_bucket()


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n 2``), each worker counts in its own process: the
    controller sums what they send back, so the summary below covers the whole session."""
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workeroutput"):
        config.pluginmanager.register(_TallyFromWorkers(), "siftpipe-tally-from-workers")


class _TallyFromWorkers:
    def pytest_testnodedown(self, node, error):
        from tests.tally import tried

        for category, n in getattr(node, "workeroutput", {}).get("siftpipe_tally", {}).items():
            tried(category, n)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand its counts to the controller
        from tests.tally import totals

        session.config.workeroutput["siftpipe_tally"] = totals()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print what the adversarial tests tried (see tests/tally.py), and write it where asked."""
    import json
    import os

    from tests.tally import totals

    counts = totals()
    if not counts:
        return
    terminalreporter.write_sep("-", "adversarial suite: what was tried")
    for category, n in counts.items():
        terminalreporter.write_line(f"{category}: {n}")
    path = os.environ.get("SIFTPIPE_TALLY")
    if path:
        with open(path, "w") as f:
            json.dump(counts, f, indent=1)
