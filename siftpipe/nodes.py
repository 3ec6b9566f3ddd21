"""``siftpipe.nodes``, the documented import path of the torchdata adapter: the module itself,
:mod:`siftpipe.adapters.nodes` (``siftpipe.nodes is siftpipe.adapters.nodes``)."""

import sys

from .adapters import nodes as _module
from .adapters.nodes import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
