"""Local stand-ins for the model APIs the agent CLIs call, so a real CLI can be driven offline.

Each stand-in is a small HTTP server on 127.0.0.1 that speaks one vendor's wire format, as the
CLI's own client sends and parses it:

* ``AnthropicStandin``: the Messages API (``POST /v1/messages``, streamed as server-sent events
  or as one JSON message; ``/v1/messages/count_tokens``), for Claude Code's
  ``ANTHROPIC_BASE_URL``.
* ``OpenAIResponsesStandin``: the Responses API (``POST /v1/responses``, streamed), for a Codex
  model provider's ``base_url``.
* ``GeminiStandin``: ``models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse``
  (and ``:countTokens``), for Gemini CLI's ``GOOGLE_GEMINI_BASE_URL``.

All three play the same scripted model (``Script``), which only ever acts through the tools the
CLI offers it, found by name (each CLI names an MCP tool its own way, e.g.
``mcp__switchboard__claim_next`` or ``claim_next``):

* ``direct``: call ``claim_next``; from its result take the todo's id and lease, call
  ``complete`` with a result; then answer with a closing line and stop.
* ``stdin``: the todo arrives with the prompt (the runner's case: its JSON on the agent's
  stdin, its id and lease named in the built-in prompt); call ``complete`` for it, then stop.
* ``report``: the runner settles the todo from the CLI's own report (its JSON output): the
  model calls no switchboard tool and answers with ``RESULT_SUMMARY``.
* ``api_error``: every request is refused with the vendor's error shape and ``ERROR_MESSAGE``, as
  an account without credit would be.

Every answer reports token usage in the vendor's shape (``USAGE_INPUT_TOKENS`` and
``USAGE_OUTPUT_TOKENS`` per request); ``reported_usage`` sums what the stand-in reported, to
compare with what the CLI passed on.

A request that does not offer the switchboard tools (a CLI's side calls: titles, routing,
summaries) gets a short plain answer. Every request is kept in ``requests`` for the tests.
"""

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

ERROR_MESSAGE = "Your credit balance is too low to access the API (stand-in refusal 7731)"
RESULT_SUMMARY = "handled by the scripted stand-in model"
CLOSING_TEXT = "The switchboard todo is complete."
USAGE_INPUT_TOKENS = 130
USAGE_OUTPUT_TOKENS = 17


def find_tool(offered: list[str], verb: str) -> str | None:
    """The CLI's name for switchboard's ``verb``: bare, or behind a server prefix
    (``mcp__switchboard__claim_next``, ``mcp_switchboard_claim_next``)."""
    for name in offered:
        if name == verb or name.endswith(f"_{verb}"):
            return name
    return None


def find_todo(value):
    """The first todo (a JSON object with ``id`` and ``lease_id``) anywhere in ``value``: nested
    dicts and lists, strings holding JSON, or JSON embedded in prose."""
    if isinstance(value, dict):
        if "lease_id" in value and "id" in value:
            return value
        for item in value.values():
            if (found := find_todo(item)) is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            if (found := find_todo(item)) is not None:
                return found
    elif isinstance(value, str) and "lease_id" in value:
        decoder = json.JSONDecoder()
        for match in re.finditer(r"[{\[]", value):
            try:
                parsed, _ = decoder.raw_decode(value, match.start())
            except ValueError:
                continue
            if isinstance(parsed, (dict, list)) and (found := find_todo(parsed)) is not None:
                return found
    return None


def named_todo(prompt):
    """A todo the prompt names in words (the runner's built-in prompt: 'call ... complete with
    todo_id "12", lease_id "…"'), when its JSON did not reach the model."""
    match = re.search(r'todo_id "([^"]+)", lease_id "([^"]+)"', strings(prompt))
    return {"id": match.group(1), "lease_id": match.group(2)} if match else None


