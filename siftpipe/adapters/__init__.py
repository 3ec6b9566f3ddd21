"""The stage inside others' pipelines: webdataset (``webdataset``), torchdata nodes (``nodes``),
DataLoader workers before decoding (``predecode``), torch.distributed ranks (``distributed``).
They talk to the stage through its public methods."""
