"""``python -m siftpipe.cli``: the same command line as the ``siftpipe`` script."""

import sys

from . import main

sys.exit(main())
