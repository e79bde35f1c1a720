"""Requests switchboard sends to a source system under a connection
(docs/write-back.md#where-requests-go).

The one way every source's client calls out: only to the connection's ``api_url``, with each
path segment that came from a payload checked first (``name_segment``, ``number_segment``),
TLS verified, a 10 s timeout, redirects followed only within the ``api_url`` (a repository
renamed answers 301 to its new path on the same host; anything else is refused), and never a
token in a log line. An answer is a ``SourceError`` unless it is a 2xx, classified once here so
the outbox retries what may pass later (network errors, 5xx, rate limits, with the wait the
source asked for) and gives up on the rest at once.
"""

import ipaddress
import logging
import re
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from email.utils import parsedate_to_datetime
from urllib.parse import quote, urljoin, urlsplit

import httpx
from django.conf import settings

log = logging.getLogger("switchboard.write_back")

REQUEST_TIMEOUT = timedelta(seconds=10)
MAX_REDIRECTS = 3
USER_AGENT = "switchboard-write-back"
# What of a source's error message is kept (the connection's and the write-back's last error).
MAX_ERROR_CHARS = 300

# An owner, repository, project or group name as the forges allow it: letters, digits, ".", "-"
# and "_" (".github" is a real repository name), never "." or "..".
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")


class SourceError(Exception):
    """A request that did not succeed. ``retryable``: it may pass later (a network error, a
    5xx, a rate limit), from ``retry_at`` when the source said when; otherwise it never will
    (any other 4xx, a refused redirect). ``status`` is the HTTP status, None without one.
    ``credentials_refused``: the source refused the connection's own credentials (a 401, or a
    source's word for one inside a 200, as Slack's ``invalid_auth``), which is the
    connection's error, not only this write-back's."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False,
                 retry_at: datetime | None = None, credentials_refused: bool = False):
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = retryable
        self.retry_at = retry_at
        self.credentials_refused = credentials_refused or status == 401


def check_api_url(url: str) -> str:
    """``url`` as a connection keeps it (no trailing slash), or ValueError: https with a host,
    no credentials, query or fragment. Plain http only to a loopback address, and only where
    the settings allow it (a local stand-in of the source in tests)."""
    parts = urlsplit((url or "").strip())
    if not parts.hostname or parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"api_url: not a plain https URL: {url[:100]!r}")
    if parts.scheme != "https" and not (parts.scheme == "http" and _is_loopback(parts.hostname)
                                        and settings.SWITCHBOARD_WRITE_BACK_LOOPBACK_HTTP):
        raise ValueError(f"api_url: must be https: {url[:100]!r}")
    return parts.geturl().rstrip("/")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def name_segment(value) -> str:
    """An owner or repository name taken from a payload, fit for a path; else SourceError
    (not retryable: the payload will not change)."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or value in (".", ".."):
        raise SourceError(f"not a name switchboard writes to: {str(value)[:60]!r}")
    return quote(value, safe="")


