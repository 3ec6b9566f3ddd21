"""A real S3-compatible HTTP server on loopback (moto's ThreadedMotoServer), reached through s3fs
exactly as production reaches AWS. It can be stopped and started again on the same port (its
buckets survive), which is how fault tests break storage."""

from __future__ import annotations

import logging
import os
import uuid

import s3fs
from moto.server import ThreadedMotoServer

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIATESTSIFTPIPE0000",
    "AWS_SECRET_ACCESS_KEY": "sIfTpIpE/tEsT/SeCrEt/KeY/0123456789abcdef",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def use_test_credentials() -> None:
    """Dummy keys in the environment; never a real profile."""
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.update(CREDENTIALS)


class LocalS3:
    def __init__(self) -> None:
        use_test_credentials()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = 0
        self.server: ThreadedMotoServer | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint}

    def start(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            # moto's stop() ends serving but leaves the listening socket open until collected, and
            # a start() on the same port meanwhile fails in the server's thread, where moto waits
            # for it for ever (found by review, 2026-12-06)
            listening = getattr(self.server, "_server", None)
            if listening is not None:
                listening.server_close()
            self.server = None

    def fs(self) -> s3fs.S3FileSystem:
        """A fresh s3fs instance (never a cached one: instances must not cross processes)."""
        return s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)

    def new_bucket(self) -> str:
        name = f"sift-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name
