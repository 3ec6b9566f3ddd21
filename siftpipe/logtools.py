"""``siftpipe.logtools``, the documented import path of the audit log's summary and plot: the
module itself, :mod:`siftpipe.audit.summary` (the ``siftpipe log`` commands are in
:mod:`siftpipe.cli.log`)."""

import sys

from .audit import summary as _module
from .audit.summary import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
