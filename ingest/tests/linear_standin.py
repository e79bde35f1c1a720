"""A stand-in of Linear's GraphQL API for write-back tests, held to Linear's own schema.

Linear publishes no schema file in a package, but ``@linear/sdk`` ships the TypeScript types
its code generator wrote from that schema, one per GraphQL type (``dist/index-*.d.mts``): object
types carry ``__typename``, inputs do not, ``Maybe``/``InputMaybe`` mark what may be null, a
field's arguments are the ``<Type><Field>Args`` type, enums are ``declare enum``. ``schema()``
reads them back into a GraphQL schema (graphql-core), and every request the stand-in receives is
parsed, validated against it and has its variables coerced to the declared input types: so a
mutation, an input type or a field switchboard names must be Linear's, never merely what
switchboard means to send. An activity's ``content`` (a JSONObject to the schema) is held to
Linear's activity content payload: ``type`` one of the schema's ``AgentActivityType`` values,
``body`` for all but ``action``, which has ``action``, ``parameter`` and an optional
``result``. The token is checked as the SDK sends it: an API key (``lin_api_…``) bare in
``Authorization``, an OAuth access token after ``Bearer``.

A request that breaks a rule is answered with GraphQL errors and kept in ``problems``; the
``linear`` fixture fails the test when any was seen. The package is found under ``var/npm``,
installed on first use at the pinned version below (github_standin.npm_file).
"""

import re
from datetime import datetime, timezone as dt_timezone
from functools import lru_cache
from types import SimpleNamespace

import graphql
from graphql.execution.values import get_variable_values

from ingest.actors import dict_of

from .github_standin import NPM_PREFIX, npm_file
from .standin_server import Seen, StandIn

# The version the tests were written against: a newer schema may add or rename.
SDK_PACKAGE = "@linear/sdk@98.0.0"
SDK_DIST = NPM_PREFIX / "node_modules/@linear/sdk/dist"
API_KEY = "lin_api_standin0123456789abcdefghijklmnopqrstuv"
OAUTH_TOKEN = "lin_oauth_standin0123456789abcdefghijklmnopqrstuv"

# -- Linear's schema, read back from the SDK's generated types ---------------------------------

_BUILT_IN_SCALARS = {"ID", "String", "Boolean", "Int", "Float"}
_TYPE_START = re.compile(r"^type (\w+) = (.*)$")
_ENUM_START = re.compile(r"^declare enum (\w+) \{$")
_ENUM_VALUE = re.compile(r'^\s+\w+ = "([^"]+)",$')
_FIELD = re.compile(r"^  (\w+)(\??): (.+);$")
_UNION = re.compile(r"^(\w+(?: \| \w+)+);$")
_FRAGMENT_START = re.compile(r"^type \w+Fragment = ")


def _sdk_types_file():
    # The d.mts whose name carries a build hash: the one that holds the generated documents.
    npm_file(SDK_DIST / "index.mjs", packages=(SDK_PACKAGE,))
    for path in sorted(SDK_DIST.glob("index-*.d.mts")):
        return path
    raise LookupError(f"{SDK_PACKAGE} ships no generated types under {SDK_DIST}")


def _ts_type(text: str, *, nullable_words=("Maybe", "InputMaybe")) -> str | None:
    """A field's TypeScript type as GraphQL type notation, or None when it is not one the
    generator writes for a schema field (a literal, an inline object)."""
    text = text.strip()
    for word in nullable_words:
        if text.startswith(f"{word}<") and text.endswith(">"):
            inner = _ts_type(text[len(word) + 1:-1])
            return inner.removesuffix("!") if inner else None
    if text.startswith("Array<") and text.endswith(">"):
        inner = _ts_type(text[len("Array<"):-1])
        return f"[{inner}]!" if inner else None
    scalar = re.fullmatch(r'Scalars\["(\w+)"\]', text)
    if scalar:
        return f"{scalar.group(1)}!"
    return f"{text}!" if re.fullmatch(r"\w+", text) else None


