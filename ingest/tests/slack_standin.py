"""A stand-in of Slack's Web API for write-back tests, held to the official ``slack_sdk``'s own
definition of each method.

Every request it receives is checked against ``slack_sdk.WebClient`` (the version pinned in
requirements.txt), never against what switchboard means to send: the method is one of the
WebClient's; every argument is one of that method's parameters, its required ones are there,
and each value has the type the method's signature gives it; the request is sent as the
WebClient sends that method (POST, a JSON body where it sends ``json=``, else a form) with the
token in an ``Authorization: Bearer`` header. How the WebClient sends a method is learnt by
calling it on a client whose ``api_call`` records instead of sending. A request that breaks a
rule is kept in ``problems`` (the ``slack_api`` fixture fails the test when any was seen) and
answered as Slack answers a bad request (``invalid_arguments``, ``unknown_method``,
``invalid_auth``…). Answers have Slack's shapes: HTTP 200 with ``ok``, ``ts``, ``channel``,
``message``, or ``{"ok": false, "error": …}``.
"""

import inspect
import json
import threading
import time
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs

import slack_sdk
from slack_sdk.models.metadata import Metadata

from .standin_server import Seen, StandIn


@dataclass(frozen=True)
class MethodRule:
    """What slack_sdk says of one Web API method: its parameters (name -> the Python types a
    JSON value may have), the required ones, and whether the WebClient sends it as JSON."""

    name: str
    parameters: dict
    required: frozenset
    sends_json: bool

    @property
    def id(self) -> str:
        return self.name


_rules: dict = {}


def _types_of(annotation) -> tuple:
    """The JSON value types an annotation of the WebClient admits (its models, such as
    ``Metadata`` or a block, are objects on the wire)."""
    if annotation is inspect.Parameter.empty or annotation is typing.Any:
        return (str, bool, int, float, dict, list)
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return tuple(kind for arg in typing.get_args(annotation) if arg is not type(None)
                     for kind in _types_of(arg))
    if annotation is str:
        return (str,)
    if annotation is bool:
        return (bool,)
    if annotation in (int, float):
        return (int, float) if annotation is float else (int,)
    base = origin or annotation
    if isinstance(base, type) and issubclass(base, Mapping):
        return (dict,)
    if isinstance(base, type) and issubclass(base, Sequence):
        return (list,)
    return (dict,)  # a slack_sdk model object (Metadata, Block, Attachment)


def method_rule(api_method: str) -> MethodRule | None:
    """slack_sdk's definition of ``api_method`` ("chat.postMessage"), or None when the
    WebClient has no such method."""
    if api_method in _rules:
        return _rules[api_method]
    attribute = api_method.replace(".", "_")
    function = getattr(slack_sdk.WebClient, attribute, None)
    if function is None or not callable(function):
        return None
    signature = inspect.signature(function)
    parameters = {name: _types_of(p.annotation) for name, p in signature.parameters.items()
                  if p.kind == inspect.Parameter.KEYWORD_ONLY}
    required = frozenset(name for name, p in signature.parameters.items()
                         if p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is p.empty)
    recorded = {}

    def record(called, *, http_verb="POST", json=None, **_):
        recorded.update(name=called, verb=http_verb, json=json is not None)

    client = slack_sdk.WebClient(token="xoxb-probe")
    client.api_call = record
    with warnings.catch_warnings():  # the SDK's advice on a probe without text
        warnings.simplefilter("ignore")
        getattr(client, attribute)(**{name: "x" for name in required})
    if recorded.get("name") != api_method:
        return None
    rule = MethodRule(api_method, parameters, required, recorded["json"])
    _rules[api_method] = rule
    return rule


def _form_value_fits(value: str, types: tuple) -> bool:
    # A form carries text: the WebClient sends booleans as "1"/"0" and numbers as digits.
    if str in types:
        return True
    if bool in types and value in ("1", "0", "true", "false"):
        return True
    if int in types and value.lstrip("-").isdigit():
        return True
    if dict in types or list in types:
        try:
            return isinstance(json.loads(value), tuple(t for t in types if t in (dict, list)))
        except ValueError:
            return False
    return False


def _json_value_fits(value, types: tuple) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def argument_problems(rule: MethodRule, arguments: dict, *, as_json: bool) -> list[str]:
    """What slack_sdk's signature of ``rule`` refuses in ``arguments``."""
    problems = [f"{rule.name}: no parameter {name!r}" for name in arguments
                if name not in rule.parameters]
    problems += [f"{rule.name}: required {name!r} missing" for name in sorted(rule.required)
                 if name not in arguments]
    for name, value in arguments.items():
        types = rule.parameters.get(name)
        if types is None:
            continue
        fits = _json_value_fits(value, types) if as_json else _form_value_fits(value, types)
        if not fits:
            problems.append(f"{rule.name}: {name}={value!r} is not "
                            f"{'/'.join(t.__name__ for t in types)}")
    if "metadata" in arguments:
        metadata = arguments["metadata"]
        metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
        if not (isinstance(metadata, dict) and set(metadata) == Metadata.attributes
                and isinstance(metadata["event_type"], str)
                and isinstance(metadata["event_payload"], dict)):
            problems.append(f"{rule.name}: metadata is not slack_sdk's Metadata "
                            f"({', '.join(sorted(Metadata.attributes))}): {metadata!r}")
    return problems


