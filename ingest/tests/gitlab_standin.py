"""A stand-in of GitLab's REST API (v4) for write-back tests, held to GitLab's own description.

GitLab publishes no machine-readable description of the endpoints switchboard calls (its
OpenAPI document covers a fraction of the API, and none of notes or award emoji), so each
request is checked against the resource definitions of ``python-gitlab`` (pinned in
requirements.txt): the path templates of its managers, the HTTP method each of their mixins
uses (create POST, update PUT, get and list GET), and the attributes each create or update
requires and allows. What those leave out is taken from GitLab's REST reference and cited where
it is used: ids are integers, the list filters of notes
(https://docs.gitlab.com/api/notes/#list-project-issue-notes), the answers' shapes
(https://docs.gitlab.com/api/notes/, https://docs.gitlab.com/api/emoji_reactions/,
https://docs.gitlab.com/api/users/#get-the-current-user), a repeated award's refusal, and the
bearer a token goes as (https://docs.gitlab.com/api/rest/authentication/). A request that
breaks a rule is answered as GitLab would (404, 400) and kept in ``problems``; the ``gitlab``
fixture fails the test when any was seen.
"""

import inspect
import re
from dataclasses import dataclass

from .standin_server import StandIn, import_pinned, template_pattern

PACKAGE = "python-gitlab==8.6.0"
# Pagination is every list's (https://docs.gitlab.com/api/rest/#pagination); notes are also
# listed by sort and order_by (https://docs.gitlab.com/api/notes/#list-project-issue-notes).
PAGINATION = frozenset({"page", "per_page"})
NOTE_LIST_FILTERS = frozenset({"sort", "order_by", "activity_filter"})


@dataclass(frozen=True)
class Operation:
    id: str  # "<Manager>.<verb>"
    method: str
    template: str
    pattern: re.Pattern
    required: frozenset  # attributes the body must carry
    allowed: frozenset  # attributes it may carry (None: no body)
    query: frozenset  # query parameters it takes


_operations = []


def operations() -> list[Operation]:
    """Every operation python-gitlab's v4 managers define, fixed templates first."""
    if _operations:
        return _operations
    objects, mixins = import_pinned(PACKAGE, "gitlab.v4.objects", "gitlab.mixins")
    found = []
    for name, manager in inspect.getmembers(objects, inspect.isclass):
        path = getattr(manager, "_path", None)
        if not name.endswith("Manager") or not isinstance(path, str):
            continue
        create = getattr(manager, "_create_attrs", None)
        update = getattr(manager, "_update_attrs", None)
        listing = frozenset(getattr(manager, "_list_filters", None) or ()) | PAGINATION
        if name.endswith("NoteManager"):
            listing |= NOTE_LIST_FILTERS

        def add(verb, method, template, attrs=None, query=frozenset()):
            required = frozenset(attrs.required) if attrs else frozenset()
            allowed = (required | frozenset(attrs.optional) | frozenset(attrs.exclusive)
                       if attrs else None)
            found.append(Operation(f"{name}.{verb}", method, template, template_pattern(template),
                                   required, allowed, query))

        if issubclass(manager, mixins.CreateMixin):
            add("create", "POST", path, create)
        if issubclass(manager, mixins.UpdateMixin):
            put = getattr(manager, "_update_method", None) != mixins.UpdateMethod.POST
            add("update", "PUT" if put else "POST", path + "/{id}", update)
        if issubclass(manager, mixins.GetMixin):
            add("get", "GET", path + "/{id}")
        if issubclass(manager, mixins.GetWithoutIdMixin):
            add("get", "GET", path)
        if issubclass(manager, mixins.ListMixin):
            add("list", "GET", path, query=listing)
        if issubclass(manager, mixins.DeleteMixin):
            add("delete", "DELETE", path + "/{id}")
    found.sort(key=lambda op: op.template.count("{"))
    _operations.extend(found)
    return _operations


