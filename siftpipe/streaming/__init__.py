"""Reading and writing WebDataset shards on any fsspec URL: the opener and tar reader (``opener``),
the error handlers (``handlers``), shard writing (``shards``). Knows no stage and no audit log."""