# -- the stand-in --------------------------------------------------------------------------------


class SlackStandIn(StandIn):
    """Slack's Web API on a loopback port (``api_url``, as ``https://slack.com/api``). One
    workspace with one app's bot (``token``, ``bot_user_id``, ``bot_id``, ``app_id``); the
    channels' messages (people's, added with ``add_message``, and the bot's), each request in
    ``seen`` (its method in ``operation``, its arguments in ``body``), each broken rule in
    ``problems``."""

    def __init__(self):
        super().__init__(prefix="/api")
        self.token = "xoxb-2024-4242-standinbottoken0123456789"
        self.team_id, self.team_name = "T0STANDIN", "Switchboard Test"
        self.workspace_url = "https://switchboard-test.slack.com/"
        self.bot_user, self.bot_user_id = "switchboard", "U0SWBOT01"
        self.bot_id, self.app_id = "B0SWBOT01", "A0SWAPP01"
        self.revoked: set[str] = set()
        self.channels: dict[str, list[dict]] = {}
        self.reactions: list[tuple] = []  # (channel, ts, name, user)
        self._last_us = 0
        self._ts_lock = threading.Lock()

    def refuse(self, error: str, *, times: int | None = 1) -> None:
        """Answer the next ``times`` requests (every one while None) as Slack refuses: HTTP 200
        with ``{"ok": false, "error": error}``."""
        self.fail(200, message=error, times=times)

    def fault_answer(self, fault):
        # Slack words every error in "error"; a 429's is always "ratelimited".
        error = "ratelimited" if fault.status == 429 else fault.message
        return fault.status, {"ok": False, "error": error}, fault.headers

    # -- how slack_sdk's WebClient calls a method ------------------------------------------

    description = "slack_sdk's WebClient"

    def load(self) -> None:
        method_rule("auth.test")  # slack_sdk, read before the first request

    def find_operation(self, method: str, api_path: str):
        # The WebClient posts every method to /api/<method>.
        rule = method_rule(api_path.removeprefix("/")) if method == "POST" else None
        return None if rule is None else (rule, {})

    def read_body(self, seen, raw):
        media = _media(seen)
        if media == "application/json":
            try:
                seen.body = json.loads(raw) if raw else {}
            except ValueError:
                self.problems.append(f"{seen.path}: the body is not JSON")
                return self.invalid_answer([])
        else:
            fields = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
            seen.body = {name: values[-1] for name, values in fields.items()}
        return None

    def unknown_answer(self):
        return 200, {"ok": False, "error": "unknown_method"}

    def invalid_answer(self, problems):
        return 200, {"ok": False, "error": "invalid_arguments"}

    def request_problems(self, rule: MethodRule, values: dict, seen: Seen) -> list[str]:
        problems = []
        if seen.query:
            problems.append(f"{rule.name}: arguments in the query string ({sorted(seen.query)})")
        media = _media(seen)
        if rule.sends_json and media != "application/json":
            problems.append(f"{rule.name}: the WebClient sends JSON, not {media!r}")
        if not rule.sends_json and seen.body and media != "application/x-www-form-urlencoded":
            problems.append(f"{rule.name}: the WebClient sends a form, not {media!r}")
        if not isinstance(seen.body, dict):
            return [*problems, f"{rule.name}: the body is not an object"]
        problems += argument_problems(rule, seen.body, as_json=rule.sends_json)
        if (not seen.headers.get("authorization", "").startswith("Bearer ")
                or "token" in seen.body):
            problems.append(f"{rule.name}: the token goes in an Authorization: Bearer header")
        return problems

    def next_ts(self) -> str:
        """A message timestamp as Slack makes them: the time to the microsecond, unique."""
        with self._ts_lock:
            self._last_us = max(int(time.time() * 1_000_000), self._last_us + 1)
            return f"{self._last_us // 1_000_000}.{self._last_us % 1_000_000:06d}"

    def add_message(self, channel: str, *, user: str, text: str, thread_ts=None) -> dict:
        """A person's message in ``channel`` (a reply when ``thread_ts``), as Slack keeps it."""
        message = {"type": "message", "user": user, "text": text, "ts": self.next_ts(),
                   "team": self.team_id}
        if thread_ts:
            message.update(thread_ts=thread_ts, parent_user_id=self._find(channel,
                                                                          thread_ts)["user"])
        with self._lock:
            self.channels.setdefault(channel, []).append(message)
        return dict(message)

    def replies(self, channel: str, thread_ts: str) -> list[dict]:
        """The bot's replies in a thread, as Slack holds them now."""
        return [m for m in self.channels.get(channel, []) if m.get("thread_ts") == thread_ts
                and m["ts"] != thread_ts and m.get("bot_id") == self.bot_id]

    def delete(self, channel: str, ts: str) -> None:
        self.channels[channel] = [m for m in self.channels[channel] if m["ts"] != ts]

    def _find(self, channel: str, ts: str) -> dict | None:
        return next((m for m in self.channels.get(channel, []) if m["ts"] == ts), None)

    # -- what each method does -----------------------------------------------------------

    def answer(self, rule: MethodRule, values: dict, seen: Seen) -> tuple[int, object]:
        token = seen.headers.get("authorization", "").removeprefix("Bearer ")
        return 200, self._answer(rule.name, token, seen.body)

    def _answer(self, method: str, token: str, args: dict) -> dict:
        if not token:
            return {"ok": False, "error": "not_authed"}
        if token in self.revoked:
            return {"ok": False, "error": "token_revoked"}
        if token != self.token:
            return {"ok": False, "error": "invalid_auth"}
        if method == "auth.test":
            return {"ok": True, "url": self.workspace_url, "team": self.team_name,
                    "user": self.bot_user, "team_id": self.team_id,
                    "user_id": self.bot_user_id, "bot_id": self.bot_id,
                    "is_enterprise_install": False}
        channel = args.get("channel")
        if channel not in self.channels:
            return {"ok": False, "error": "channel_not_found"}
        if method == "reactions.add":
            if self._find(channel, args["timestamp"]) is None:
                return {"ok": False, "error": "message_not_found"}
            reaction = (channel, args["timestamp"], args["name"], self.bot_user_id)
            if reaction in self.reactions:
                return {"ok": False, "error": "already_reacted"}
            self.reactions.append(reaction)
            return {"ok": True}
        if method == "chat.postMessage":
            message = {"user": self.bot_user_id, "type": "message", "ts": self.next_ts(),
                       "bot_id": self.bot_id, "app_id": self.app_id, "text": args["text"],
                       "team": self.team_id,
                       "bot_profile": {"id": self.bot_id, "app_id": self.app_id,
                                       "name": self.bot_user, "deleted": False,
                                       "team_id": self.team_id}}
            if args.get("thread_ts"):
                parent = self._find(channel, args["thread_ts"])
                message.update(thread_ts=args["thread_ts"],
                               parent_user_id=parent["user"] if parent else self.bot_user_id)
            if args.get("metadata"):
                message["metadata"] = args["metadata"]
            self.channels[channel].append(message)
            return {"ok": True, "channel": channel, "ts": message["ts"], "message": dict(message)}
        if method == "chat.update":
            message = self._find(channel, args["ts"])
            if message is None:
                return {"ok": False, "error": "message_not_found"}
            if message.get("bot_id") != self.bot_id:
                return {"ok": False, "error": "cant_update_message"}
            message.update(text=args.get("text", message["text"]),
                           edited={"user": self.bot_user_id, "ts": self.next_ts()})
            if args.get("metadata"):
                message["metadata"] = args["metadata"]
            return {"ok": True, "channel": channel, "ts": args["ts"], "text": message["text"],
                    "message": {k: v for k, v in message.items() if k != "metadata"}}
        if method == "conversations.replies":
            return self._replies(channel, args)
        return {"ok": False, "error": "unknown_method"}

    def _replies(self, channel: str, args: dict) -> dict:
        root = args["ts"]
        if self._find(channel, root) is None:
            return {"ok": False, "error": "thread_not_found"}
        inclusive = args.get("inclusive") in ("1", "true")
        oldest, latest = float(args.get("oldest") or 0), float(args.get("latest") or time.time())

        def within(ts: float) -> bool:
            return (oldest <= ts <= latest) if inclusive else (oldest < ts < latest)

        thread = [m for m in self.channels[channel]
                  if m["ts"] == root or m.get("thread_ts") == root]
        thread = [m for m in sorted(thread, key=lambda m: float(m["ts"]))
                  if m["ts"] == root or within(float(m["ts"]))]
        limit = int(args.get("limit") or 1000)
        # Metadata is only part of the answer when the caller asks for it.
        with_metadata = args.get("include_all_metadata") in ("1", "true")
        messages = [m if with_metadata else {k: v for k, v in m.items() if k != "metadata"}
                    for m in thread[:limit]]
        return {"ok": True, "messages": messages, "has_more": len(thread) > limit,
                "response_metadata": {"next_cursor": ""}}


def _media(seen: Seen) -> str:
    return seen.headers.get("content-type", "").partition(";")[0].strip().lower()
