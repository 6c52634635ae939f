"""The HiddenSum server over real HTTP: the game's rules, idempotent steps,
the 400s, and `python -m asyncrl_calc_env` as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl_calc_env import LOOKUP_TOOL, CalcEnvServer, HiddenSumGame

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def start(game: HiddenSumGame) -> tuple[CalcEnvServer, threading.Thread]:
    server = CalcEnvServer(("127.0.0.1", 0), game)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def game() -> HiddenSumGame:
    return HiddenSumGame(max_queries=2)


@pytest.fixture
def url(game: HiddenSumGame) -> Iterator[str]:
    server, thread = start(game)
    yield server.url
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def call(url: str, route: str, body: Any = None, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """POSTs `body` (or `raw` bytes) to `url/route`, or GETs when neither; the status and the JSON reply."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(
        f"{url}/{route}",
        data=data,
        method="GET" if data is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def task(x: int = 12, answer: str = "19", task_id: str = "t1") -> dict[str, Any]:
    return {"task_id": task_id, "dataset": "hidden_sum", "prompt": "7+x=", "answer": answer, "metadata": {"x": x}}


def step(url: str, episode: str, n: int, content: str, tool_calls: list[Any] | None = None) -> tuple[int, dict[str, Any]]:
    action: dict[str, Any] = {"content": content}
    if tool_calls is not None:
        action["tool_calls"] = tool_calls
    return call(url, "step", {"episode_id": episode, "step": n, "action": action})


def test_health(url: str) -> None:
    assert call(url, "health") == (200, {"status": "ok", "episodes": 0})


def test_reset_offers_the_lookup_tool(url: str) -> None:
    status, reply = call(url, "reset", {"episode_id": "e", "task": task()})
    assert status == 200
    assert reply == {"observation": {"messages": [], "tools": [LOOKUP_TOOL]}, "reward": None, "done": False}


def test_query_then_right_answer(url: str) -> None:
    call(url, "reset", {"episode_id": "e", "task": task(x=12, answer="19")})
    assert step(url, "e", 1, " x? \n") == (
        200,
        {"observation": {"messages": [{"role": "tool", "content": "x=12"}], "tools": []}, "reward": None, "done": False},
    )
    assert step(url, "e", 2, " 19 ") == (200, {"observation": {"messages": [], "tools": []}, "reward": 1.0, "done": True})


def test_wrong_answer_scores_zero(url: str) -> None:
    call(url, "reset", {"episode_id": "e", "task": task(x=1, answer="8")})
    status, reply = step(url, "e", 1, "9")
    assert (status, reply["reward"], reply["done"]) == (200, 0.0, True)


def test_tool_calls_are_queries(url: str) -> None:
    call(url, "reset", {"episode_id": "e", "task": task(x=-4)})
    calls = [
        {"id": "c1", "name": "lookup", "arguments": {"name": "x"}},
        {"id": "c2", "name": "lookup", "arguments": {"name": "y"}},
    ]
    status, reply = step(url, "e", 1, "", calls)
    assert status == 200 and not reply["done"] and reply["reward"] is None
    assert reply["observation"]["messages"] == [
        {"role": "tool", "content": "x=-4", "name": "lookup", "tool_call_id": "c1"},
        {"role": "tool", "content": 'error: no variable named "y"', "name": "lookup", "tool_call_id": "c2"},
    ]


def test_a_query_beyond_max_queries_ends_with_zero(url: str) -> None:
    call(url, "reset", {"episode_id": "e", "task": task()})
    assert not step(url, "e", 1, "x?")[1]["done"]
    assert not step(url, "e", 2, "x?")[1]["done"]
    assert step(url, "e", 3, "x?") == (200, {"observation": {"messages": [], "tools": []}, "reward": 0.0, "done": True})


def test_a_repeated_step_returns_the_cached_reply(url: str, game: HiddenSumGame) -> None:
    call(url, "reset", {"episode_id": "e", "task": task()})
    # A retried reset of an episode that has not stepped is answered again.
    assert call(url, "reset", {"episode_id": "e", "task": task()})[0] == 200
    first = step(url, "e", 1, "x?")
    # The same index with another action: the first reply, and no second query.
    assert step(url, "e", 1, "19") == first
    assert step(url, "e", 2, "x?")[1]["done"] is False  # the second query of max_queries=2
    final = step(url, "e", 3, "19")
    assert final[1]["reward"] == 1.0
    assert step(url, "e", 3, "anything") == final


