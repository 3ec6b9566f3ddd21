"""Keep credentials out of messages, logs and reprs.

Standard library only: the audit writer process loads this file without the package.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["REDACTED", "Redactor", "redact", "redact_options", "redact_url", "safe_options", "secret_values"]

_SENSITIVE_OPTION = re.compile(r"key|secret|token|passw|credential|signature|auth|session|sas", re.I)
_SENSITIVE_ENV = re.compile(
    r"(^|_)(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS?|SAS)(_|$)|ACCESS_KEY|ACCOUNT_KEY|API_KEY|"
    r"CONNECTION_STRING|SECRET_KEY",
    re.I,
)
_NOT_SECRET = re.compile(r"(?i)^(true|false|none|null|yes|no|on|off|[0-9.]+)$")
_SENSITIVE_QUERY = re.compile(
    r"signature|credential|token|secret|key|sig|auth|password|passwd|sas|session", re.I
)
_QUERY_IN_TEXT = re.compile(
    r"((?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|AWSAccessKeyId|"
    r"GoogleAccessId|access_token|sig|token|se?cret)=)([^&\s\"'<>]+)",
    re.I,
)
_USERINFO_IN_TEXT = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^/\s:@]+):([^/\s@]+)@")
_MIN_SECRET = 4
REDACTED = "***"


def _option_secrets(options: Any, parent_sensitive: bool = False) -> set[str]:
    found: set[str] = set()
    if isinstance(options, Mapping):
        for name, value in options.items():
            sensitive = parent_sensitive or bool(_SENSITIVE_OPTION.search(str(name)))
            found |= _option_secrets(value, sensitive)
    elif isinstance(options, list | tuple):
        for value in options:
            found |= _option_secrets(value, parent_sensitive)
    elif isinstance(options, str | bytes) and parent_sensitive:
        text = options.decode(errors="replace") if isinstance(options, bytes) else options
        if len(text) >= _MIN_SECRET:
            found.add(text)
    return found


def _env_secrets() -> set[str]:
    return {
        v
        for k, v in os.environ.items()
        if _SENSITIVE_ENV.search(k) and len(v) >= _MIN_SECRET and not _NOT_SECRET.match(v)
    }


def redact_url(url: str) -> str:
    """``url`` with any password in it and any credential-like query parameter replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _USERINFO_IN_TEXT.sub(rf"\1:{REDACTED}@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{REDACTED}@{host}" if ":" in userinfo else f"{REDACTED}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, REDACTED if _SENSITIVE_QUERY.search(k) else v) for k, v in pairs], safe="*{}.,"
        )
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class Redactor:
    """Removes credentials (from storage options and the environment) from text."""

    def __init__(self, storage_options: Mapping[str, Any] | None) -> None:
        self._secrets = _option_secrets(storage_options or {})

    def __call__(self, text: str) -> str:
        return redact(text, self._secrets | _env_secrets())


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of storage options fit for a repr: values of credential-like names are ***."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if _SENSITIVE_OPTION.search(str(name)):
            out[name] = REDACTED
        elif isinstance(value, Mapping):
            out[name] = redact_options(value)
        else:
            out[name] = value
    return out


def secret_values(storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Values that must never be shown: credential-like storage options and environment variables."""
    return sorted(_option_secrets(storage_options or {}) | _env_secrets(), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every one of ``secrets``, credential-like URL query values and URL passwords
    replaced by ``***``."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _QUERY_IN_TEXT.sub(rf"\1{REDACTED}", text)
    return _USERINFO_IN_TEXT.sub(rf"\1:{REDACTED}@", text)


#: Storage options fit to show (an alias kept for the audit log's reprs).
safe_options = redact_options