def strings(value) -> str:
    """Every string in a JSON value, one per line."""
    if isinstance(value, dict):
        return "\n".join(strings(item) for item in value.values())
    if isinstance(value, list):
        return "\n".join(strings(item) for item in value)
    return value if isinstance(value, str) else ""


@dataclass
class Action:
    """What the model does this turn: call ``tool`` with ``arguments``, or say ``text``."""

    text: str = ""
    tool: str | None = None
    arguments: dict = field(default_factory=dict)


class Script:
    def __init__(self, mode: str):
        assert mode in ("direct", "stdin", "report", "api_error"), mode
        self.mode = mode

    def next(self, offered: list[str], prompt, results: list[tuple[str, object]]) -> Action:
        """``offered``: tool names in this request; ``prompt``: what the user side said (any
        JSON-able value); ``results``: ``(tool name, result)`` of the calls made so far."""
        claim_next, complete = find_tool(offered, "claim_next"), find_tool(offered, "complete")
        # Under the runner the agent holds a todo token, whose tools have no claim_next.
        if complete is None or (self.mode == "direct" and claim_next is None):
            return Action(text="OK")  # a side request, not the agent's turn
        if self.mode == "report":
            return Action(text=RESULT_SUMMARY)
        called = [name for name, _ in results]
        if complete in called:
            return Action(text=CLOSING_TEXT)
        if self.mode == "direct":
            if claim_next not in called:
                return Action(tool=claim_next, arguments={})
            todo = find_todo([result for name, result in results if name == claim_next])
            if todo is None:
                return Action(text="There was nothing to claim.")
        else:
            todo = find_todo(prompt) or named_todo(prompt)
            if todo is None:
                return Action(text="I found no todo in the prompt.")
        return Action(tool=complete, arguments={
            "todo_id": str(todo["id"]), "lease_id": todo["lease_id"],
            "result": {"summary": RESULT_SUMMARY}})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.standin.record("GET", self.path, None)
        self.server.standin.handle_get(self)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"_raw": raw.decode("utf-8", "replace")}
        self.server.standin.record("POST", self.path, body, headers=dict(self.headers))
        self.server.standin.handle_post(self, body)

    def send_json(self, status: int, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_sse(self, events: list[tuple[str | None, dict]]):
        """One complete event stream: ``(event name or None, data)`` each."""
        chunks = []
        for name, data in events:
            head = f"event: {name}\n" if name else ""
            chunks.append(f"{head}data: {json.dumps(data)}\n\n")
        payload = "".join(chunks).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class Standin:
    """Base: the HTTP server, the request log and the script."""

    def __init__(self, mode: str = "direct"):
        self.script = Script(mode)
        self.requests: list[dict] = []
        self.actions: list[Action] = []
        self.reported_usage = {"input_tokens": 0, "output_tokens": 0, "requests": 0}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.standin = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def record(self, method, path, body, headers=None):
        with self._lock:
            self.requests.append({"method": method, "path": path, "body": body,
                                  "headers": headers or {}})

    def report_usage(self) -> tuple[int, int]:
        """One answer's usage, counted in ``reported_usage``."""
        with self._lock:
            self.reported_usage["input_tokens"] += USAGE_INPUT_TOKENS
            self.reported_usage["output_tokens"] += USAGE_OUTPUT_TOKENS
            self.reported_usage["requests"] += 1
        return USAGE_INPUT_TOKENS, USAGE_OUTPUT_TOKENS

    def decide(self, offered, prompt, results) -> Action:
        action = self.script.next(offered, prompt, results)
        with self._lock:
            self.actions.append(action)
        return action

    def offered_tools(self) -> set[str]:
        """Every tool name any request offered the model."""
        return {name for request in self.requests for name in self.tool_names(request["body"])}

    def named_tools(self, names) -> set[str]:
        """Those of ``names`` some request spelt out (a CLI that defers tool schemas still
        lists their names for the model)."""
        text = "\n".join(strings(request["body"]) for request in self.requests)
        return {name for name in names if re.search(rf"\b{re.escape(name)}\b", text)}

    def called_tools(self) -> list[str]:
        return [action.tool for action in self.actions if action.tool]

    def tool_names(self, body) -> list[str]:
        raise NotImplementedError

    def handle_get(self, handler):
        handler.send_json(404, {"error": {"message": f"no such path {handler.path}"}})


# -- Anthropic Messages ---------------------------------------------------------------------------

class AnthropicStandin(Standin):
    model = "claude-sonnet-4-5"

    def tool_names(self, body) -> list[str]:
        return [tool.get("name", "") for tool in (body or {}).get("tools") or []]

    @staticmethod
    def _blocks(content):
        return [{"type": "text", "text": content}] if isinstance(content, str) else content or []

    def load_deferred(self, body, offered, results) -> Action | None:
        """Claude Code defers MCP tools: the request names them in a system message and offers
        ``ToolSearch`` to load their schemas. A model that needs them asks for them first."""
        if find_tool(offered, "complete") or "ToolSearch" not in offered \
                or "ToolSearch" in [name for name, _ in results]:
            return None
        text = json.dumps(body.get("messages")) + json.dumps(body.get("system"))
        # A todo token's session has no claim_next: complete alone is enough.
        wanted = [match.group(0) for verb in ("claim_next", "complete")
                  if (match := re.search(rf"mcp__\w+?__{verb}\b", text))]
        if not any(name.endswith("__complete") for name in wanted):
            return None
        action = Action(tool="ToolSearch", arguments={"query": "select:" + ",".join(wanted)})
        with self._lock:
            self.actions.append(action)
        return action

    def handle_post(self, handler, body):
        path = urlparse(handler.path).path
        if path.endswith("/count_tokens"):
            return handler.send_json(200, {"input_tokens": 100})
        if not path.endswith("/v1/messages"):
            return handler.send_json(404, {"type": "error", "error": {
                "type": "not_found_error", "message": f"no such path {path}"}})
        if self.script.mode == "api_error":
            return handler.send_json(400, {"type": "error", "error": {
                "type": "invalid_request_error", "message": ERROR_MESSAGE}})
        names, results, prompt = {}, [], []
        for message in body.get("messages", []):
            for block in self._blocks(message.get("content")):
                if block.get("type") == "tool_use":
                    names[block["id"]] = block["name"]
                elif block.get("type") == "tool_result":
                    results.append((names.get(block.get("tool_use_id"), ""), block.get("content")))
                elif block.get("type") == "text" and message.get("role") == "user":
                    prompt.append(block["text"])
        offered = self.tool_names(body)
        action = self.load_deferred(body, offered, results) or self.decide(offered, prompt, results)
        number = len(self.requests)
        if action.tool:
            block = {"type": "tool_use", "id": f"toolu_standin_{number}", "name": action.tool,
                     "input": action.arguments}
            stop = "tool_use"
        else:
            block = {"type": "text", "text": action.text}
            stop = "end_turn"
        input_tokens, output_tokens = self.report_usage()
        usage = {"input_tokens": input_tokens, "output_tokens": output_tokens,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message = {"id": f"msg_standin_{number}", "type": "message", "role": "assistant",
                   "model": body.get("model") or self.model, "content": [block],
                   "stop_reason": stop, "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return handler.send_json(200, message)
        if action.tool:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(action.arguments)}
        else:
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": action.text}
        handler.send_sse([
            ("message_start", {"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None,
                "usage": {**usage, "output_tokens": 1}}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": start}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": stop, "stop_sequence": None},
                               "usage": {"output_tokens": output_tokens}}),
            ("message_stop", {"type": "message_stop"}),
        ])


