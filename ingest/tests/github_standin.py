"""A stand-in of GitHub's REST API for write-back tests, held to GitHub's own description.

Every request it receives is checked against ``api.github.com.json`` of the npm package
``@octokit/openapi`` (method, path template, path parameters, request body schema), never
against what switchboard means to send; an App's JWT is checked as GitHub does (RS256 by the
App's key, ``iss`` the App id, ``exp`` at most 10 minutes after ``iat`` and ahead of now). A
request that breaks a rule is answered as GitHub would (404, 401, 422) and kept in
``problems``; the ``github`` fixture fails the test when any was seen. Answers start from the
description's own examples.

The package is found under ``var/npm`` (``npm install --prefix var/npm``; installed on first
use when npm is on the machine, at the pinned versions below). Without npm the tests that need
it are skipped, saying why.
"""

import copy
import fcntl
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from pathlib import Path

import jsonschema
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

# wait_for: the tests' poll, imported from here by them
from .standin_server import StandIn, template_pattern, wait_for  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
NPM_PREFIX = REPO / "var" / "npm"
# The versions the tests were written against: a newer description may add or rename.
OPENAPI_PACKAGE = "@octokit/openapi@23.0.2"
WEBHOOK_EXAMPLES_PACKAGE = "@octokit/webhooks-examples@7.6.1"
OPENAPI_FILE = NPM_PREFIX / "node_modules/@octokit/openapi/generated/api.github.com.json"
WEBHOOK_EXAMPLES_FILE = (NPM_PREFIX
                         / "node_modules/@octokit/webhooks-examples/api.github.com/index.json")
_DOC_URI = "urn:github:api.github.com.json"
# GitHub's own allowance for clocks: an iat up to a minute ahead of its clock.
JWT_CLOCK_SKEW = timedelta(seconds=60)
JWT_MAX_LIFETIME = timedelta(minutes=10)


def npm_file(path: Path, packages=(OPENAPI_PACKAGE, WEBHOOK_EXAMPLES_PACKAGE)) -> Path:
    """``path`` inside var/npm, installing the pinned ``packages`` once when it is missing (a
    file lock keeps parallel test workers from installing at the same time). Skips when npm is
    not on the machine, except under CI, which fails; fails when npm is there and the install
    fails."""
    if path.exists():
        return path
    npm = shutil.which("npm")
    if npm is None:
        # As for Chromium: CI must check requests against the provider's own description,
        # never skip it.
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must install npm to fetch {', '.join(packages)}")
        pytest.skip(f"no npm, so the provider's published description ({', '.join(packages)}) "
                    "cannot be fetched: `bash scripts/test` installs npm when run as root (CI "
                    "does, and fails without it)")
    NPM_PREFIX.mkdir(parents=True, exist_ok=True)
    with open(NPM_PREFIX / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(NPM_PREFIX),
                            *packages],
                           check=True, capture_output=True, timeout=300)
    return path


_loaded = {}


def openapi() -> dict:
    if "openapi" not in _loaded:
        _loaded["openapi"] = json.loads(npm_file(OPENAPI_FILE).read_text())
    return _loaded["openapi"]


def webhook_example(event: str, *, action: str | None = None, having=None) -> dict:
    """A copy of the first example payload of ``event`` (``action``; ``having``: a predicate it
    must satisfy) from ``@octokit/webhooks-examples``."""
    if "examples" not in _loaded:
        _loaded["examples"] = {entry["name"]: entry["examples"] for entry in
                               json.loads(npm_file(WEBHOOK_EXAMPLES_FILE).read_text())}
    for example in _loaded["examples"][event]:
        if (action is None or example.get("action") == action) and (having is None
                                                                    or having(example)):
            return copy.deepcopy(example)
    raise LookupError(f"no {event} example with action {action!r}")


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    pattern: re.Pattern
    operation: dict
    path_item: dict

    @property
    def id(self) -> str:
        return self.operation["operationId"]


_operations = []


def operations() -> list[Operation]:
    """Every operation of the description, its path template as a pattern (``{param}`` is one
    segment); fixed templates first, so ``/user`` never matches a ``/{param}`` of another."""
    if not _operations:
        found = []
        for template, item in openapi()["paths"].items():
            for method, operation in item.items():
                if method in ("get", "post", "patch", "put", "delete"):
                    found.append(Operation(method.upper(), template, template_pattern(template),
                                           operation, item))
        found.sort(key=lambda op: op.template.count("{"))
        _operations.extend(found)
    return _operations


