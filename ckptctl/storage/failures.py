"""Storage failures in words: every exception a storage call can raise becomes one
:class:`~ckptctl.errors.CkptError` with a one-line message (never a credential), and a
circuit breaker remembers servers that stopped answering.

>>> str(storage_error("s3://b/x", ConnectionRefusedError(), remote=True))
's3://b/x: remote unreachable (connection refused)'
"""
from __future__ import annotations

import errno
import os
import re
import threading

from ..errors import CkptError, NotFoundError, StorageError, UsageError, shorten

#: Error codes after which talking to the server again (to abort an upload) is pointless.
NO_SERVER = ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE")
CUT = "connection closed by the server"
#: what a refused or missing credential asks the user to set, per cloud
S3_CREDENTIALS = "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --storage-option key=/secret="
AZURE_CREDENTIALS = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
                     "AZURE_STORAGE_ACCOUNT_KEY (or -o account_name=... -o account_key=...)")
GCS_CREDENTIALS = ("set GOOGLE_APPLICATION_CREDENTIALS to a service-account JSON file "
                   "(or STORAGE_EMULATOR_HOST for an emulator, -o token=anon for a public "
                   "bucket)")
_dead: dict[str, tuple[float, str, str]] = {}  # server -> (monotonic deadline, message, code)
_dead_lock = threading.Lock()


def mark_dead(server: str, message: str, code: str, seconds: float) -> None:
    import time

    with _dead_lock:
        _dead[server] = (time.monotonic() + seconds, message, code)


def dead_server(server: str) -> tuple[str, str] | None:
    """(message, code) of the failure that marked ``server`` dead, while that holds."""
    import time

    with _dead_lock:
        hit = _dead.get(server)
        if hit is None:
            return None
        if time.monotonic() >= hit[0]:
            del _dead[server]
            return None
        return hit[1], hit[2]


def forget_dead_servers() -> None:
    """Clear the circuit breaker (tests; a long-running caller that knows better)."""
    with _dead_lock:
        _dead.clear()


_ERRNO_TEXT = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "is a directory",
    errno.ENOTDIR: "a parent is not a directory",
    errno.EFBIG: "file too large for the file system",
    errno.EMFILE: "too many open files",
    errno.ENAMETOOLONG: "file name too long",
    errno.EIO: "I/O error from the device",
    errno.ESTALE: "stale file handle (network file system)",
}


def _chain(e: BaseException) -> list[BaseException]:
    """``e``, its causes and contexts, and the ``error`` botocore wraps, outermost first."""
    out: list[BaseException] = []
    todo = [e]
    while todo and len(out) < 20:
        x = todo.pop(0)
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        kw = getattr(x, "kwargs", None)
        inner = kw.get("error") if isinstance(kw, dict) else None
        todo += [x.__cause__, x.__context__, inner if isinstance(inner, BaseException) else None,
                 getattr(x, "os_error", None)]
    return out


def _client_code(chain: list[BaseException]) -> str | None:
    for x in chain:
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            if code:
                return str(code)
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status:
                return f"HTTP {status}"
        if _from_obstore(x):  # S3's error document, quoted in obstore's message
            found = re.search(r"<Code>(\w+)</Code>", str(x))
            if found:
                return found.group(1)
    return None


def _from_obstore(e: BaseException) -> bool:
    """Raised by obstore (it raises its not-found as the builtin FileNotFoundError: told
    by its words)."""
    return type(e).__module__.startswith("obstore") or "Error performing " in str(e)


def _names(chain: list[BaseException]) -> set[str]:
    return {c.__name__ for x in chain for c in type(x).__mro__}