# -- OpenAI Responses -----------------------------------------------------------------------------

class OpenAIResponsesStandin(Standin):
    def tool_names(self, body) -> list[str]:
        """Functions in ``tools``, and those a ``tool_search_output`` in the input loaded (a
        namespace's tools are named ``<namespace>__<tool>`` here)."""
        tools = list((body or {}).get("tools") or [])
        for item in (body or {}).get("input") or []:
            if isinstance(item, dict) and item.get("type") == "tool_search_output":
                tools += item.get("tools") or []
        names = []
        for tool in tools:
            if tool.get("type") == "function":
                names.append(tool.get("name", ""))
            elif tool.get("type") == "namespace":
                names += [f"{tool.get('name', '')}__{inner.get('name', '')}"
                          for inner in tool.get("tools") or []]
        return names

    @staticmethod
    def _qualified(item) -> str:
        namespace = item.get("namespace")
        return f"{namespace}__{item.get('name', '')}" if namespace else item.get("name", "")

    def handle_get(self, handler):
        if urlparse(handler.path).path.endswith("/models"):
            return handler.send_json(200, {"object": "list", "data": []})
        super().handle_get(handler)

    def handle_post(self, handler, body):
        path = urlparse(handler.path).path
        if not path.endswith("/responses"):
            return handler.send_json(404, {"error": {"message": f"no such path {path}",
                                                     "type": "invalid_request_error"}})
        if self.script.mode == "api_error":
            return handler.send_json(400, {"error": {
                "message": ERROR_MESSAGE, "type": "insufficient_quota", "param": None,
                "code": "insufficient_quota"}})
        names, results, prompt = {}, [], []
        items = body.get("input") or []
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        for item in items:
            kind = item.get("type", "message")
            if kind == "function_call":
                names[item.get("call_id")] = self._qualified(item)
            elif kind == "function_call_output":
                results.append((names.get(item.get("call_id"), ""), item.get("output")))
            elif kind == "message" and item.get("role") == "user":
                prompt.append(item.get("content"))
        offered = self.tool_names(body)
        number = len(self.requests)
        response_id = f"resp_standin_{number}"
        searched = any(item.get("type") == "tool_search_output" for item in items)
        if find_tool(offered, "complete") is None and not searched and any(
                tool.get("type") == "tool_search" for tool in body.get("tools") or []):
            # Codex defers MCP tools behind a client-executed tool_search: ask for ours first.
            # A limit above the endpoint's tool count: every granted verb must come back (with
            # ten, the eleventh tool, post_update, pushed heartbeat out of the results).
            action = Action(tool="tool_search", arguments={"query": "switchboard claim_next complete",
                                                           "limit": 25})
            with self._lock:
                self.actions.append(action)
            item = {"type": "tool_search_call", "id": f"ts_standin_{number}",
                    "call_id": f"search_standin_{number}", "execution": "client",
                    "status": "completed", "arguments": action.arguments}
            return self._send_item(handler, body, response_id, item)
        action = self.decide(offered, prompt, results)
        if action.tool:
            item = {"type": "function_call", "id": f"fc_standin_{number}",
                    "call_id": f"call_standin_{number}", "name": action.tool,
                    "arguments": json.dumps(action.arguments), "status": "completed"}
            namespace, _, name = action.tool.rpartition("__")
            if namespace and action.tool not in [t.get("name") for t in body.get("tools") or []]:
                item.update(namespace=namespace, name=name)
        else:
            item = {"type": "message", "id": f"msg_standin_{number}", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": action.text, "annotations": []}]}
        self._send_item(handler, body, response_id, item)

    def _send_item(self, handler, body, response_id, item):
        input_tokens, output_tokens = self.report_usage()
        usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": input_tokens + output_tokens}
        response = {"id": response_id, "object": "response", "status": "in_progress",
                    "model": body.get("model"), "output": []}
        events = [("response.created", {"type": "response.created", "response": response}),
                  ("response.output_item.added", {"type": "response.output_item.added",
                                                  "output_index": 0, "item": item})]
        if item["type"] == "message":
            events.append(("response.output_text.delta", {
                "type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                "content_index": 0, "delta": item["content"][0]["text"]}))
        events += [
            ("response.output_item.done", {"type": "response.output_item.done",
                                           "output_index": 0, "item": item}),
            ("response.completed", {"type": "response.completed", "response": {
                **response, "status": "completed", "output": [item], "usage": usage}}),
        ]
        for sequence, (_, data) in enumerate(events):
            data["sequence_number"] = sequence
        handler.send_sse(events)


# -- Gemini generateContent -----------------------------------------------------------------------

class GeminiStandin(Standin):
    def tool_names(self, body) -> list[str]:
        return [declaration.get("name", "")
                for tool in (body or {}).get("tools") or []
                for declaration in tool.get("functionDeclarations") or []]

    def handle_post(self, handler, body):
        path = urlparse(handler.path).path
        method = path.rsplit(":", 1)[-1] if ":" in path else ""
        if method == "countTokens":
            return handler.send_json(200, {"totalTokens": 100})
        if method not in ("generateContent", "streamGenerateContent"):
            return handler.send_json(404, {"error": {"code": 404, "status": "NOT_FOUND",
                                                     "message": f"no such method {path}"}})
        if self.script.mode == "api_error":
            return handler.send_json(400, {"error": {
                "code": 400, "status": "FAILED_PRECONDITION", "message": ERROR_MESSAGE}})
        results, prompt = [], []
        for content in body.get("contents") or []:
            for part in content.get("parts") or []:
                if "functionResponse" in part:
                    response = part["functionResponse"]
                    results.append((response.get("name", ""), response.get("response")))
                elif "text" in part and content.get("role") == "user":
                    prompt.append(part["text"])
        action = self.decide(self.tool_names(body), prompt, results)
        input_tokens, output_tokens = self.report_usage()
        config = body.get("generationConfig") or {}
        if action.tool:
            arguments = dict(action.arguments)
            if "wait_for_previous" in self._parameters(body, action.tool):
                # Gemini CLI adds this to every tool's schema; its models fill it in.
                arguments["wait_for_previous"] = True
            part = {"functionCall": {"name": action.tool, "args": arguments}}
        elif config.get("responseMimeType") == "application/json":
            part = {"text": json.dumps(self._json_answer(config))}
        else:
            part = {"text": action.text}
        answer = {"candidates": [{"content": {"role": "model", "parts": [part]},
                                  "finishReason": "STOP", "index": 0}],
                  "usageMetadata": {"promptTokenCount": input_tokens,
                                    "candidatesTokenCount": output_tokens,
                                    "totalTokenCount": input_tokens + output_tokens},
                  "modelVersion": path.rsplit("/", 1)[-1].split(":")[0]}
        if method == "generateContent":
            return handler.send_json(200, answer)
        handler.send_sse([(None, answer)])

    @staticmethod
    def _parameters(body, name) -> dict:
        for tool in body.get("tools") or []:
            for declaration in tool.get("functionDeclarations") or []:
                if declaration.get("name") == name:
                    schema = declaration.get("parametersJsonSchema") or declaration.get(
                        "parameters") or {}
                    return schema.get("properties") or {}
        return {}

    @staticmethod
    def _json_answer(config) -> dict:
        """A side request that wants JSON (e.g. a next-speaker check): a minimal object that
        hands the turn back to the user."""
        schema = config.get("responseJsonSchema") or config.get("responseSchema") or {}
        answer = {}
        for name, spec in (schema.get("properties") or {}).items():
            if spec.get("enum"):
                answer[name] = "user" if "user" in spec["enum"] else spec["enum"][0]
            elif spec.get("type") in ("number", "integer", "NUMBER", "INTEGER"):
                answer[name] = spec.get("minimum", 1)
            elif spec.get("type") in ("boolean", "BOOLEAN"):
                answer[name] = False
            else:
                answer[name] = "user" if name == "next_speaker" else "stand-in"
        return answer