def _read_declarations(lines):
    """(records, enums, unions, scalars) of the schema part of the SDK's types."""
    records, enums, unions, scalars = {}, {}, {}, set()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if line.startswith("//#endregion") or _FRAGMENT_START.match(line):
            break  # the schema's types end: the SDK's own fragments and operations follow
        enum = _ENUM_START.match(line)
        if enum:
            values = []
            while not lines[index].startswith("}"):
                value = _ENUM_VALUE.match(lines[index])
                if value:
                    values.append(value.group(1))
                index += 1
            enums[enum.group(1)] = values
            continue
        start = _TYPE_START.match(line)
        if not start:
            continue
        name, rest = start.groups()
        union = _UNION.match(rest)
        if union:
            unions[name] = union.group(1).split(" | ")
            continue
        block = re.fullmatch(r"((?:\w+ & )*)\{", rest)
        if not block:
            continue  # fragments, operations and helpers: Pick<…>, Exact<…>
        body = []
        while lines[index] != "};":
            body.append(lines[index])
            index += 1
        index += 1
        if name == "Scalars":
            scalars = {m.group(1) for m in map(_FIELD.match, body) if m} - _BUILT_IN_SCALARS
            continue
        if any(b.strip() == "} & {" or b.startswith("}") for b in body):
            continue  # an operation's result type, not a schema type
        fields, typename = {}, False
        for entry in body:
            found = _FIELD.match(entry)
            if not found:
                continue
            field_name, _, ts = found.groups()
            if field_name == "__typename":
                typename = True
                continue
            graphql_type = _ts_type(ts)
            if graphql_type:
                fields[field_name] = graphql_type
        records[name] = {"fields": fields, "object": typename,
                         "interfaces": [part for part in block.group(1).split(" & ") if part]}
    return records, enums, unions, scalars


def _all_interfaces(records, name) -> list[str]:
    found = []
    for parent in records.get(name, {}).get("interfaces", []):
        if parent not in found:
            found.append(parent)
        for grand in _all_interfaces(records, parent):
            if grand not in found:
                found.append(grand)
    return found


def _sdl(records, enums, unions, scalars) -> str:
    interfaces = {parent for record in records.values() for parent in record["interfaces"]}
    args = {}
    for name, record in records.items():
        if record["object"] or name in interfaces:
            for field_name in record["fields"]:
                args_name = f"{name}{field_name[0].upper()}{field_name[1:]}Args"
                if args_name in records and not records[args_name]["object"]:
                    args[(name, field_name)] = records[args_name]["fields"]
    argument_types = {f"{owner}{field_name[0].upper()}{field_name[1:]}Args"
                      for owner, field_name in args}
    parts = [f"scalar {name}" for name in sorted(scalars)]
    parts += [f"enum {name} {{ {' '.join(values)} }}" for name, values in enums.items() if values]
    parts += [f"union {name} = {' | '.join(members)}" for name, members in unions.items()]

    def fields_of(name):
        merged = {}
        for parent in reversed(_all_interfaces(records, name)):
            merged.update(records[parent]["fields"])
        merged.update(records[name]["fields"])
        lines = []
        for field_name, graphql_type in merged.items():
            declared = args.get((name, field_name))
            if declared:
                joined = ", ".join(f"{arg}: {kind}" for arg, kind in declared.items())
                lines.append(f"  {field_name}({joined}): {graphql_type}")
            else:
                lines.append(f"  {field_name}: {graphql_type}")
        return "\n".join(lines)

    for name, record in records.items():
        if not record["fields"] and not record["interfaces"]:
            continue
        if name in interfaces:
            implements = _all_interfaces(records, name)
            joined = f" implements {' & '.join(implements)}" if implements else ""
            parts.append(f"interface {name}{joined} {{\n{fields_of(name)}\n}}")
        elif record["object"]:
            implements = _all_interfaces(records, name)
            joined = f" implements {' & '.join(implements)}" if implements else ""
            parts.append(f"type {name}{joined} {{\n{fields_of(name)}\n}}")
        elif name not in argument_types:
            parts.append(f"input {name} {{\n{fields_of(name)}\n}}")
    parts.append("schema { query: Query mutation: Mutation }")
    return "\n\n".join(parts)


@lru_cache(maxsize=1)
def schema() -> graphql.GraphQLSchema:
    """Linear's GraphQL schema as ``@linear/sdk`` ships it."""
    lines = _sdk_types_file().read_text().splitlines()
    return graphql.build_schema(_sdl(*_read_declarations(lines)), assume_valid=True)


