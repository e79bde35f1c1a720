"""What both HTTP surfaces of ingest share (the hook, ``ingest.hook``, and the operator API,
``ingest.api``): ``Problem``, the JSON refusal either answers (``{"error": {"code",
"message"}}``), and the request steps either takes before it writes anything: the declared
size, the rate limit, the media type, strict JSON, the database-down answer.
"""

from django.conf import settings
from django.http import JsonResponse

from switchboard import health, json_input, ratelimit
from switchboard.http import plain

from .models import Outcome

# An unknown slug is quoted back in the 404, cut short: the path is the caller's to fill.
MAX_ECHOED_SLUG_CHARS = 64

# Refusals the delivery log records, by status, unless the Problem names its own outcome.
OUTCOME_FOR_STATUS = {400: Outcome.MALFORMED, 401: Outcome.BAD_SIGNATURE, 409: Outcome.REPLAY,
                      413: Outcome.TOO_LARGE, 415: Outcome.UNSUPPORTED_TYPE,
                      429: Outcome.RATE_LIMITED}


class Problem(Exception):
    """An answer other than success: HTTP status, machine code, human message."""

    def __init__(self, status: int, code: str, message: str, headers=None, *, outcome=None,
                 reason=None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        # For the delivery log: the outcome when the status alone does not say it, and the
        # reason when the message is not the line to keep.
        self.outcome = outcome or OUTCOME_FOR_STATUS.get(status, Outcome.MALFORMED)
        self.reason = reason or message

    def payload(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}

    def response(self) -> JsonResponse:
        answer = JsonResponse(self.payload(), status=self.status)
        for name, value in self.headers.items():
            answer[name] = value
        return answer

    def answer(self) -> plain.Answer:
        return plain.json_answer(self.status, self.payload(), self.headers)


# -- shared steps --------------------------------------------------------------------------------


def check_declared_length(declared: str | None) -> None:
    declared = declared or ""
    if declared.strip():
        try:
            length = int(declared)
        except ValueError:
            raise Problem(400, "bad_request", "Content-Length is not a number") from None
        if length > settings.SWITCHBOARD_MAX_BODY_BYTES:
            raise too_large()


def too_large() -> Problem:
    return Problem(413, "too_large",
                   f"body exceeds the {settings.SWITCHBOARD_MAX_BODY_BYTES}-byte limit")


def check_rate(scope: str) -> None:
    verdict = ratelimit.take_token("ingest", scope,
                                   per_minute=settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE)
    if not verdict.allowed:
        raise Problem(429, "rate_limited",
                      f"more than {settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE} requests a minute; "
                      f"retry in {verdict.retry_after_seconds} s",
                      headers={"Retry-After": str(verdict.retry_after_seconds)})


def media_type_of(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def is_json_type(media_type: str) -> bool:
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def parse_json_document(text: str, *, what: str = "body",
                         walk: bool = True) -> tuple[dict, bool]:
    """The JSON object in ``text`` (a Problem otherwise), and whether it is known storable:
    plainly (``json_input.is_plainly_storable``, no walk needed) or walked here, so the todos
    made of it never walk it again. ``walk=False``: the caller checks the fields itself,
    naming the one at fault (the second value then says only "plainly storable")."""
    # Strict JSON: NaN/Infinity and literals that overflow to inf (valid JSON such as 1e400,
    # which jsonb cannot store) are a 400 naming the problem, not a failed write later.
    try:
        value = json_input.loads_strict(text)
    except json_input.TooDeep as exc:
        raise Problem(400, "too_deep", f"{what}: {exc}") from None
    except ValueError as exc:
        # The decoder's messages give a position or name a number (cut to 40 characters);
        # they never quote the body beyond that.
        raise Problem(400, "malformed_body", f"{what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise Problem(400, "malformed_body", f"{what} must be a JSON object")
    plain = json_input.is_plainly_storable(text)
    if not plain and walk:  # else there is nothing for the walk to find (is_plainly_storable)
        # PostgreSQL's jsonb refuses NUL characters and lone surrogates that Python's json
        # accepts: a 400 here instead of a failed write. Walked once, here, for every route.
        reason = json_input.unstorable_reason(value)
        if reason is not None:
            raise Problem(400, "malformed_body", f"{what}: a JSON value {reason}")
        return value, True
    return value, plain


def decode_utf8(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise Problem(400, "malformed_body", "body is not UTF-8") from None


def storage_unavailable(exc, **context) -> plain.Answer:
    """The database failed: nothing was committed, so the sender should retry (every source
    retries on 5xx). Only the error's type is logged: a driver's message can quote row values,
    which here means the body."""
    health.note_database_unavailable(exc, route="ingest", **context)
    return plain.database_unavailable_answer(
        "could not store the delivery; nothing was kept, retry")


def one_line(value: str, limit: int) -> str:
    if not value.isprintable():  # else there is nothing to drop: skip the walk
        value = "".join(ch for ch in value if ch.isprintable())
    return value.strip()[:limit]
