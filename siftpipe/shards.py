"""``siftpipe.shards``, the documented import path of shard writing and sample encoding: the module itself,
:mod:`siftpipe.streaming.shards` (``siftpipe.shards is siftpipe.streaming.shards``)."""

import sys

from .streaming import shards as _module
from .streaming.shards import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
