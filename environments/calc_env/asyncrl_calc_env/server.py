"""The HiddenSum environment over asyncrl's environment protocol (HTTP + JSON).

The protocol is documented in the `asyncrl-environment` crate
(environment/src/lib.rs, section PROTOCOL): `POST /reset`, `POST /step`,
`POST /close`, `GET /health`, one server serving many episodes keyed by the
client's `episode_id`, steps numbered from 1 and idempotent on retry.

The game (the same rules as the Rust `builtin::HiddenSum`): the prompt is
like `7+x=` with `x` hidden; `task.metadata["x"]` holds its value and
`task.answer` the sum.

- reset: an empty observation with the `lookup` tool, no reward, not done.
- A step whose content, stripped, is exactly `x?` is a query: one `tool`
  message `x=<value>`, no reward, not done. So is each tool call of a step
  that has any: `lookup` with `{"name": "x"}` answers `x=<value>` (the
  message carries the call's name and id), any other call an `error: ...`
  tool message.
- Any other step is the final answer: done, reward 1.0 if its stripped
  content equals the stripped answer, else 0.0, empty observation.
- A query beyond `max_queries` ends the episode with reward 0.
- `--latency-ms` waits that long before answering each query (a slow tool).

Requests that are wrong (an unknown episode, a step out of order or after
the end, a malformed body) get 400 with `{"error": "..."}`.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_QUERIES = 4
DEFAULT_MAX_EPISODES = 10_000
MAX_BODY_BYTES = 1 << 20

LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the value of a hidden variable of the problem.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": 'The variable\'s name, e.g. "x".'},
            },
            "required": ["name"],
        },
    },
}

Reply = dict[str, Any]


class BadRequest(Exception):
    """A request the server refuses with 400 (the message is the error)."""


def hidden_value(task: dict[str, Any], answer: str) -> int:
    """The hidden `x` of a task: `metadata["x"]` when the task carries it,
    else derived from a prompt `A+x=` and the answer (`x = answer - A`), as
    asyncrl's built-in `hidden_sum` data set has it."""
    metadata = task.get("metadata")
    if isinstance(metadata, dict) and "x" in metadata:
        return _field(metadata, "x", int, "task.metadata")
    prompt = task.get("prompt")
    if isinstance(prompt, str) and prompt.endswith("+x="):
        try:
            return int(answer.strip()) - int(prompt[: -len("+x=")])
        except ValueError:
            pass
    raise BadRequest(
        'task has neither an integer metadata["x"] nor a prompt "A+x=" with an integer answer'
    )