def resolve(node):
    """A ``#/components/...`` reference of the description, followed."""
    while isinstance(node, dict) and "$ref" in node:
        target = openapi()
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        node = target
    return node


_registry = {}


def body_problems(operation: Operation, body) -> list[str]:
    """What is wrong with ``body`` for ``operation`` by its requestBody's JSON schema."""
    request_body = resolve(operation.operation.get("requestBody"))
    if request_body is None:
        return [] if body is None else [f"{operation.id} takes no body"]
    if body is None:
        return [f"{operation.id} needs a body"] if request_body.get("required") else []
    if "registry" not in _registry:
        _registry["registry"] = Registry().with_resource(
            _DOC_URI, Resource.from_contents(openapi(), default_specification=DRAFT4))
    # Validated through a reference into the document, so the schema's own references resolve.
    declared = operation.operation["requestBody"]
    if "$ref" in declared:
        where = declared["$ref"].removeprefix("#/")
    else:
        where = "/".join(part.replace("~", "~0").replace("/", "~1") for part in (
            "paths", operation.template, operation.method.lower(), "requestBody"))
    ref = {"$ref": f"{_DOC_URI}#/{where}/content/application~1json/schema"}
    validator = jsonschema.Draft4Validator(ref, registry=_registry["registry"])
    return [f"{operation.id} body: {error.message}" for error in validator.iter_errors(body)]


def schema_problems(pointer: str, value) -> list[str]:
    """``value`` against the schema at ``pointer`` in the description
    (``components/schemas/webhook-issue-comment-created/properties/comment``, …)."""
    if "registry" not in _registry:
        _registry["registry"] = Registry().with_resource(
            _DOC_URI, Resource.from_contents(openapi(), default_specification=DRAFT4))
    validator = jsonschema.Draft4Validator({"$ref": f"{_DOC_URI}#/{pointer}"},
                                           registry=_registry["registry"])
    # OpenAPI 3.0 spells "or null" as nullable, which JSON Schema draft 4 does not read.
    return [error.message for error in validator.iter_errors(value)
            if not (error.validator == "type" and error.instance is None)]


def app_object(standin) -> dict:
    """The stand-in's App as GitHub shows it in a payload's ``performed_via_github_app``: the
    description's own example of an App, with this one's id and slug."""
    operation = next(op for op in operations() if op.id == "apps/get-authenticated")
    app = response_example(operation, "200")
    app.update(id=standin.app_id, slug=standin.app_slug, name="switchboard test")
    return app


def path_problems(operation: Operation, values: dict) -> list[str]:
    """Path parameters against their schemas (an integer must be digits)."""
    problems = []
    declared = [resolve(p) for p in operation.path_item.get("parameters", [])
                + operation.operation.get("parameters", [])]
    for parameter in declared:
        if parameter.get("in") != "path":
            continue
        value = values.get(parameter["name"])
        if value is None:
            problems.append(f"{operation.id}: path parameter {parameter['name']} missing")
        elif parameter.get("schema", {}).get("type") == "integer" and not value.isdigit():
            problems.append(f"{operation.id}: {parameter['name']} {value!r} is not an integer")
    return problems


def query_problems(operation: Operation, query: dict) -> list[str]:
    """Query parameters the operation does not declare."""
    declared = {resolve(p)["name"] for p in operation.path_item.get("parameters", [])
                + operation.operation.get("parameters", []) if resolve(p).get("in") == "query"}
    return [f"{operation.id}: no query parameter {name!r}" for name in query
            if name not in declared]


def response_example(operation: Operation, status: str) -> dict:
    """The description's own example answer of ``operation`` for ``status``."""
    response = resolve(operation.operation["responses"][status])
    content = response.get("content", {}).get("application/json", {})
    examples = content.get("examples") or {}
    for example in examples.values():
        value = resolve(example).get("value")
        if isinstance(value, dict):
            return copy.deepcopy(value)
    return {}


# -- the stand-in --------------------------------------------------------------------------------


