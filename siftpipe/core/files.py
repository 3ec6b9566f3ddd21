"""Whole-file writes to any fsspec filesystem: a reader sees the old file or the new one, never a
part (the audit log's parts and manifests, a published score memory and its ``latest.json``)."""

from __future__ import annotations

import secrets
from typing import Any

__all__ = ["put_whole"]


def put_whole(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on the fsspec filesystem ``fs``, whole or not at all.

    An object store's PUT is whole already. A local file is written aside, as
    ``_tmp-<random>-<name>.partial`` beside it (a name no ``*.parquet`` or ``*.json`` glob takes
    for a file of the directory, nor two writers share), then renamed over ``path``; a failed
    write leaves no aside file behind (a kill between the write and the rename does)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "file" not in protocols and "local" not in protocols:
        fs.pipe_file(path, data)
        return
    parent = fs._parent(path)
    fs.makedirs(parent, exist_ok=True)
    aside = f"{parent}/_tmp-{secrets.token_hex(4)}-{path.rsplit('/', 1)[-1]}.partial"
    try:
        with fs.open(aside, "wb") as f:
            f.write(data)
        fs.mv(aside, path)
    finally:
        if fs.exists(aside):
            fs.rm(aside)