def _field(body: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = body.get(name)
    # bool is an int in Python; the protocol's integers are not booleans.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"{where}.{name} must be {kind.__name__}, got {json.dumps(value)}")
    return value


def _reply(messages: list[dict[str, Any]], reward: float | None, done: bool, tools: list[Any] | None = None) -> Reply:
    return {"observation": {"messages": messages, "tools": tools or []}, "reward": reward, "done": done}


@dataclass
class Episode:
    task_id: str
    x: int
    answer: str
    queries: int = 0
    # The index of the last step answered (0: reset) and its reply.
    last_step: int = 0
    last_reply: Reply = field(default_factory=dict)


class HiddenSumGame:
    """The episodes of one server; safe to call from many threads."""

    def __init__(
        self,
        max_queries: int = DEFAULT_MAX_QUERIES,
        max_episodes: int = DEFAULT_MAX_EPISODES,
        latency_s: float = 0.0,
    ) -> None:
        self.max_queries = max_queries
        self.max_episodes = max_episodes
        self.latency_s = latency_s
        self._lock = threading.Lock()
        # Oldest first: past max_episodes the oldest unclosed one is dropped.
        self._episodes: OrderedDict[str, Episode] = OrderedDict()

    def open_episodes(self) -> int:
        with self._lock:
            return len(self._episodes)

    def reset(self, body: dict[str, Any]) -> Reply:
        """Starts an episode (see `hidden_value` for where `x` comes from)."""
        episode_id = _field(body, "episode_id", str, "body")
        task = _field(body, "task", dict, "body")
        task_id = _field(task, "task_id", str, "task")
        answer = _field(task, "answer", str, "task")
        x = hidden_value(task, answer)
        with self._lock:
            existing = self._episodes.get(episode_id)
            if existing is not None:
                # A retried reset of an episode that has not stepped.
                if existing.last_step == 0 and existing.task_id == task_id:
                    return existing.last_reply
                raise BadRequest(f"episode {episode_id!r} already exists")
            reply = _reply([], None, False, [LOOKUP_TOOL])
            self._episodes[episode_id] = Episode(task_id=task_id, x=x, answer=answer, last_reply=reply)
            while len(self._episodes) > self.max_episodes:
                self._episodes.popitem(last=False)
            return reply

    def step(self, body: dict[str, Any]) -> tuple[Reply, float]:
        """The reply, and how long to wait before sending it (outside the lock)."""
        episode_id = _field(body, "episode_id", str, "body")
        step = _field(body, "step", int, "body")
        action = _field(body, "action", dict, "body")
        content = _field(action, "content", str, "action")
        calls = action.get("tool_calls", [])
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise BadRequest("action.tool_calls must be a list of objects")
        for call in calls:
            _field(call, "name", str, "tool_call")
            if call.get("id") is not None:
                _field(call, "id", str, "tool_call")
        with self._lock:
            episode = self._episodes.get(episode_id)
            if episode is None:
                raise BadRequest(f"unknown episode {episode_id!r}")
            if step > 0 and step == episode.last_step:
                return episode.last_reply, 0.0
            if episode.last_reply["done"]:
                raise BadRequest(f"episode {episode_id!r} is done (step {step})")
            if step != episode.last_step + 1:
                raise BadRequest(
                    f"step {step} of episode {episode_id!r} is out of order (expected {episode.last_step + 1})"
                )
            reply, answered_query = self._play(episode, content, calls)
            episode.last_step = step
            episode.last_reply = reply
        return reply, self.latency_s if answered_query else 0.0

    def close(self, body: dict[str, Any]) -> Reply:
        episode_id = _field(body, "episode_id", str, "body")
        with self._lock:
            closed = self._episodes.pop(episode_id, None) is not None
        return {"closed": closed}

    def _play(self, episode: Episode, content: str, calls: list[dict[str, Any]]) -> tuple[Reply, bool]:
        messages: list[dict[str, Any]] = []
        if calls:
            for call in calls:
                name = call["name"]
                arguments = call.get("arguments")
                variable = arguments.get("name") if isinstance(arguments, dict) else None
                if name != "lookup":
                    text = f"error: unknown tool {json.dumps(name)}"
                elif not isinstance(variable, str):
                    text = 'error: lookup takes {"name": "x"}'
                elif variable != "x":
                    text = f"error: no variable named {json.dumps(variable)}"
                else:
                    text = f"x={episode.x}"
                message: dict[str, Any] = {"role": "tool", "content": text, "name": name}
                if call.get("id") is not None:
                    message["tool_call_id"] = call["id"]
                messages.append(message)
        elif content.strip() == "x?":
            messages.append({"role": "tool", "content": f"x={episode.x}"})
        else:
            right = content.strip() == episode.answer.strip()
            return _reply([], 1.0 if right else 0.0, True), False
        episode.queries += len(messages)
        if episode.queries > self.max_queries:
            return _reply([], 0.0, True), False
        return _reply(messages, None, False), True


class Handler(BaseHTTPRequestHandler):
    """Routes the protocol's requests to the server's game."""

    server: CalcEnvServer
    protocol_version = "HTTP/1.1"
    # Idle keep-alive connections end after this many seconds.
    timeout = 120

    def do_GET(self) -> None:  # noqa: N802 (the name BaseHTTPRequestHandler calls)
        if self.path.rstrip("/") == "/health":
            self._send(HTTPStatus.OK, {"status": "ok", "episodes": self.server.game.open_episodes()})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        game = self.server.game
        try:
            body = self._read_body()
            route = self.path.rstrip("/")
            if route == "/reset":
                self._send(HTTPStatus.OK, game.reset(body))
            elif route == "/step":
                reply, delay = game.step(body)
                if delay > 0:
                    time.sleep(delay)
                self._send(HTTPStatus.OK, reply)
            elif route == "/close":
                self._send(HTTPStatus.OK, game.close(body))
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no route POST {self.path}"})
        except BadRequest as e:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except Exception as e:  # a bug here: say so with a 500 (the client retries it)
            self.log_error("%s %s failed: %s", self.command, self.path, traceback.format_exc())
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {e!r}"})

    def _read_body(self) -> dict[str, Any]:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise BadRequest("the request has no Content-Length")
        try:
            length = int(length_header)
        except ValueError:
            raise BadRequest(f"bad Content-Length {length_header!r}") from None
        if length < 0 or length > MAX_BODY_BYTES:
            # The body is not read: the connection cannot be reused.
            self.close_connection = True
            raise BadRequest(f"body of {length} bytes; at most {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if self.server.log_requests:
            super().log_message(format, *args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002
        # Errors are logged even when requests are not.
        super().log_message(format, *args)


class CalcEnvServer(ThreadingHTTPServer):
    """A threading HTTP server (one thread per connection) holding one game."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], game: HiddenSumGame, log_requests: bool = False) -> None:
        super().__init__(address, Handler)
        self.game = game
        self.log_requests = log_requests

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
