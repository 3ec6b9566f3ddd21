"""Keep credentials out of messages, logs and reprs."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

# storage-option and environment names whose values are secrets
_SECRET_NAME = re.compile(r"(secret|token|password|passwd|credential|key$|key_id|access_key|session)", re.I)
_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECURITY_TOKEN")
_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)


def secret_values(storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Values that must never be shown: secret-looking storage options and AWS credentials."""
    found: list[str] = []

    def walk(options: Mapping[str, Any]) -> None:
        for name, value in options.items():
            if isinstance(value, Mapping):
                walk(value)
            elif isinstance(value, str) and len(value) >= 4 and _SECRET_NAME.search(str(name)):
                found.append(value)

    walk(storage_options or {})
    found.extend(v for v in (os.environ.get(name) for name in _ENV) if v and len(v) >= 4)
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every secret replaced by ``***`` and URL user-info removed."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return _USERINFO.sub(r"\g<scheme>***@", text)


def safe_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Storage options fit to show: secret-looking values replaced by ``***``."""
    out: dict[str, Any] = {}
    for name, value in (storage_options or {}).items():
        if isinstance(value, Mapping):
            out[name] = safe_options(value)
        elif _SECRET_NAME.search(str(name)):
            out[name] = "***"
        else:
            out[name] = value
    return out