def storage_error(shown: str, e: BaseException, *, remote: bool = False,
                  budget: float | None = None, secrets: list[str] | None = None) -> CkptError:
    """The one-line error for a storage failure ``e`` at ``shown``: what happened, in words
    (never a bare exception class, never a credential).

    >>> import errno
    >>> str(storage_error("out/model.safetensors", OSError(errno.ENOSPC, "No space left")))
    'out/model.safetensors: no space left on device'
    >>> str(storage_error("s3://b/x", TimeoutError(), remote=True, budget=60))
    's3://b/x: timed out after 60 s (server not answering; see --timeout)'
    """
    chain = _chain(e)
    names = _names(chain)
    code = _client_code(chain) if remote else None
    after = f" after {budget:g} s" if budget else ""

    def bad(message: str, code_: str = "IO_ERROR", cls=StorageError, *,
            transient: bool = False) -> CkptError:
        err = cls(shown, scrub(message, secrets), code=code_)
        err.transient = transient  # retry.is_transient: worth trying again later?
        return err

    native = _native_failure(e, shown)
    if native is not None:
        message, code_, cls, transient = native
        if code_ == "REMOTE_TIMEOUT":
            message = f"timed out{after} (server not answering; see --timeout)"
        return bad(message, code_, cls, transient=transient)
    if code == "NoSuchBucket":
        return bad("no such bucket", "MISSING_FILE", NotFoundError)
    if code in ("NoSuchKey", "NoSuchUpload", "HTTP 404") or isinstance(e, FileNotFoundError):
        return bad("not found", "MISSING_FILE", NotFoundError)
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                "AllAccessDisabled", "AccountProblem", "InvalidToken", "HTTP 403") or (
            names & {"NoCredentialsError", "PartialCredentialsError",
                     "CredentialRetrievalError"}):
        what = {"InvalidAccessKeyId": "unknown access key",
                "SignatureDoesNotMatch": "wrong secret key",
                "ExpiredToken": "expired session token"}.get(code or "")
        if names & {"NoCredentialsError", "PartialCredentialsError"}:
            what = "no credentials"
        return bad(f"access denied ({what or code or 'check credentials'}; "
                   f"{credential_hint(shown)})")
    if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                "TooManyRequests", "HTTP 429"):
        return bad(f"server is throttling requests ({code}); still refused{after}, "
                   "retry later or raise --timeout", "REMOTE_TIMEOUT", transient=True)
    if code in ("RequestTimeout",):
        return bad(f"server timed out reading the request ({code})", "REMOTE_TIMEOUT",
                   transient=True)
    if code in ("InternalError", "ServiceUnavailable", "HTTP 500", "HTTP 502", "HTTP 503",
                "HTTP 504"):
        return bad(f"server error ({code})", transient=True)
    # before the timeouts: urllib3's NewConnectionError (a refused connection) is a
    # subclass of its ConnectTimeoutError
    if names & {"ConnectionRefusedError"} or any(
            getattr(x, "errno", None) == errno.ECONNREFUSED for x in chain):
        return bad("remote unreachable (connection refused)", "REMOTE_UNREACHABLE",
                   transient=True)
    if names & {"ReadTimeoutError", "ConnectTimeoutError", "TimeoutError", "FSTimeoutError",
                "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError"}:
        if "ConnectTimeoutError" in names:
            return bad(f"remote unreachable (connect timed out{after})", "REMOTE_UNREACHABLE",
                       transient=True)
        return bad(f"timed out{after} (server not answering; see --timeout)", "REMOTE_TIMEOUT",
                   transient=True)
    if names & {"gaierror", "ClientConnectorDNSError"}:
        return bad("remote unreachable (host name not found)", "REMOTE_UNREACHABLE")
    if names & {"EndpointConnectionError", "ClientConnectorError", "ProxyConnectionError"}:
        return bad("remote unreachable (could not connect)", "REMOTE_UNREACHABLE",
                   transient=True)
    if names & {"SSLError", "ClientSSLError", "SSLCertVerificationError"}:
        return bad("TLS error talking to the server (certificate or protocol)",
                   "REMOTE_UNREACHABLE")
    if names & {"ConnectionClosedError", "ServerDisconnectedError", "ConnectionResetError",
                "BrokenPipeError", "ClientPayloadError", "IncompleteRead",
                "IncompleteReadError", "ResponseStreamingError", "ClientOSError",
                "ConnectionAbortedError"}:
        return bad(f"remote unreachable ({CUT})", "REMOTE_UNREACHABLE",
                   transient=True)
    if code == "PreconditionFailed" or isinstance(e, FileExistsError):
        return bad("already exists", "ALREADY_EXISTS")
    if code:  # any other answer of the server: its code says what it refused
        return bad(f"refused by the server ({code})")
    if isinstance(e, OSError):
        if e.errno in _ERRNO_TEXT:
            return bad(_ERRNO_TEXT[e.errno])
        if isinstance(e, PermissionError):
            return bad("permission denied")
        if isinstance(e, IsADirectoryError):
            return bad("is a directory")
        text = e.strerror or (os.strerror(e.errno) if e.errno else "") or type(e).__name__
        return bad(f"I/O error: {text}")
    if isinstance(e, MemoryError):
        return bad("out of memory")
    for x in chain:  # s3fs hands unknown -o KEY=VALUE to its session at the first request
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(x))
        if isinstance(x, TypeError) and unknown:
            return UsageError(f"unknown storage option {unknown.group(1)!r} (S3: endpoint_url, "
                              "key, secret, token, profile, client_kwargs...)", shown)
    detail = shorten(scrub(str(e), secrets), 160)  # scrubbed first: no half a secret
    return bad(f"storage error ({type(e).__name__}{': ' + detail if detail else ''})")