def make_app_key() -> tuple[str, object]:
    """A fresh RSA key: its PEM (what GitHub gives an App) and its public key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    return pem, key.public_key()


class GitHubStandIn(StandIn):
    """GitHub's REST API on a loopback port: ``api_url`` (optionally under a prefix, as GitHub
    Enterprise Server's ``/api/v3``). One App (``app_id``, ``app_slug``, ``app_pem``) and one
    token user (``token``, ``user_login``); comments and reactions it was asked for, each
    request in ``seen``, each broken rule in ``problems``. Check runs only for the App (GitHub
    refuses them to a token), kept as GitHub shows them."""

    def __init__(self, *, prefix: str = ""):
        super().__init__(prefix=prefix)
        self.app_id = 424242
        self.app_slug = "switchboard-test"
        self.app_pem, self._app_public_key = make_app_key()
        self.token = "ghp_standin0123456789abcdefghijklmnopqrs"
        self.user_login = "octo-operator"
        self.installation_tokens = {}  # token -> (installation id, expires_at)
        self.revoked_tokens = []  # tokens revoked with DELETE /installation/token
        self.comments = {}  # id -> {"issue": (owner, repo, number), "body": …}
        self.reactions = []  # (target, content)
        self.check_runs = {}  # id -> {"repo": (owner, repo), "answer": …}
        self.token_lifetime = timedelta(hours=1)

    description = "GitHub's description"

    def operations(self):
        return operations()

    def request_problems(self, operation, values, seen):
        accept = seen.headers.get("accept")
        return ([] if accept == "application/vnd.github+json"
                else [f"{operation.id}: Accept {accept!r}"]) + (
            path_problems(operation, values) + query_problems(operation, seen.query)
            + body_problems(operation, seen.body))

    # -- what each operation does --------------------------------------------------------

    def answer(self, operation: Operation, values: dict, seen) -> tuple[int, object]:
        headers, body, query = seen.headers, seen.body, seen.query
        now = datetime.now(dt_timezone.utc)
        if operation.template.startswith("/app"):
            problem = self._check_app_jwt(headers.get("authorization", ""), now)
            if problem:
                self.problems.append(f"{operation.id}: {problem}")
                return 401, {"message": "A JSON web token could not be decoded",
                             "documentation_url": "https://docs.github.com/rest"}
        elif not self._bearer_known(headers.get("authorization", ""), now):
            return 401, {"message": "Bad credentials",
                         "documentation_url": "https://docs.github.com/rest"}
        if operation.id == "apps/get-authenticated":
            app = response_example(operation, "200")
            app.update(id=self.app_id, slug=self.app_slug, name="switchboard test")
            return 200, app
        if operation.id == "users/get-authenticated":
            user = response_example(operation, "200")
            user.update(login=self.user_login, id=5150, type="User")
            return 200, user
        if operation.id == "apps/create-installation-access-token":
            token = f"ghs_{self.next_id()}standininstallationtoken"
            expires = (now + self.token_lifetime).replace(microsecond=0)
            self.installation_tokens[token] = (int(values["installation_id"]), expires)
            answer = response_example(operation, "201")
            answer.update(token=token, expires_at=expires.isoformat().replace("+00:00", "Z"))
            # GitHub grants what was asked (within the App's own permissions).
            if isinstance(body, dict) and "permissions" in body:
                answer["permissions"] = body["permissions"]
            return 201, answer
        if operation.id == "apps/revoke-installation-access-token":
            token = headers.get("authorization", "").removeprefix("Bearer ")
            self.installation_tokens.pop(token, None)
            self.revoked_tokens.append(token)
            return 204, None
        author = self._author(headers.get("authorization", ""))
        repo = (values.get("owner"), values.get("repo"))
        if operation.id.startswith("reactions/create-for-"):
            subject = (operation.id, *repo, values.get("issue_number") or values.get("comment_id"))
            for reaction in self.reactions:
                if reaction["subject"] == subject and reaction["content"] == body["content"] \
                        and reaction["user"] == author:
                    return 200, reaction["answer"]
            answer = response_example(operation, "201")
            answer.update(id=self.next_id(), content=body["content"],
                          user={**answer.get("user", {}), "login": author})
            self.reactions.append({"subject": subject, "content": body["content"],
                                   "user": author, "answer": answer})
            return 201, answer
        if operation.id == "issues/create-comment":
            answer = response_example(operation, "201")
            comment_id = self.next_id()
            answer.update(id=comment_id, body=body["body"],
                          user={**answer.get("user", {}), "login": author})
            self.comments[comment_id] = {"issue": (*repo, int(values["issue_number"])),
                                         "answer": answer}
            return 201, answer
        if operation.id == "issues/update-comment":
            comment = self.comments.get(int(values["comment_id"]))
            if comment is None or comment["issue"][:2] != repo:
                return 404, {"message": "Not Found"}
            comment["answer"]["body"] = body["body"]
            return 200, comment["answer"]
        if operation.id == "issues/list-comments":
            issue = (*repo, int(values["issue_number"]))
            return 200, [c["answer"] for c in self.comments.values() if c["issue"] == issue]
        if operation.id.startswith("checks/"):
            return self._answer_checks(operation, values, headers, body or {}, query or {}, repo)
        return 501, {"message": f"the stand-in does not serve {operation.id}"}

    def _answer_checks(self, operation, values, headers, body, query, repo):
        """Check runs as GitHub keeps them: written only by an App's installation (a token is
        refused, 403), a conclusion whenever the status is completed, a run edited only in its
        own repository, the list for a commit filtered by name and App."""
        token = headers.get("authorization", "").removeprefix("Bearer ")
        if token not in self.installation_tokens:
            self.problems.append(f"{operation.id}: check runs are an App's, not a token's")
            return 403, {"message": "You must authenticate via a GitHub App.",
                         "documentation_url": "https://docs.github.com/rest/checks/runs"}
        if operation.id == "checks/list-for-ref":
            runs = [run["answer"] for run in self.check_runs.values()
                    if run["repo"] == repo and run["answer"]["head_sha"] == values["ref"]
                    and run["answer"]["name"] == query.get("check_name", run["answer"]["name"])
                    and str(self.app_id) == query.get("app_id", str(self.app_id))]
            return 200, {"total_count": len(runs), "check_runs": runs}
        if (body.get("status") == "completed" or "completed_at" in body) \
                and "conclusion" not in body:
            self.problems.append(f"{operation.id}: completed without a conclusion")
            return 422, {"message": "Validation Failed"}
        if operation.id == "checks/create":
            answer = response_example(operation, "201")
            answer.update(id=next(self._ids), app={**answer.get("app", {}), "id": self.app_id,
                                                   "slug": self.app_slug},
                          status="queued", conclusion=None, completed_at=None)
            self.check_runs[answer["id"]] = {"repo": repo, "answer": answer}
            run = answer
            status = 201
        else:
            found = self.check_runs.get(int(values["check_run_id"]))
            if found is None or found["repo"] != repo:
                return 404, {"message": "Not Found"}
            run, status = found["answer"], 200
        run.update({key: value for key, value in body.items() if key != "output"})
        run["output"] = {**run.get("output", {}), **body.get("output", {})}
        if "conclusion" in body:
            run["status"] = "completed"
        return status, run

    def _bearer_known(self, authorization: str, now) -> bool:
        token = authorization.removeprefix("Bearer ").removeprefix("token ")
        if token == self.token:
            return True
        minted = self.installation_tokens.get(token)
        return minted is not None and minted[1] > now

    def _author(self, authorization: str) -> str:
        token = authorization.removeprefix("Bearer ")
        return f"{self.app_slug}[bot]" if token in self.installation_tokens else self.user_login

    def status_comments(self) -> list[dict]:
        """Every comment posted, as GitHub holds it now."""
        return [comment["answer"] for comment in self.comments.values()]

    def _check_app_jwt(self, authorization: str, now) -> str:
        """What GitHub would refuse in an App's JWT ("" when it is good)."""
        if not authorization.startswith("Bearer "):
            return "no bearer JWT"
        token = authorization.removeprefix("Bearer ")
        try:
            header = jwt.get_unverified_header(token)
            claims = jwt.decode(token, self._app_public_key, algorithms=["RS256"],
                                options={"require": ["iat", "exp", "iss"], "verify_iat": False},
                                leeway=0)
        except jwt.PyJWTError as exc:
            return f"JWT refused: {exc}"
        if header.get("alg") != "RS256":
            return f"JWT alg {header.get('alg')}"
        if str(claims["iss"]) != str(self.app_id):
            return f"JWT iss {claims['iss']!r} is not the App id"
        iat = datetime.fromtimestamp(claims["iat"], dt_timezone.utc)
        exp = datetime.fromtimestamp(claims["exp"], dt_timezone.utc)
        if iat > now + JWT_CLOCK_SKEW:
            return "JWT iat is in the future"
        if exp - iat > JWT_MAX_LIFETIME:
            return f"JWT lives {exp - iat}, more than 10 minutes"
        if exp > now + JWT_MAX_LIFETIME + JWT_CLOCK_SKEW:
            return "JWT exp is too far in the future"
        return ""
