"""A loopback S3 server (moto) in its own process, for benchmarks and examples.

In its own process so that serving requests does not compete with the measured code for the GIL.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def use_dummy_credentials() -> None:
    os.environ.pop("AWS_PROFILE", None)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "AKIALOCALBENCH000000")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local-benchmark-secret")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


class S3Server:
    """``with S3Server() as s3: s3.endpoint`` - a moto server on 127.0.0.1 (a free port)."""

    def __init__(self) -> None:
        use_dummy_credentials()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint}

    def bucket(self, name: str) -> str:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True).mkdir(name)
        return name

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