def credential_hint(shown: str) -> str:
    """What to set when a server refuses the credentials, by the place's scheme.

    >>> credential_hint("az://c/run")[:36]
    'set AZURE_STORAGE_CONNECTION_STRING,'
    """
    if shown.startswith(("az://", "abfs://")):
        return AZURE_CREDENTIALS
    if shown.startswith(("gs://", "gcs://")):
        return GCS_CREDENTIALS
    return S3_CREDENTIALS


def _native_failure(e: BaseException, shown: str):
    """``(message, code, class, transient)`` for an obstore (Rust ``object_store``)
    error, told by its class and the kind its message reports; None for any other."""
    name, text = type(e).__name__, str(e)
    if not _from_obstore(e):
        return None
    # fake-gcs-server answers a missing bucket with 500 "no bucket named B" (GCS: 404
    # NoSuchBucket)
    if "ContainerNotFound" in text or "NoSuchBucket" in text or "no bucket named" in text:
        return "no such container" if "Container" in text else "no such bucket", \
            "MISSING_FILE", NotFoundError, False
    if shown.startswith("s3://") and re.search(r"<Code>\w+</Code>", text):
        return None  # S3's error code: told as botocore's are (storage_error)
    if name == "NotFoundError" or isinstance(e, FileNotFoundError):
        return "not found", "MISSING_FILE", NotFoundError, False
    if name in ("AlreadyExistsError", "PreconditionError"):
        return "already exists", "ALREADY_EXISTS", StorageError, False
    if name in ("PermissionDeniedError", "UnauthenticatedError") or re.search(
            r"status: 40[13]|AuthenticationFailed|AuthorizationFailure|Invalid Access Key",
            text):
        return (f"access denied ({credential_hint(shown)})", "IO_ERROR", StorageError, False)
    if "ConnectionRefused" in text or "Connection refused" in text:
        return ("remote unreachable (connection refused)", "REMOTE_UNREACHABLE",
                StorageError, True)
    if "kind: Connect" in text:
        return ("remote unreachable (could not connect)", "REMOTE_UNREACHABLE", StorageError,
                True)
    if "kind: Timeout" in text or "timed out" in text:
        return "timed out", "REMOTE_TIMEOUT", StorageError, True
    status = re.search(r"status: (\d{3})", text)
    if status and status.group(1).startswith("5") or "status: 429" in text:
        return (f"server error (HTTP {status.group(1)})", "IO_ERROR", StorageError, True)
    if status:
        return (f"refused by the server (HTTP {status.group(1)})", "IO_ERROR", StorageError,
                False)
    if "kind: Body" in text or "kind: Decode" in text or "connection closed" in text.lower():
        return f"remote unreachable ({CUT})", "REMOTE_UNREACHABLE", StorageError, True
    return None


#: Secrets shorter than this are masked only where they stand alone as a token: a key
#: ``a`` must not turn "unreachable" into "unre***ch***le". Longer ones are masked
#: wherever they appear (a credential glued to other text still never shows).
MIN_INNER_SECRET = 4
_ALNUM = r"[^\W_]"  # a letter or digit, any script


def _secret_pattern(secret: str) -> str:
    """A regex for ``secret`` as a whole token: no letter or digit may touch an edge of it
    that is itself a letter or digit (an edge such as ``/`` or ``=`` is a boundary)."""
    body = re.escape(secret)
    if re.match(_ALNUM, secret[0]):
        body = f"(?<!{_ALNUM})" + body
    if re.match(_ALNUM, secret[-1]):
        body += f"(?!{_ALNUM})"
    return body


def scrub(message: str, secrets: list[str] | None, mask: str = "***") -> str:
    """``message`` with every secret value replaced by ``mask``: whole-token occurrences of
    any secret, and every occurrence of one at least :data:`MIN_INNER_SECRET` characters
    long. Longest first, so a secret that contains another is masked whole.

    >>> scrub("remote unreachable (key a, secret=a)", ["a"])
    'remote unreachable (key ***, secret=***)'
    >>> scrub("signed by AKIA1234 for xAKIA1234y", ["AKIA1234"])
    'signed by *** for x***y'
    >>> scrub("nothing to hide", ["hunter2"])
    'nothing to hide'
    """
    for s in sorted({s for s in secrets or () if s}, key=len, reverse=True):
        if s not in message:
            continue
        if len(s) >= MIN_INNER_SECRET:
            message = message.replace(s, mask)
        else:
            message = re.sub(_secret_pattern(s), lambda _m: mask, message)
    return message


def error_code(e: BaseException) -> str | None:
    """The S3 error code (``NoSuchUpload``...) or ``HTTP <status>`` an exception carries,
    looking through its causes; None for anything else.

    >>> error_code(ValueError("x")) is None
    True
    """
    return _client_code(_chain(e))