@pytest.mark.parametrize(
    ("route", "body", "error"),
    [
        ("step", {"episode_id": "nope", "step": 1, "action": {"content": "x?"}}, "unknown episode 'nope'"),
        ("reset", {"episode_id": "e", "task": {**task(), "metadata": {"x": "12"}}}, "task.metadata.x must be int"),
        ("reset", {"episode_id": "e", "task": {**task(), "metadata": {"x": True}}}, "task.metadata.x must be int"),
        ("reset", {"task": task()}, "body.episode_id must be str"),
        ("step", {"episode_id": "e", "step": "1", "action": {"content": "x?"}}, "body.step must be int"),
        ("step", {"episode_id": "e", "step": 1, "action": {"content": 5}}, "action.content must be str"),
        ("step", {"episode_id": "e", "step": 1, "action": {"content": "", "tool_calls": [{}]}}, "tool_call.name must be str"),
        ("close", [], "the body must be a JSON object"),
    ],
)
def test_bad_requests_are_400(url: str, route: str, body: Any, error: str) -> None:
    status, reply = call(url, route, body)
    assert status == 400
    assert error in reply["error"], reply


def test_malformed_json_is_400(url: str) -> None:
    status, reply = call(url, "step", raw=b"{not json")
    assert status == 400 and reply["error"].startswith("the body is not JSON"), reply


def test_unknown_route_is_404(url: str) -> None:
    assert call(url, "rest", {"episode_id": "e"}) == (404, {"error": "no route POST /rest"})


def test_steps_out_of_order_and_after_the_end_are_400(url: str) -> None:
    call(url, "reset", {"episode_id": "e", "task": task()})
    status, reply = step(url, "e", 2, "x?")
    assert status == 400 and "out of order (expected 1)" in reply["error"]
    status, reply = step(url, "e", 0, "x?")
    assert status == 400 and "out of order (expected 1)" in reply["error"]
    step(url, "e", 1, "19")
    status, reply = step(url, "e", 2, "19")
    assert status == 400 and "is done" in reply["error"]
    status, reply = call(url, "reset", {"episode_id": "e", "task": task()})
    assert status == 400 and "already exists" in reply["error"]


def test_close_frees_the_episode(url: str, game: HiddenSumGame) -> None:
    call(url, "reset", {"episode_id": "e", "task": task()})
    assert game.open_episodes() == 1
    assert call(url, "close", {"episode_id": "e"}) == (200, {"closed": True})
    assert game.open_episodes() == 0
    assert call(url, "close", {"episode_id": "e"}) == (200, {"closed": False})
    assert step(url, "e", 1, "x?")[0] == 400


def test_the_oldest_episode_is_forgotten_past_max_episodes() -> None:
    game = HiddenSumGame(max_episodes=2)
    for episode in ("a", "b", "c"):
        game.reset({"episode_id": episode, "task": task()})
    assert game.open_episodes() == 2
    assert game.close({"episode_id": "a"}) == {"closed": False}
    assert game.close({"episode_id": "c"}) == {"closed": True}


def test_latency_delays_queries_only() -> None:
    game = HiddenSumGame(latency_s=0.3)
    server, thread = start(game)
    try:
        call(server.url, "reset", {"episode_id": "e", "task": task()})
        started = time.monotonic()
        step(server.url, "e", 1, "x?")
        assert time.monotonic() - started >= 0.3
        started = time.monotonic()
        step(server.url, "e", 2, "19")
        assert time.monotonic() - started < 0.3
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_module_runs_as_a_process() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncrl_calc_env", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        prefix = "asyncrl-calc-env listening on "
        assert line.startswith(prefix), line
        url = line[len(prefix) :]
        assert call(url, "health")[0] == 200
        assert call(url, "reset", {"episode_id": "e", "task": task()})[0] == 200
        assert step(url, "e", 1, "19")[1]["reward"] == 1.0
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def test_an_internal_error_is_500(url: str, game: HiddenSumGame, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        raise RuntimeError("boom")

    monkeypatch.setattr(game, "step", broken)
    assert step(url, "e", 1, "x?") == (500, {"error": "internal error: RuntimeError('boom')"})
    # The server still serves.
    assert call(url, "health")[0] == 200


def test_without_metadata_x_is_the_answer_less_the_prompts_operand(url: str) -> None:
    plain = {"task_id": "t2", "dataset": "hidden_sum", "prompt": "7+x=", "answer": "19"}
    call(url, "reset", {"episode_id": "e", "task": plain})
    status, reply = step(url, "e", 1, "x?")
    assert (status, reply["observation"]["messages"]) == (200, [{"role": "tool", "content": "x=12"}])
    other = {"task_id": "t3", "dataset": "hidden_sum", "prompt": "what is x?", "answer": "19"}
    status, reply = call(url, "reset", {"episode_id": "f", "task": other})
    assert status == 400 and "metadata" in reply["error"]