def activity_types() -> list[str]:
    return list(schema().get_type("AgentActivityType").values)


def payload_problems(type_name: str, payload: dict, path: str = "") -> list[str]:
    """Keys of a webhook ``payload`` that Linear's ``type_name`` (a webhook payload type of the
    schema: ``AgentSessionEventWebhookPayload``, ``CommentWebhookPayload``…) does not have, and
    non-null fields it lacks, recursively through nested payload objects."""
    kind = schema().get_type(type_name)
    problems = []
    for key, value in payload.items():
        if key not in kind.fields:
            problems.append(f"{path}{key}: not a field of {type_name}")
            continue
        declared = graphql.get_named_type(kind.fields[key].type)
        if isinstance(value, dict) and isinstance(declared, graphql.GraphQLObjectType):
            problems += payload_problems(declared.name, value, f"{path}{key}.")
    problems += [f"{path}{name}: {type_name} requires it" for name, field_def in kind.fields.items()
                 if graphql.is_non_null_type(field_def.type) and name not in payload]
    return problems


def content_problems(content) -> list[str]:
    """An activity's content against Linear's activity content payload."""
    if not isinstance(content, dict):
        return ["content is not an object"]
    kind = content.get("type")
    if kind not in activity_types():
        return [f"content type {kind!r} is none of {activity_types()}"]
    wanted = ({"type", "action", "parameter"}, {"result"}) if kind == "action" else (
        {"type", "body"}, set())
    problems = [f"content.{key} is missing" for key in wanted[0] if key not in content]
    problems += [f"content.{key} is not {kind}'s" for key in content
                 if key not in wanted[0] | wanted[1]]
    problems += [f"content.{key} is not a string" for key, value in content.items()
                 if not isinstance(value, str)]
    return problems


# -- the stand-in --------------------------------------------------------------------------------

# Linear's one endpoint: every request is a POST of a GraphQL document to it.
GRAPHQL_ENDPOINT = SimpleNamespace(id="graphql")


def error_answer(message: str, *, code: str, kind: str, user_message: str = "") -> dict:
    """A GraphQL error as Linear words one: ``extensions.type`` is what @linear/sdk classifies
    by (``ratelimited``, ``authentication error``, ``invalid input``…), with its ``code``."""
    return {"message": message, "extensions": {
        "type": kind, "code": code, "userError": kind == "invalid input",
        "userPresentableMessage": user_message or message}}


