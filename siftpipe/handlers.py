"""``siftpipe.handlers``, the documented import path of the shard and sample error handlers: the
module itself, :mod:`siftpipe.streaming.handlers` (``siftpipe.handlers is siftpipe.streaming.handlers``)."""

import sys

from .streaming import handlers as _module
from .streaming.handlers import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
