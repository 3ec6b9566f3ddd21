"""``python -m siftpipe``: the same command line as the ``siftpipe`` script."""

import sys

from .cli import main

sys.exit(main())