def number_segment(value) -> str:
    """An issue number or object id taken from a payload (a positive integer), for a path."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise SourceError(f"not an id switchboard writes to: {str(value)[:60]!r}")
    return str(value)


def web_root(api_url: str, api_path: str) -> str:
    """The web pages' root of a source whose API is at ``api_url``: the same host, without the
    API's own path (``/api/v4`` on GitLab, ``/api/v1`` on Gitea), kept where the source is
    served under a path of its own (``https://host/gitlab/api/v4``)."""
    parts = urlsplit(api_url)
    root = parts.path.rstrip("/").removesuffix(api_path)
    return f"{parts.scheme}://{parts.netloc}{root}"


# A commit's id as git writes it: 40 hex digits (SHA-1), or 64 in a SHA-256 repository.
_COMMIT_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def commit_segment(value) -> str:
    """A commit sha taken from a payload (a pull request's head), for a path or a body."""
    if not isinstance(value, str) or not _COMMIT_RE.fullmatch(value):
        raise SourceError(f"not a commit switchboard writes to: {str(value)[:70]!r}")
    return value


@dataclass(frozen=True)
class Answer:
    status: int
    body: object  # the parsed JSON, or None


_client = None
_client_lock = threading.Lock()


def _http() -> httpx.Client:
    # One client per process: its connection pool saves a TLS handshake per write-back.
    global _client
    with _client_lock:
        if _client is None:
            _client = httpx.Client(timeout=REQUEST_TIMEOUT.total_seconds(),
                                   follow_redirects=False, verify=True,
                                   headers={"User-Agent": USER_AGENT})
        return _client


def send(api_url: str, method: str, path: str, *, token: str, headers=None, json=None,
         form=None, now: datetime | None = None, auth_scheme: str = "Bearer",
         read_errors=None) -> Answer:
    """``method`` ``api_url + path`` with ``token`` in ``Authorization: <auth_scheme> <token>``
    (Gitea's tokens go as ``token``; ``auth_scheme=""``: the token alone, as Linear takes an
    API key) and a JSON body (``json``) or a form body (``form``, a dict). ``path`` starts
    with "/" and is built from ``name_segment``/``number_segment`` values only ("" for a
    GraphQL API's one endpoint). Returns the answer of a 2xx; raises SourceError for anything
    else. ``now`` dates a rate limit's ``retry_at``.
    ``read_errors(response, now)``, when given, reads the source's own errors from every
    answer (a GraphQL API reports them in the body, even beside a 200): a SourceError to
    raise, or None to go on as above."""
    base = check_api_url(api_url)
    url = base + path
    request_headers = {**(headers or {}),
                       "Authorization": f"{auth_scheme} {token}" if auth_scheme else token}
    for _ in range(MAX_REDIRECTS + 1):
        try:
            response = _http().request(method, url, headers=request_headers, json=json,
                                       data=form)
        except httpx.HTTPError as exc:
            # The exception's text names the URL at most, never a header.
            log.info("write-back request failed", extra={"method": method, "path": path,
                                                         "error": type(exc).__name__})
            raise SourceError(f"{type(exc).__name__}: {printable(str(exc))}",
                              retryable=True) from None
        log.info("write-back request", extra={"method": method, "path": path,
                                              "status": response.status_code})
        if response.is_redirect:
            url = _same_origin_redirect(base, url, response)
            continue
        if read_errors is not None:
            refused = read_errors(response, now or datetime.now(dt_timezone.utc))
            if refused is not None:
                raise refused
        if response.is_success:
            return Answer(response.status_code, json_of(response))
        raise classify(response, now=now)
    raise SourceError(f"more than {MAX_REDIRECTS} redirects", status=response.status_code)


def _same_origin_redirect(base: str, url: str, response) -> str:
    target = urljoin(url, response.headers.get("location", ""))
    wanted, got = urlsplit(base), urlsplit(target)
    if ((got.scheme, got.netloc) != (wanted.scheme, wanted.netloc)
            or not (got.path + "/").startswith(wanted.path.rstrip("/") + "/")):
        raise SourceError(f"redirect to {got.netloc or 'elsewhere'} refused: only "
                          f"{wanted.netloc}{wanted.path} is written to",
                          status=response.status_code)
    return target


def json_of(response):
    try:
        return response.json()
    except ValueError:
        return None


def printable(text: str) -> str:
    text = " ".join(str(text).split())
    return "".join(ch for ch in text if ch.isprintable())[:MAX_ERROR_CHARS]


def classify(response, *, now: datetime | None = None) -> SourceError:
    """What a non-2xx answer means for a retry: a 429, or a 403 that says it is a rate limit
    (``Retry-After``, or ``x-ratelimit-remaining: 0`` with ``x-ratelimit-reset``), waits
    until the source said; a 5xx (and 408) retries with backoff; any other status fails with
    the source's own message."""
    now = now or datetime.now(dt_timezone.utc)
    status = response.status_code
    body = json_of(response)
    # GitHub, GitLab and Gitea say it in "message"; Slack in "error" (its 429's "ratelimited").
    said = (body.get("message") or body.get("error")) if isinstance(body, dict) else None
    message = f"{status}: {printable(said or response.reason_phrase or 'error')}"
    headers = response.headers
    rate_limited = status == 429 or (status == 403 and (
        "retry-after" in headers or headers.get("x-ratelimit-remaining") == "0"))
    if rate_limited:
        return SourceError(message, status=status, retryable=True,
                           retry_at=retry_at(headers, now))
    if status >= 500 or status == 408:
        return SourceError(message, status=status, retryable=True)
    return SourceError(message, status=status)


def retry_at(headers, now: datetime) -> datetime | None:
    """When a rate-limited request may go again: ``Retry-After`` (seconds or an HTTP date),
    else ``x-ratelimit-reset`` (GitHub) or ``RateLimit-Reset`` (GitLab), both epoch seconds;
    None when none says. A source with reset headers of its own reads them after this
    (Linear's, in milliseconds)."""
    after = headers.get("retry-after", "").strip()
    if after.isdigit():
        return now + timedelta(seconds=int(after))
    if after:
        try:
            when = parsedate_to_datetime(after)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return when if when.tzinfo else when.replace(tzinfo=dt_timezone.utc)
    reset = (headers.get("x-ratelimit-reset") or headers.get("ratelimit-reset") or "").strip()
    if reset.isdigit():
        return datetime.fromtimestamp(int(reset), tz=dt_timezone.utc)
    return None