class LinearStandIn(StandIn):
    """Linear's GraphQL API on a loopback port (``api_url`` ends in ``/graphql``). One app user
    (``viewer_id``) that the API key and the OAuth token both act as; issues, agent sessions,
    comments, reactions and activities it was asked for; each request in ``seen`` (its root
    field in ``operation``, ``{"query", "variables"}`` in ``body``), each broken rule in
    ``problems``."""

    def __init__(self):
        super().__init__()
        self.viewer_id = "5b0c8f1e-7d3a-4c57-9a0e-0123456789ab"
        self.viewer_name = "switchboard"
        self.issues = {}  # id -> {"identifier": …}
        self.sessions = {}  # id -> issue id
        self.comments = {}  # id -> {"issueId", "body", "userId"}
        self.reactions = []  # {"issueId"|"commentId", "emoji", "id"}
        self.activities = {}  # id -> {"agentSessionId", "content", "ephemeral"}

    @property
    def api_url(self) -> str:
        return f"{super().api_url}/graphql"

    def requests_to(self, operation: str) -> list[Seen]:
        """The requests of a root field that Linear answered without an error."""
        return [seen for seen in super().requests_to(operation)
                if not dict_of(seen.answer).get("errors")]

    def fault_answer(self, fault):
        # With a code, Linear's GraphQL error of that code (RATELIMITED, AUTHENTICATION_ERROR).
        body = ({"errors": [error_answer(fault.message, code=fault.code, kind={
            "RATELIMITED": "ratelimited", "AUTHENTICATION_ERROR": "authentication error",
        }.get(fault.code, "invalid input"))]} if fault.code
            else {"errors": [{"message": fault.message}]})
        return fault.status, body, fault.headers

    # -- how Linear takes a request ------------------------------------------------------------

    description = "Linear's schema"

    def load(self) -> None:
        schema()  # read the schema before the first request

    def find_operation(self, method: str, api_path: str):
        # One endpoint, POST /graphql; the root field asked for is named by request_problems.
        return (GRAPHQL_ENDPOINT, {}) if (method, api_path) == ("POST", "/graphql") else None

    def unknown_answer(self):
        return 404, {"errors": [{"message": "Not Found"}]}

    def invalid_answer(self, problems):
        return 400, {"errors": [{"message": problem} for problem in problems]}

    def request_problems(self, operation, values, seen) -> list[str]:
        """The request against Linear's schema: a JSON GraphQL request that parses, validates,
        names one root field per operation (kept in ``seen.operation``), and whose variables
        coerce to the declared input types."""
        content_type = seen.headers.get("content-type", "")
        if not content_type.startswith("application/json"):
            return [f"Content-Type {content_type!r}"]
        body = dict_of(seen.body)
        if not isinstance(body.get("query"), str) or not isinstance(body.get("variables", {}),
                                                                    (dict, type(None))):
            return ["the body is not a GraphQL request"]
        try:
            document = graphql.parse(body["query"])
        except graphql.GraphQLError as error:
            return [f"query does not parse: {error.message}"]
        errors = graphql.validate(schema(), document)
        if errors:
            return [f"not Linear's schema: {error.message}" for error in errors]
        operations = [d for d in document.definitions
                      if isinstance(d, graphql.OperationDefinitionNode)]
        if len(operations) != 1:
            return ["one operation per request"]
        fields = [s.name.value for s in operations[0].selection_set.selections
                  if isinstance(s, graphql.FieldNode)]
        seen.operation = fields[0] if fields else ""
        coerced = get_variable_values(schema(), operations[0].variable_definitions or [],
                                      body.get("variables") or {})
        if isinstance(coerced, list):
            return [f"variables: {error.message}" for error in coerced]
        return []

    def answer(self, operation, values, seen) -> tuple[int, object]:
        if not self._authorized(seen.headers.get("authorization", "")):
            return 400, {"errors": [error_answer(
                "Authentication required, not authenticated", code="AUTHENTICATION_ERROR",
                kind="authentication error")]}
        result = graphql.execute(schema(), graphql.parse(seen.body["query"]),
                                 root_value=self.root(),
                                 variable_values=seen.body.get("variables") or {})
        answer = {"data": result.data}
        if result.errors:
            answer["errors"] = [{"message": e.message, "path": e.path,
                                 "extensions": e.extensions or {}} for e in result.errors]
        return 200, answer

    def _authorized(self, authorization: str) -> bool:
        # As @linear/sdk sends them: an API key bare, an OAuth access token after "Bearer ".
        if authorization == API_KEY or authorization == f"Bearer {OAUTH_TOKEN}":
            return True
        if authorization in (f"Bearer {API_KEY}", OAUTH_TOKEN):
            self.problems.append("Authorization: an API key goes bare, an OAuth token after "
                                 "Bearer")
        return False

    # -- what the tests set up and read --------------------------------------------------------

    def add_issue(self, identifier: str = "ENG-42") -> str:
        issue_id = self._uuid()
        self.issues[issue_id] = {"identifier": identifier}
        return issue_id

    def add_session(self, issue_id: str) -> str:
        session_id = self._uuid()
        self.sessions[session_id] = issue_id
        return session_id

    def activities_of(self, session_id: str) -> list[dict]:
        return [a for a in self.activities.values() if a["agentSessionId"] == session_id]

    def comments_on(self, issue_id: str) -> list[dict]:
        return [c for c in self.comments.values() if c["issueId"] == issue_id]

    def _uuid(self) -> str:
        return f"00000000-0000-4000-8000-{self.next_id():012d}"

    # -- what each root field does -------------------------------------------------------------

    def root(self) -> dict:
        """The root value graphql-core executes a request against: each root field switchboard
        may ask for, as Linear answers it; a GraphQLError is Linear's error for it."""

        def created(kind, entity_id, store, make):
            if entity_id is not None and not _is_uuid4(entity_id):
                raise _invalid(f"id must be a UUID v4: {entity_id!r}")
            if entity_id in store:
                raise _invalid(f"{kind} with id {entity_id} already exists")
            entity_id = entity_id or self._uuid()
            store[entity_id] = make(entity_id)
            return entity_id

        def agent_activity_create(info, input):
            problems = content_problems(input["content"])
            if problems:
                self.problems.extend(problems)
                raise _invalid("; ".join(problems))
            if input["agentSessionId"] not in self.sessions:
                raise _not_found("AgentSession")
            activity_id = created("AgentActivity", input.get("id"), self.activities, lambda _: {
                "agentSessionId": input["agentSessionId"], "content": input["content"],
                "ephemeral": bool(input.get("ephemeral")), "userId": self.viewer_id})
            return {"success": True, "lastSyncId": 1.0,
                    "agentActivity": self._activity(activity_id)}

        def agent_activity(info, id):
            if id not in self.activities:
                raise _not_found("AgentActivity")
            return self._activity(id)

        def comment_create(info, input):
            if input.get("issueId") not in self.issues:
                raise _not_found("Issue")
            comment_id = created("Comment", input.get("id"), self.comments, lambda _: {
                "issueId": input["issueId"], "body": input.get("body") or "",
                "userId": self.viewer_id})
            return {"success": True, "lastSyncId": 1.0, "comment": self._comment(comment_id)}

        def comment_update(info, id, input):
            if id not in self.comments:
                raise _not_found("Comment")
            if "body" in input:
                self.comments[id]["body"] = input["body"]
            return {"success": True, "lastSyncId": 1.0, "comment": self._comment(id)}

        def comment(info, id=None, **others):
            if id not in self.comments:
                raise _not_found("Comment")
            return self._comment(id)

        def reaction_create(info, input):
            subject = input.get("commentId") or input.get("issueId")
            if subject not in self.comments and subject not in self.issues:
                raise _not_found("Comment" if input.get("commentId") else "Issue")
            reaction = {"id": self._uuid(), "emoji": input["emoji"], "subject": subject}
            self.reactions.append(reaction)
            return {"success": True, "lastSyncId": 1.0,
                    "reaction": {"id": reaction["id"], "emoji": reaction["emoji"]}}

        viewer = {"__typename": "User", "id": self.viewer_id, "name": self.viewer_name,
                  "displayName": self.viewer_name, "app": True}
        return {"viewer": viewer, "agentActivityCreate": agent_activity_create,
                "agentActivity": agent_activity, "commentCreate": comment_create,
                "commentUpdate": comment_update, "comment": comment,
                "reactionCreate": reaction_create}

    def _activity(self, activity_id) -> dict:
        activity = self.activities[activity_id]
        content = dict(activity["content"])
        typename = f"AgentActivity{content.pop('type').capitalize()}Content"
        return {"__typename": "AgentActivity", "id": activity_id,
                "content": {"__typename": typename, **content},
                "ephemeral": activity["ephemeral"],
                "agentSession": {"__typename": "AgentSession", "id": activity["agentSessionId"]}}

    def _comment(self, comment_id) -> dict:
        comment = self.comments[comment_id]
        return {"__typename": "Comment", "id": comment_id, "body": comment["body"],
                "user": {"__typename": "User", "id": comment["userId"]}}


def _is_uuid4(value) -> bool:
    return isinstance(value, str) and re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value) is not None


def _invalid(message: str) -> graphql.GraphQLError:
    answer = error_answer(message, code="INVALID_INPUT", kind="invalid input")
    return graphql.GraphQLError(message, extensions=answer["extensions"])


def _not_found(kind: str) -> graphql.GraphQLError:
    # Linear's words for an id that names nothing (a deleted comment, say).
    answer = error_answer(f"Entity not found: {kind}", code="INVALID_INPUT", kind="invalid input",
                          user_message=f"Could not find referenced {kind}.")
    return graphql.GraphQLError(answer["message"], extensions=answer["extensions"])


def reset_in(seconds: int) -> str:
    """Linear's ``x-ratelimit-requests-reset``: when the window resets, in UTC epoch
    milliseconds."""
    return str(int((datetime.now(dt_timezone.utc).timestamp() + seconds) * 1000))
