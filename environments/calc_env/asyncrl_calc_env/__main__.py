"""Runs the HiddenSum environment server.

    python -m asyncrl_calc_env --port 8000

With `--port 0` it listens on a free port; the first line it prints names
the URL (`asyncrl-calc-env listening on http://127.0.0.1:PORT`).
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from asyncrl_calc_env.server import DEFAULT_MAX_EPISODES, DEFAULT_MAX_QUERIES, CalcEnvServer, HiddenSumGame


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="asyncrl_calc_env", description="The HiddenSum environment server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument(
        "--max-queries",
        type=int,
        default=DEFAULT_MAX_QUERIES,
        help="queries answered per episode; the next one ends it with reward 0",
    )
    parser.add_argument(
        "--max-episodes",
        type=int,
        default=DEFAULT_MAX_EPISODES,
        help="episodes kept; past it the oldest unclosed one is forgotten",
    )
    parser.add_argument("--latency-ms", type=float, default=0.0, help="wait before answering each query")
    parser.add_argument("--log-requests", action="store_true", help="log each request to stderr")
    args = parser.parse_args(argv)
    if args.max_queries < 0 or args.max_episodes < 1 or args.latency_ms < 0:
        parser.error("--max-queries and --latency-ms must be >= 0, --max-episodes >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    game = HiddenSumGame(
        max_queries=args.max_queries,
        max_episodes=args.max_episodes,
        latency_s=args.latency_ms / 1000.0,
    )
    try:
        server = CalcEnvServer((args.host, args.port), game, log_requests=args.log_requests)
    except OSError as e:
        sys.exit(f"asyncrl-calc-env: cannot listen on {args.host}:{args.port}: {e}")

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"asyncrl-calc-env listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