class GitLabStandIn(StandIn):
    """GitLab's API under ``/api/v4`` on a loopback port: one token user (``token``,
    ``username``, ``user_id``, a project access token's bot), its notes and award emoji, each
    request in ``seen``, each broken rule in ``problems``."""

    def __init__(self):
        super().__init__(prefix="/api/v4")
        self.token = "glpat-standin0123456789abcd"
        self.username = "project_77_bot_switchboard"
        self.user_id = 9001
        self.notes = {}  # id -> {"on": (project, noun, iid), "answer": the note}
        self.awards = []  # {"on": (project, noun, iid, note), "name", "answer"}

    def fault_answer(self, fault):
        # GitLab words an error as "<status> <reason>" in "message".
        return fault.status, {"message": f"{fault.status} {fault.message}"}, fault.headers

    description = "python-gitlab's definitions"

    def operations(self):
        return operations()

    def request_problems(self, operation, values, seen) -> list[str]:
        problems = []
        for name, value in values.items():
            # Every id and iid in a path is an integer; a project may also be named by its
            # URL-encoded path (https://docs.gitlab.com/api/rest/#namespaced-paths).
            if name != "project_id" and not value.isdigit():
                problems.append(f"{operation.id}: {name} {value!r} is not an integer")
        problems += [f"{operation.id}: no query parameter {name!r}" for name in seen.query
                     if name not in operation.query]
        body = seen.body
        if operation.allowed is None:
            if body is not None:
                problems.append(f"{operation.id} takes no body")
        elif not isinstance(body, dict):
            problems.append(f"{operation.id} needs a JSON object")
        else:
            problems += [f"{operation.id}: {name} is missing" for name in operation.required
                         if not isinstance(body.get(name), str) or not body[name]]
            problems += [f"{operation.id}: no attribute {name!r}" for name in body
                         if name not in operation.allowed]
        return problems

    # -- what each operation does --------------------------------------------------------

    def answer(self, operation, values, seen) -> tuple[int, object]:
        authorization = seen.headers.get("authorization", "")
        if authorization != f"Bearer {self.token}" and seen.headers.get(
                "private-token") != self.token:
            return 401, {"message": "401 Unauthorized"}
        manager, _, verb = operation.id.partition(".")
        user = {"id": self.user_id, "username": self.username, "name": "switchboard",
                "state": "active", "bot": True}
        if operation.id == "CurrentUserManager.get":
            return 200, user
        noun = "merge_requests" if "MergeRequest" in manager else "issues"
        on = (values["project_id"], noun, int(values.get("issue_iid") or values["mr_iid"]))
        if manager.endswith("AwardEmojiManager") and verb == "create":
            awarded = (*on, int(values["note_id"]) if "note_id" in values else None)
            if any(a["on"] == awarded and a["name"] == seen.body["name"] for a in self.awards):
                # What GitLab answers a second award of one emoji by one user.
                return 404, {"message": "404 Award Emoji Name has already been taken Not Found"}
            answer = {"id": self.next_id(), "name": seen.body["name"], "user": user,
                      "awardable_id": awarded[3] or on[2],
                      "awardable_type": "Note" if awarded[3] else
                      ("MergeRequest" if noun == "merge_requests" else "Issue")}
            self.awards.append({"on": awarded, "name": seen.body["name"], "answer": answer})
            return 201, answer
        if manager.endswith("NoteManager") and verb == "create":
            note_id = self.next_id()
            answer = {"id": note_id, "body": seen.body["body"], "author": user, "system": False,
                      "noteable_iid": on[2], "created_at": "2026-01-01T00:00:00Z",
                      "updated_at": "2026-01-01T00:00:00Z"}
            self.notes[note_id] = {"on": on, "answer": answer}
            return 201, answer
        if manager.endswith("NoteManager") and verb == "update":
            note = self.notes.get(int(values["id"]))
            if note is None or note["on"] != on:
                return 404, {"message": "404 Not found"}
            note["answer"]["body"] = seen.body["body"]
            return 200, note["answer"]
        if manager.endswith("NoteManager") and verb == "list":
            listed = [n["answer"] for n in reversed(self.notes.values()) if n["on"] == on]
            return 200, listed[:int(seen.query.get("per_page", 20))]
        return 501, {"message": f"the stand-in does not serve {operation.id}"}

    def status_notes(self) -> list[dict]:
        return [note["answer"] for note in self.notes.values()]
