"""``siftpipe.webdataset``, the documented import path of the WebDataset adapter: the module itself,
:mod:`siftpipe.adapters.webdataset` (``siftpipe.webdataset is siftpipe.adapters.webdataset``)."""

import sys

from .adapters import webdataset as _module
from .adapters.webdataset import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
