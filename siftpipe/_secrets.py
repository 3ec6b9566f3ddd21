"""Keep credentials out of everything siftpipe records, prints or raises.

One function, ``redact``, does it everywhere: the audit log's ``url`` column and manifests,
reprs, warnings, errors, and the ``siftpipe`` command line. It removes

* every value given to it as a secret (credential-like storage options, credential-like
  environment variables, passwords and signatures found in the URLs a user passed), also
  percent-encoded;
* the password of any ``scheme://user:password@host`` URL in the text (S3 keys written as
  ``s3://KEY:SECRET@bucket`` too, with a ``/`` in the secret), and a user-only
  ``scheme://TOKEN@host``;
* the value of every ``name=value`` whose name is a credential's (URL query parameters and
  connection strings alike): S3 presigned URLs (``X-Amz-Signature``, ``X-Amz-Credential``,
  ``X-Amz-Security-Token``, ``Signature``, ``AWSAccessKeyId``), GCS signed URLs
  (``X-Goog-Signature``, ``X-Goog-Credential``, ``access_token``), Azure SAS (``sig``) and
  connection strings (``AccountKey``, ``SharedAccessSignature``, ``SharedAccessKey``), and any
  ``password``/``pwd``/``token``/``secret``/``key``;
* ``"name": "value"`` pairs of such names (JSON, dict reprs), ``name='value'`` keyword
  arguments in reprs (but a bare ``key='...'``, which names a stage's key field), hyphenated
  headers in plain text (``X-Api-Key: ...``) and ``Bearer``/``Authorization`` tokens;
* URLs inside URLs: given as a parameter (``?next=https://user:password@host/...``), or
  percent-encoded there, once or twice (their credentials decoded are secrets too);
* in a webdataset ``pipe:`` URL's shell command, the values of ``-u``/``--user``, of flags and
  credential headers that name a secret, of credential-like environment assignments, and the
  password flags of curl, openssl, sshpass, mysql (``-pPW``), 7z/rar, zip/unzip (``-P``),
  redis-cli (``-a``) and mongo (``-p``).

Everything else is left as it was, byte for byte. A URL whose password holds a quote, a space,
``?`` or ``#`` must percent-encode it (RFC 3986 requires it) for the URL form to be recognised;
passed as a storage option, any value is removed. ``redact`` is idempotent.

Standard library only: the audit writer process loads this file without the package.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, quote_plus, unquote, unquote_plus

__all__ = [
    "REDACTED",
    "Redactor",
    "command_secrets",
    "is_secret_name",
    "redact",
    "redact_command",
    "redact_json",
    "redact_options",
    "redact_url",
    "refuse_credentials_in_endpoint",
    "refuse_credentials_in_url",
    "safe_options",
    "secret_values",
    "url_secrets",
]

REDACTED = "***"
_MIN_SECRET = 4  # shorter values are not searched for (they would match ordinary words)

# the last word of a name (split at -, _, . and camelCase) says whether its value is a credential
_SECRET_WORDS = frozenset(
    {
        "auth",
        "authorization",
        "code",
        "cookie",
        "credential",
        "credentials",
        "hdnts",  # Akamai's token (hdnts=exp=...~acl=...~hmac=...)
        "hmac",
        "key",
        "pass",
        "passwd",
        "passphrase",
        "password",
        "pw",
        "pwd",
        "sas",
        "secret",
        "session",
        "sessionid",
        "sig",
        "sign",  # Tencent's and Qiniu's CDN signatures (the review of 2026-12-06)
        "signature",
        "token",
        "jwt",
    }
)
_SECRET_NAMES = frozenset(
    {"awsaccesskeyid", "connection_string", "connectionstring", "apikey", "accountkey", "sastoken",
     "session_id", "session-id", "jsessionid", "phpsessid"}
)  # fmt: skip
# names that end in a secret's word and are data: webdataset's sample key field (a sample's repr
# in a message, "__key__=img_42": hidden since names may start with "_"; the review of that fix)
_DATA_NAMES = frozenset({"__key__"})
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")
_SENSITIVE_ENV = re.compile(
    r"(^|_)(SECRET|TOKEN|CREDENTIALS?|SAS)(_|$)|PASSWORD|PASSWD|_PWD$|^SSHPASS$|"
    # (PGPASSWORD, MYSQL_PWD, SSHPASS, AZURE_STORAGE_KEY, B2_APPLICATION_KEY: review, 2026-12-06)
    r"ACCESS_KEY|ACCOUNT_KEY|API_KEY|STORAGE_KEY|APPLICATION_KEY|CONNECTION_STRING|SECRET_KEY",
    re.I,
)
_NOT_SECRET = re.compile(r"(?i)^(true|false|none|null|yes|no|on|off|[0-9.]+)$")

# a URL: a scheme, then anything up to whitespace, a quote or an angle bracket
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*")
# a URL given as a parameter of another (?next=https://...): right after =, ?, & or #
_INNER_URL = re.compile(r"(?<=[=?&#])[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*")
# a percent-encoded URL, pair or userinfo inside a value (%3A%2F%2F, %3D, %40), encoded once or more
_ENCODED_INNER = re.compile(r"(?i)%(?:25)*(?:3a%(?:25)*2f%(?:25)*2f|3d|40)")
_NESTING = 3  # how deep URLs inside URLs, and encodings of encodings, are followed
# name=value: the value runs to the next &, ;, comma, whitespace, quote or closing bracket. Not
# after a /: that is a path segment (below)
_PAIR = re.compile(r"(?<![\w/-])([A-Za-z_][\w.-]*)=(?![bBrRuU]{1,2}['\"])([^&;,\s'\"<>)\]}]+)")
# a path segment shaped like a pair: mostly data (a Hive partition, .../zip_code=94110/...,
# whose redaction made different shards look like one), sometimes a token a CDN puts in the path
# (.../bcdn_token=...&expires=.../): its value ends at the next /, and only a name that can only
# be a credential is redacted (not ..._code or ..._key, which name data as often)
_PATH_PAIR = re.compile(r"(?<=/)([A-Za-z_][\w.-]*)=([^/&;,\s'\"<>)\]}]+)")
_PATH_SECRET_WORDS = frozenset(
    {"auth", "authorization", "credential", "credentials", "passwd", "password", "pwd", "sas",
     "secret", "sig", "signature", "token"}
)  # fmt: skip
_PATH_SECRET_ENDS = (
    "access_key",
    "accesskey",
    "api_key",
    "apikey",
    "secret_key",
    "account_key",
    "accountkey",
    "private_key",
    "privatekey",
    "secretkey",
    "authkey",
)
_QUOTED_PAIR = re.compile(r"([\"'])([A-Za-z_][\w.-]*)\1(\s*:\s*)([\"'])((?:(?!\4).)*)\4")
# name='value' and name="value": a keyword argument in a repr (S3FileSystem(secret='...'),
# token="..."): _PAIR's value cannot start with a quote (found by review, 2026-12-06)
_KWARG_PAIR = re.compile(r"(?<![\w/-])([A-Za-z_][\w.-]*)(\s*=\s*[bBrRuU]{0,2})([\"'])((?:(?!\3).)+)\3")
# a header in plain text (an HTTP library's message): X-Api-Key: value. Only hyphenated names,
# so that prose ("missing key: img_42") stays as it is
_HEADER = re.compile(
    r"(?i)(?<![\w-])([A-Za-z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)+)(\s*:\s*)"
    r"([\"']?(?:(?:bearer|basic|token)\s+)?)(?!\*\*\*)([^\s\"',;]{4,})"
)
# the last words that make a header or a keyword argument a credential's: fewer than
# is_secret_name's, whose code, pass, sign and session name data as often in prose and reprs
# (zip-code: 94110, first-pass: 0.2, x-ms-error-code: ...; the review of 2026-12-06)
_HEADER_WORDS = frozenset(
    {"auth", "authorization", "cookie", "credential", "credentials", "jwt", "passphrase", "passwd",
     "password", "pw", "pwd", "secret", "signature", "token"}
)  # fmt: skip
# a header name ending in "key" is a credential's when another of its words says so
# (X-Api-Key, Ocp-Apim-Subscription-Key), not a sort-key or a cache-key
_KEY_HEADER_WORDS = frozenset(
    {"api", "apim", "access", "secret", "auth", "subscription", "private", "account", "master",
     "client", "encryption", "storage", "app", "application", "function", "functions", "sse"}
)  # fmt: skip
_BEARER = re.compile(
    r"(?i)\b(bearer\s+|authorization:\s*(?:(?:basic|digest|bearer)\s+)?)"
    r"(?!(?:basic|digest|bearer)\b)(?!\*\*\*)([^\s'\",]{4,})"
)


def is_secret_name(name: str) -> bool:
    """Whether a storage option, query parameter or field called ``name`` holds a credential."""
    lowered = name.lower()
    if lowered in _DATA_NAMES:
        return False
    if lowered in _SECRET_NAMES or lowered.endswith(_PATH_SECRET_ENDS):
        # (?accesskey=: one word, where the path form was redacted: the review of 2026-12-06)
        return True
    words = _WORDS.findall(name)
    # a numbered one too: gsutil's decryption_key1 .. decryption_key100 (found by review)
    return bool(words) and words[-1].lower().rstrip("0123456789") in _SECRET_WORDS


def _userinfo(url: str) -> tuple[int, int, int] | None:
    """Where the userinfo of ``url`` (a ``scheme://...`` string) starts, where its password starts
    (at the start, for a user-only token) and where it ends (its ``@``).

    The authority runs to the first ``?`` or ``#`` (not the first ``/``: ``s3://KEY:SECRET@bucket``
    keys may hold one) and the userinfo to its last ``@``. A ``user:...`` part counts when the
    user has no ``/``; a part without ``:`` only when it has no ``/`` (a path's ``@`` is not one).
    """
    start = url.index("://") + 3
    end = len(url)
    for stop in "?#":
        at = url.find(stop, start)
        if at != -1:
            end = min(end, at)
    at = url.rfind("@", start, end)
    if at == -1:
        return None
    info = url[start:at]
    user, colon, _ = info.partition(":")
    if "/" in user or (not colon and "/" in info):
        return None
    if not colon and url[: start - 3].lower() in _CONTAINER_USERINFO:
        # abfs://container@account.dfs.core.windows.net/...: adlfs's own form, whose "user" is
        # the container: it was hidden as a token, and the audit log refused the URL (found
        # 2026-12-06)
        return None
    return start, start + len(user) + 1 if colon else start, at


#: Schemes whose URLs name a container before the ``@`` (adlfs: ``abfs://container@account...``).
_CONTAINER_USERINFO = frozenset({"az", "abfs", "abfss", "adl"})


def _redact_url_token(url: str, depth: int = 0) -> str:
    found = _userinfo(url)
    if found is not None:
        _, password, at = found
        url = url[:password] + REDACTED + url[at:]
    # a URL given as a parameter of this one (a redirect's ?url=https://user:password@host/...)
    # has its own userinfo, after the outer's ? (found by review, 2026-12-06)
    inner = _INNER_URL.search(url, url.index("://") + 3) if depth < _NESTING else None
    if inner is not None:
        url = url[: inner.start()] + _redact_url_token(inner.group(0), depth + 1) + url[inner.end() :]
    return url


def _urls(text: str) -> list[str]:
    """The URLs in ``text`` and those given as their parameters (``?url=https://...``)."""
    found = []
    for m in _URL.finditer(text):
        url = m.group(0)
        for _ in range(_NESTING + 1):
            found.append(url)
            inner = _INNER_URL.search(url, url.index("://") + 3)
            if inner is None:
                break
            url = inner.group(0)
    return found


def _pairs(text: str, depth: int = 0) -> list[tuple[str, str]]:
    """The ``name=value`` pairs of ``text``, and those inside a value that holds more
    (``?next=https://h/x?token=...``: one pair to ``_PAIR``)."""
    found = []
    for m in _PAIR.finditer(text):
        found.append((m.group(1), m.group(2)))
        if depth < _NESTING and not is_secret_name(m.group(1)) and "=" in m.group(2):
            found += _pairs(m.group(2), depth + 1)
    return found


def _pair(match: re.Match[str], depth: int = 0) -> str:
    name, value = match.groups()
    if is_secret_name(name):
        return f"{name}={REDACTED}"
    if depth < _NESTING and "=" in value:  # pairs inside the value: a URL as a parameter (_pairs)
        return f"{name}={_PAIR.sub(lambda m: _pair(m, depth + 1), value)}"
    return match.group(0)


def _is_path_secret_name(name: str) -> bool:
    """Whether a path segment ``name=value`` holds a credential (see ``_PATH_PAIR``)."""
    lowered = name.lower()
    if lowered in _SECRET_NAMES or lowered.endswith(_PATH_SECRET_ENDS):
        return True
    words = _WORDS.findall(name)
    return bool(words) and words[-1].lower() in _PATH_SECRET_WORDS


def _path_secret(name: str, value: str) -> bool:
    """Whether a path segment ``name=value`` is a credential: its name says so and its value is
    shaped like one (10 or more characters, not only digits). A Hive partition of a dataset,
    ``.../max_token=512/``, ``sig=high``, ``auth=public``, is data: hidden, such partitions shared
    one ``url`` (the review of 2026-12-06); a CDN's path token is long and random."""
    if not _is_path_secret_name(name) or value.isdigit():
        return False
    # or shorter, with upper and lower case letters and digits: a random token, where a
    # partition's value (bpe32k) is a word (the review of the rule)
    mixed = all(any(test(c) for c in value) for test in (str.isupper, str.islower, str.isdigit))
    return len(value) >= 10 or (len(value) >= 6 and mixed)


def _path_pair(match: re.Match[str]) -> str:
    name, value = match.groups()
    return f"{name}={REDACTED}" if _path_secret(name, value) else match.group(0)


def _kwarg_pair(match: re.Match[str]) -> str:
    # not a bare key='...' nor group_key=: a stage's repr names its key field so (Sifter(key='id'));
    # a credential's keyword is secret=, token=, password=, api_key= (_is_secret_header)
    name, equals, quote_, _ = match.groups()
    if not _is_secret_header(name):
        return match.group(0)
    return f"{name}{equals}{quote_}{REDACTED}{quote_}"


def _is_secret_header(name: str) -> bool:
    """Whether a header or a keyword argument called ``name`` holds a credential: its last word
    is one of ``_HEADER_WORDS``, or ``key`` with a word that says whose (X-Api-Key, account_key)."""
    words = [w.lower().rstrip("0123456789") for w in _WORDS.findall(name)]
    if not words:
        return False
    if words[-1] == "key":
        return any(w in _KEY_HEADER_WORDS for w in words[:-1])
    return words[-1] in _HEADER_WORDS or name.lower() in _SECRET_NAMES


def _header(match: re.Match[str]) -> str:
    name, colon, scheme, _ = match.groups()
    if not _is_secret_header(name):
        return match.group(0)
    at = match.start()
    if at and match.string[at - 1] == "/" and not colon[1:].strip(":") and colon == colon.strip():
        # a path segment, s3://b/x/auth-token:1/..., is data (no space after its colon, as a
        # header would have in a message); the review of 2026-12-06
        return match.group(0)
    return f"{name}{colon}{scheme or ''}{REDACTED}"


def _quoted_pair(match: re.Match[str]) -> str:
    quote_, name, colon, vquote, _ = match.groups()
    if not is_secret_name(name):
        return match.group(0)
    return f"{quote_}{name}{quote_}{colon}{vquote}{REDACTED}{vquote}"


def _forms(secret: str) -> set[str]:
    """``secret`` as it may appear: raw and percent-encoded (twice too: a URL inside another's
    parameter, itself encoded)."""
    once = quote(secret, safe="")
    return {secret, once, quote_plus(secret, safe=""), quote(secret), quote(once, safe="")}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without credentials: every one of ``secrets`` and every credential-shaped part
    (URL passwords, credential query parameters and ``name=value`` pairs, bearer tokens) is
    replaced by ``***``; the rest is unchanged. See the module's docstring for the shapes."""
    if not isinstance(text, str):
        text = str(text)
    if "%" in text:  # URLs percent-encoded inside text (a redirect's ?url=https%3A%2F%2F...)
        secrets = [*secrets, *_nested_secrets(text)]
    for secret in sorted(
        {f for s in secrets if len(s) >= _MIN_SECRET and s.strip("*") for f in _forms(s)},
        key=len,
        reverse=True,
    ):
        if secret in text:
            text = text.replace(secret, REDACTED)
    if PIPE in text:
        text = _PIPE_COMMAND.sub(lambda m: m.group(1) + _redact_flags(m.group(2)), text)
    if "://" in text:
        text = _URL.sub(lambda m: _redact_url_token(m.group(0)), text)
    if "=" in text:  # (before _PAIR, which stops at a quote: a bytes literal's b'...')
        text = _KWARG_PAIR.sub(_kwarg_pair, text)
    text = _PAIR.sub(_pair, text)
    if "/" in text:
        text = _PATH_PAIR.sub(_path_pair, text)
    text = _QUOTED_PAIR.sub(_quoted_pair, text)
    if ":" in text:
        text = _HEADER.sub(_header, text)
    return _BEARER.sub(rf"\1{REDACTED}", text)


def redact_url(url: str) -> str:
    """``url`` without credentials (``redact`` with no extra secrets: one function for all)."""
    return redact(url)


PIPE = "pipe:"

# credential shapes in a shell command, beyond the URLs that ``redact`` already handles:
# NAME=value for a credential-like NAME, the value of -u/--user and of any --flag naming a secret
# (--password, --token, --s3-secret-access-key, --sse-c-key, ...), and the value of a credential
# header
_SECRET_WORD = (
    r"(?:secret|token|password|passwd|pwd|passphrase|pass-phrase|credential|signature|access[_-]?key"
    r"|account[_-]?key|api[_-]?key|auth|sas|session)"
)
_VALUE = r"(\"[^\"]*\"|'[^']*'|[^\s;&|]+)"
# --<word>-pass flags that take no value (a program's passes, not a password)
_NO_VALUE_PASS = r"(?:no|one|two|single|multi|first|second|skip|dry|by)"
# --<name>-key flags whose value is data, not a credential (a table's, a queue's, a cache's key)
_DATA_KEY = (
    r"(?:sort|partition|hash|range|row|routing|shard|group|message-group|dedup|deduplication"
    r"|idempotency|cache|index|lookup|join|foreign|order|cluster|distribution|public|object|s3)"
)
# a flag naming a key or a password: --key, --sse-c-key, --decryption-keys, --sse_c_key,
# --s3-sse-customer-key-base64, --sftp-key-pem, --ftp-pass (found by review, 2026-12-05), but
# the keys that name data
_KEY_FLAG = (
    rf"--(?!{_DATA_KEY}[-_]keys?\b|{_NO_VALUE_PASS}-pass\b)(?:[\w-]*[-_])?(?:key|decryption-keys|pass)"
    r"(?:[-_](?:base64|b64|pem))?\b"
    # camelCase (--encryptionKey, --sseCustomerKey), but data's (--sortKey: _DATA_KEY's words)
    rf"|(?-i:--(?!(?i:{_DATA_KEY})Key\b)[a-z][A-Za-z]*Key)\b"
    # ffmpeg's single-dash decryption keys, mc's customer key
    r"|-(?:cenc_)?decryption_key|--enc-c"
)
# a flag's value: not another flag, a URL or an absolute path, which follow a flag that takes no
# value (curl --anyauth URL, rclone --s3-env-auth remote:path): taken for its value, the shard's
# URL was hidden, also in the command's quoted error output (found by review, 2026-12-05)
# (A secret may start with '/': a base64 key may. So only a flag named auth or session, which
# often takes no value (--anyauth, --keep-session-cookies), has no path for its value either.)
_KEY_VALUE = rf"(?![A-Za-z][\w+.-]*://|-|[A-Za-z][\w-]*:[\w.-]*/){_VALUE}"
_AUTH_VALUE = rf"(?![A-Za-z][\w+.-]*://|/|-|[A-Za-z][\w-]*:[\w.-]*/){_VALUE}"
# the words of _SECRET_WORD that may name a flag that takes no value (curl --anyauth)
_MAYBE_VALUELESS = r"(?:auth|session)"
_COMMAND_SECRETS = (
    # a cookie header's value (every cookie in it, to the quote or the line's end)
    re.compile(r"(?i)((?:set-)?cookie\s*:\s*)([^\"'\n]+)"),
    # (each lookahead below first checks, once per word, that the word ends as the pattern needs:
    # a long word of repeated secret words took seconds otherwise; the review of 2026-12-06)
    re.compile(rf"(?i)(\b(?=[A-Z0-9_]*+(?:=|-[A-Z0-9_]*+=))[A-Z0-9_]*{_SECRET_WORD}[A-Z0-9_]*=){_VALUE}"),
    # sshpass -e's SSHPASS=, and other *_PASS variables (found by review, 2026-12-06)
    re.compile(rf"(\b(?:SSHPASS|[A-Z0-9_]*_PASS)=){_VALUE}"),
    # the value of a flag naming a secret (--password, --s3-secret-access-key), one named auth or
    # session, and a key's (_KEY_FLAG): never a URL, remote:path or flag, which follow flags that
    # take no value; for auth and session not a path either (_AUTH_VALUE)
    re.compile(
        rf"(?i)((?:^|\s)--(?=[\w-]*+(?:\s|=))(?![\w-]*{_MAYBE_VALUELESS})[\w-]*{_SECRET_WORD}[\w-]*(?:\s+|=))"
        rf"{_KEY_VALUE}"
    ),
    re.compile(rf"(?i)((?:^|\s)--[\w-]*{_MAYBE_VALUELESS}[\w-]*(?:\s+|=)){_AUTH_VALUE}"),
    re.compile(rf"(?i)((?:^|\s)(?:{_KEY_FLAG})(?:\s+|=)){_KEY_VALUE}"),
    # a user's credentials (curl -u user:password, --proxy-user), whatever they look like
    re.compile(rf"(?i)((?:^|\s)(?:-u|--user|--proxy-user)(?:\s+|=)){_VALUE}"),
    # openssl's -pass/-passin/-passout pass:PASSWORD (env:, file:, fd: name where it is), and
    # sshpass -p PASSWORD
    re.compile(r"((?:^|\s)-pass(?:in|out)?\s+pass:)(\S+)"),
    re.compile(r"((?:^|[\s/])sshpass\s+-p\s*)(\S+)"),
    re.compile(
        # (from a word's start only: from every position, a long word took seconds; the review
        # of 2026-12-06)
        rf"(?i)(?<![\w-])(?=[\w-]*+\s*:)((?:authorization|[\w-]*{_SECRET_WORD}[\w-]*|[\w-]*-key)\s*:\s*"
        rf"(?:bearer\s+|basic\s+|token\s+)?)([^\s\"']+)"
    ),
)


def redact_command(command: str) -> str:
    """A shell command fit to show: URLs' passwords and signatures, credential-like environment
    assignments (``AWS_SECRET_ACCESS_KEY=...``), the values of ``-u``/``--user`` and of flags
    that name a secret (``--password``, ``--token``, ``--s3-secret-access-key``, ...), of
    credential headers (``Authorization:``, ``X-Api-Key:``, ``...-Token:``) and of secret
    environment variables are ``***``."""
    return redact(_redact_flags(command), secret_values())


def command_secrets(command: str) -> set[str]:
    """The values ``redact_command`` hides in ``command`` (and those of the URLs in it), unquoted
    too: what the command's own output (its standard error, quoted in an error) must not show."""
    found = set(url_secrets(command))
    # (not a bare --key's value: in a command it names data as often, an object's key, which an
    # error must still show; the command line hides it anyway. -b's only in curl's command)
    matches = [m for pattern in _COMMAND_SECRETS for m in pattern.finditer(command)]
    for m in matches + _tool_matches(command):
        flag = m.group(1).strip().lower().rstrip("=")
        if flag == "--key":
            continue
        value = m.group(2).strip("'\"")
        found.add(value)
        if flag in ("-u", "--user", "--proxy-user") and ":" in value:
            found.add(value.partition(":")[2])  # user:password: the password alone too
    return {v for v in found if len(v) >= _MIN_SECRET and v != REDACTED and not _NOT_SECRET.match(v)}


# flags that name a secret to one program only: curl's cookie (-b is tar's blocking factor, cut's
# bytes) and its client certificate's password (-E/--cert FILE:PASSWORD; -E is grep's too), and
# openssl's -k PASSWORD and -K KEY (curl's -k takes no value)
_CURL_COOKIE = re.compile(rf"(?i)((?:^|\s)(?:-b|--cookie)(?:\s+|=)){_VALUE}")
_CERT_FLAG = r"(?:^|\s)(?:-E|--cert|--proxy-cert)(?:\s+|=)"
_CURL_CERTS = (  # FILE:PASSWORD, unquoted or quoted (a password may hold spaces)
    re.compile(rf"({_CERT_FLAG}[^\s:\"']+:)([^\s\"']+)"),
    re.compile(rf"({_CERT_FLAG}\"[^\":]+:)([^\"]+)"),
    re.compile(rf"({_CERT_FLAG}'[^':]+:)([^']+)"),
)
# the program's name as a word: also inside a quoted `sh -c "curl ..."` or a $(...)
# curl -ubob:PASSWORD (the value attached: -u VALUE is _COMMAND_SECRETS'), and a proxy's
# user:PASSWORD@ with no scheme (-x, --proxy): found by review, 2026-12-06
_CURL_USER = re.compile(r"((?:^|\s)-u)([^\s\"'=:-][^\s\"':]*:[^\s\"']+)")
_CURL_PROXY = re.compile(
    r"((?:^|\s)(?:-x|--proxy)(?:\s+|=)(?:[A-Za-z][\w+.-]*://)?[^\s:@/\"']+:)([^\s@\"']+)(?=@)"
)
_CURL = re.compile(r"(?:^|[\s/;&|(\"'`])curl(?:\s|$)")
_OPENSSL_KEY = re.compile(rf"((?:^|\s)-[kK](?:\s+)){_KEY_VALUE}")
_OPENSSL = re.compile(r"(?:^|[\s/;&|(\"'`])openssl(?:\s|$)")


def _program(*names: str) -> re.Pattern[str]:
    """A program's name as a word of a command (also inside a quoted ``sh -c "..."``)."""
    return re.compile(rf"(?:^|[\s/;&|(\"'`])(?:{'|'.join(names)})(?:\s|$)")


# passwords that only one family of programs takes in a short flag (found by review, 2026-12-06):
# mysql -pPASSWORD (attached: -p DB prompts and names a database), 7z/rar -pPASSWORD, zip/unzip -P
# PASSWORD, redis-cli -a PASSWORD, mongo -p PASSWORD (smbclient -U user%PASSWORD is -u's)
_ATTACHED_P = re.compile(r"((?:^|\s)[\"']?-p)(\"[^\"]*\"|'[^']*'|[^\s\"'-][^\s\"']*)")  # -pPW, -p'PW', '-pPW'
_PROGRAM_SECRETS = (
    (_program("mysql", "mysqldump", "mysqlimport", "mysqladmin", "mariadb", "mariadb-dump"), (_ATTACHED_P,)),
    (_program("7z", "7za", "7zr", "7zz", "7zzs", "rar", "unrar"), (_ATTACHED_P,)),
    (_program("zip", "unzip", "funzip", "zipcloak"), (re.compile(rf"((?:^|\s)[\"']?-P(?:\s+|=)?){_VALUE}"),)),
    (_program("redis-cli"), (re.compile(rf"((?:^|\s)-a(?:\s+)){_VALUE}"),)),
    (
        _program("mongo", "mongosh", "mongodump", "mongorestore", "mongoexport", "mongoimport"),
        (re.compile(rf"((?:^|\s)[\"']?-p(?:\s+|=)?){_KEY_VALUE}"),),
    ),
)


# a pipeline's or a command list's parts, each run by its own program: split at |, ||, |&, &,
# &&, ; and newlines outside quotes (a quoted cookie header holds ;; a double-quoted one may hold
# an escaped quote), not at the & or | of a redirection (2>&1, >&2, &>file, <&3, >|file: found by
# review, 2026-12-05, which split `curl -s 2>&1 -b SID=...` from its cookie)
_SEGMENT = re.compile(r"(\"(?:[^\"\\]|\\.)*\"?|'[^']*'?)|(\|\||&&|(?<!>)\|&?|(?<![<>])&(?!>)|;|\n)")


def _segments(command: str) -> list[str]:
    """``command`` cut into its commands and the separators between them ("".join gives it back)."""
    parts, start = [], 0
    for m in _SEGMENT.finditer(command):
        if m.group(2):
            parts += [command[start : m.start()], m.group(2)]
            start = m.end()
    return [*parts, command[start:]]


def _tool_secrets(segment: str) -> list[re.Pattern[str]]:
    """The patterns of the program-specific secret flags that apply to ``segment``, one command of
    a pipeline (see ``_CURL_COOKIE``)."""
    found = []
    if "--cookie" in segment or _CURL.search(segment):
        found += [_CURL_COOKIE, *_CURL_CERTS, _CURL_USER, _CURL_PROXY]
    if _OPENSSL.search(segment):
        found.append(_OPENSSL_KEY)
    for program, patterns in _PROGRAM_SECRETS:
        if program.search(segment):
            found += patterns
    return found


def _tool_matches(command: str) -> list[re.Match[str]]:
    """The program-specific secret flags of each command of ``command`` (``_tool_secrets``)."""
    return [
        m
        for segment in _segments(command)
        for pattern in _tool_secrets(segment)
        for m in pattern.finditer(segment)
    ]


def _redact_flags(command: str) -> str:
    for pattern in _COMMAND_SECRETS:
        command = pattern.sub(rf"\1{REDACTED}", command)
    parts = _segments(command)
    for i, segment in enumerate(parts):
        for pattern in _tool_secrets(segment):
            segment = pattern.sub(rf"\1{REDACTED}", segment)
        parts[i] = segment
    return "".join(parts)


# a webdataset ``pipe:`` URL inside a text: its command may quote, so it runs to the end of the
# line (flag-shaped words after it in the same line are redacted too: safe, if eager)
_PIPE_COMMAND = re.compile(r"(pipe:)([^\n]*)")


def url_secrets(text: str) -> set[str]:
    """The credentials written into the URLs in ``text`` (passwords, credential parameters),
    raw and decoded, so that they are also found where they appear without their URL; also
    those of URLs percent-encoded inside its values (``_nested_secrets``)."""
    found = url_secrets_direct(text)
    if "%" in text:
        found |= _nested_secrets(text)
    return found


def url_secrets_direct(text: str) -> set[str]:
    """``url_secrets`` without decoding values: what ``text`` itself holds."""
    found: set[str] = set()
    for url in _urls(text):
        info = _userinfo(url)
        if info is not None:
            password = url[info[1] : info[2]]
            if password and password != REDACTED:
                found |= {password, unquote(password)}
                # and each /-separated piece: s3://KEY:ab/cd@bucket is read as the bucket
                # "KEY:ab", which the store's error quotes (found by review, 2026-12-06)
                found |= set(password.split("/"))
    for name, value in _pairs(text):
        if is_secret_name(name) and value != REDACTED:
            found |= {value, unquote(value), unquote_plus(value)}
    for m in _PATH_PAIR.finditer(text):
        if _path_secret(m.group(1), m.group(2)) and m.group(2) != REDACTED:
            found |= {m.group(2), unquote(m.group(2)), unquote_plus(m.group(2))}
    return {s for s in found if len(s) >= _MIN_SECRET and s.strip("*")}


def _nested_secrets(text: str, depth: int = 0) -> set[str]:
    """The credentials of URLs, pairs and userinfos percent-encoded inside the values of
    ``text`` (``?url=https%3A%2F%2Fuser%3Apassword%40host...``, ``%3Ftoken%3D...``, also encoded
    twice), decoded: ``_forms`` finds them encoded again (found by review, 2026-12-06). Only a
    value that holds an encoded ``://``, ``=`` or ``@`` is decoded, and only that value: a
    ``%20`` elsewhere must not cut a pair's value short into a word of the text."""
    found: set[str] = set()
    if depth >= _NESTING:
        return found
    values = [value for _, value in _pairs(text)]
    if depth:
        values.append(text)  # a value decoded once, itself still encoded
    for value in values:
        if _ENCODED_INNER.search(value):
            decoded = unquote(value)
            found |= url_secrets_direct(decoded)
            found |= _nested_secrets(decoded, depth + 1)
    return found


def _option_secrets(options: Any, parent_sensitive: bool = False) -> set[str]:
    found: set[str] = set()
    if isinstance(options, Mapping):
        for name, value in options.items():
            found |= _option_secrets(value, parent_sensitive or is_secret_name(str(name)))
    elif isinstance(options, list | tuple):
        if _secret_pair(options):  # headers as (name, value) pairs: ("Authorization", "Bearer ...")
            return _option_secrets(options[1], True)
        for value in options:
            found |= _option_secrets(value, parent_sensitive)
    elif isinstance(options, str | bytes):
        text = options.decode(errors="replace") if isinstance(options, bytes) else options
        if parent_sensitive and len(text) >= _MIN_SECRET:
            found.add(text)
        # credentials inside any value: an endpoint_url with a password, a connection string
        found |= url_secrets(text)
    return found


def _env_secrets() -> set[str]:
    return {
        v
        for k, v in os.environ.items()
        if _SENSITIVE_ENV.search(k) and len(v) >= _MIN_SECRET and not _NOT_SECRET.match(v)
    }


class Redactor:
    """``redact`` with the credentials of ``storage_options`` and the environment."""

    def __init__(self, storage_options: Mapping[str, Any] | None, *urls: str) -> None:
        self._secrets = _option_secrets(storage_options or {})
        for url in urls:
            self._secrets |= url_secrets(url)

    def __call__(self, text: str) -> str:
        return redact(text, self._secrets | _env_secrets())


def _secret_pair(value: Any) -> bool:
    """A ``(name, value)`` tuple whose name is a credential's (headers given as pairs; not a list:
    ``["token", "read"]`` is a list of words more often)."""
    return type(value) is tuple and len(value) == 2 and isinstance(value[0], str) and is_secret_name(value[0])


def _shown(value: Any) -> Any:
    """A storage option's value fit for a repr (see ``redact_options``)."""
    if isinstance(value, Mapping):
        return redact_options(value)
    if isinstance(value, str):
        return redact(value)
    if type(value) in (list, tuple):
        if _secret_pair(value):
            return type(value)((value[0], REDACTED))
        return type(value)(_shown(v) for v in value)
    return value


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of storage options fit for a repr: values of credential-like names are ``***``,
    and so are the values of ``(name, value)`` pairs of such names in lists and tuples (headers
    given as pairs); other strings are ``redact``-ed (an ``endpoint_url`` with a password, say)."""
    return {name: REDACTED if is_secret_name(str(name)) else _shown(value) for name, value in options.items()}


def secret_values(storage_options: Mapping[str, Any] | None = None, *urls: str) -> list[str]:
    """Values that must never be shown: credential-like storage options and environment
    variables, and the credentials written into ``urls``; longest first."""
    found = _option_secrets(storage_options or {}) | _env_secrets()
    for url in urls:
        found |= url_secrets(url)
    return sorted(found, key=len, reverse=True)


def redact_json(value: Any, secrets: Iterable[str] = ()) -> Any:
    """``value`` (parsed JSON) with every string in it ``redact``-ed."""
    secrets = list(secrets)
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, Mapping):
        return {k: redact_json(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(v, secrets) for v in value]
    return value


#: Storage options fit to show (an alias kept for the audit log's reprs).
safe_options = redact_options


#: Object stores whose fsspec filesystems do not read credentials from a URL: s3fs takes
#: ``s3://KEY:SECRET@bucket`` for a bucket named ``KEY:SECRET`` and names it in its errors.
_NO_URL_CREDENTIALS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def _store_credentials(link: str) -> bool:
    """Whether an object-store URL carries credentials: a userinfo before its ``@``, or a
    credential in its query. Not its path, which is only the object's key: a Hive-style
    ``.../token=bpe32k/...`` segment is data (the review of 2026-12-06: shards there were refused
    once shard URLs were checked)."""
    if _userinfo(link) is not None:
        return True
    query = link.partition("?")[2].partition("#")[0]
    return bool(query) and bool(url_secrets(query))


def refuse_credentials_in_endpoint(
    url: str, storage_options: Mapping[str, Any] | None, error: type[Exception] | None = None
) -> None:
    """Raise ``error`` (default ``AuditError``) for an ``s3://`` URL whose storage options give an
    ``endpoint_url`` with a password in it: botocore signs every request and aiohttp refuses a
    URL's credentials beside the signature ("Cannot combine AUTHORIZATION header"), which read as
    an outage, retried until the timeout and said "the storage did not answer" (found by review,
    2026-12-06). Credentials go in ``key=``/``secret=``."""
    if not any(link.partition("://")[0].lower() in ("s3", "s3a") for link in url.split("::")):
        return
    options = storage_options or {}
    client = options.get("client_kwargs")
    for where, endpoint in (
        ("endpoint_url", options.get("endpoint_url")),
        ("client_kwargs.endpoint_url", client.get("endpoint_url") if isinstance(client, Mapping) else None),
    ):
        if isinstance(endpoint, str) and "://" in endpoint and _userinfo(endpoint) is not None:
            from .errors import AuditError

            raise (error or AuditError)(
                f"the storage option {where} ({redact(endpoint, url_secrets(endpoint))}) holds "
                "credentials; s3:// requests are signed, and an endpoint's credentials cannot go "
                "with the signature: pass them as storage options key= and secret= (or the "
                "provider's standard environment or profile)"
            )


def refuse_credentials_in_url(url: str, error: type[Exception] | None = None) -> None:
    """Raise ``error`` (default ``AuditError``) for an object-store URL with credentials in it
    (they would reach error messages); say where credentials go instead."""
    # each link of a chained URL (simplecache::s3://...), and its query too (?token=...)
    for link in url.split("::"):
        protocol, sep, rest = link.partition("://")
        if sep and protocol.lower() in _NO_URL_CREDENTIALS and _store_credentials(link):
            # imported here: the audit writer process loads this module without the rest of the
            # package, and siftpipe.errors imports webdataset (and with it torch: 1.4 s, ~200 MiB)
            from .errors import AuditError

            raise (error or AuditError)(
                f"the URL {redact(url)} holds credentials; {protocol}:// URLs cannot carry them: pass "
                "them as storage options (e.g. key=, secret=, token=) or through the provider's "
                "standard environment or profile"
            )
