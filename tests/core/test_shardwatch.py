"""The shard counters a stage watches (``ShardWatch``): held weakly, so that a pipeline made for
one pass is let go, and what its readers counted stays counted after."""

import copy
import pickle
import subprocess
import sys
import textwrap

from siftpipe.core.shardcounts import ShardWatch, SharedShardCounts
from tests.common import REPO


class Reader:
    """Anything holding shard counters (a shard opener)."""

    def __init__(self, skipped: int = 1) -> None:
        self.counts = SharedShardCounts()
        for i in range(skipped):
            self.counts.note_skip(f"s3://b/shard-{id(self)}-{i}.tar", "missing")


def test_readers_let_go_stay_counted_and_copies_count_alike():
    watch = ShardWatch()
    kept = Reader(2)
    watch.watch(kept, Reader(3))  # the second is let go at once
    stats = watch.stats()
    assert stats is not None and stats.skipped == 5 and len(stats.skipped_urls) == 5
    assert watch.skipped() == (5, 0)
    assert watch.counters == [kept.counts]
    for again in (pickle.loads(pickle.dumps(watch)), copy.deepcopy(watch)):
        assert again.stats() == stats


def test_readers_collected_inside_the_watchs_own_work_neither_hang_nor_lose_counts():
    # a counter in a reference cycle is collected by whichever allocation starts a garbage
    # collection, inside the watch's own locked code too: its finalizer took the same lock, and
    # the thread waited on itself for good (the review of the change, 2026-12-06)
    code = textwrap.dedent(
        f"""
        import gc, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.core.test_shardwatch import Reader
        from siftpipe.core.shardcounts import ShardWatch
        gc.set_threshold(50)
        watch = ShardWatch()
        for i in range(3000):
            a = Reader()
            a.counts.loop = a.counts  # freed by a garbage collection
            b = Reader()  # freed at once
            watch.watch(a, b)
            del a, b
        gc.collect()
        print(watch.skipped()[0])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6000"]


def test_a_run_that_never_reads_the_counts_holds_no_reference_per_reader_let_go():
    watch = ShardWatch()
    for _ in range(200):
        watch.watch(Reader(0))  # a reader made for one pass, let go after it
    assert len(watch._refs) <= 1 and len(watch._folds) <= 1
    assert watch.stats() is not None and watch.skipped() == (0, 0)
