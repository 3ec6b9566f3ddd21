"""The stage and what it decides with (policies, scorers, loss history, score memory, the
``Sifter`` facade over its parts): torch and numpy only; imports nothing outside ``core/`` and
``siftpipe.errors`` (``tests/test_layers.py``). The public names are the package root's."""
