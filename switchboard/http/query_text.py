"""Query strings the database cannot hold are refused before any view runs.

Django admin's list filters and search (and any ``request.GET`` a view hands to the ORM) put
query parameters straight into SQL, and PostgreSQL refuses a NUL character in text: what
would be a 500 with a traceback is a 400 naming the parameter
(docs/security.md#bad-input-is-a-400-never-a-500). Views that read their own filters keep their own, more specific answers; this
is the floor under all of them. The hook and /mcp are not Django views and check their own
input.
"""

from django.http import JsonResponse
from django.utils.deprecation import MiddlewareMixin

from switchboard.json_input import unstorable_reason


def unstorable_parameter(query) -> str | None:
    """``"name reason"`` for the first query parameter (name or value) that cannot be stored,
    or None."""
    for name, values in query.lists():
        for text in (name, *values):
            reason = unstorable_reason(text)
            if reason:
                return f"query parameter {name!r} {reason}"
    return None


class UnstorableQueryMiddleware(MiddlewareMixin):
    # MiddlewareMixin: sync and async capable, so it adds no thread hop under ASGI.
    def process_request(self, request):
        problem = unstorable_parameter(request.GET)
        if problem:
            return JsonResponse({"error": {"code": "invalid_argument", "message": problem}},
                                status=400)
        return None
