#!/usr/bin/env python3
"""An example external reward service for asyncrl, in Python with grpcio.

It implements `asyncrl.v1.RewardService` from protos/proto/asyncrl/v1/reward.proto.
The stubs are generated at start-up with grpcio-tools, so the .proto file in
the repository stays the only definition of the contract.

Reward: 1.0 if the completion, stripped, equals the reference answer, else
0.0 (the same rule as the built-in `arith` verifier); a task whose answer is
"FAIL" gets a gRPC error, and one whose answer is "SLOW" sleeps past any
sensible timeout, so that callers can test their retry paths.

    pip install grpcio grpcio-tools
    python examples/reward_service/server.py --port 50061
"""

import argparse
import importlib
import pathlib
import sys
import tempfile
import time
from concurrent import futures

import grpc
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "proto"


def load_stubs():
    out = pathlib.Path(tempfile.mkdtemp(prefix="asyncrl-reward-stubs-"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_DIR / "asyncrl" / "v1" / "reward.proto"),
        ]
    )
    if rc != 0:
        sys.exit(f"protoc failed with exit code {rc}")
    sys.path.insert(0, str(out))
    pb2 = importlib.import_module("asyncrl.v1.reward_pb2")
    pb2_grpc = importlib.import_module("asyncrl.v1.reward_pb2_grpc")
    return pb2, pb2_grpc


def make_servicer(pb2, pb2_grpc):
    class RewardService(pb2_grpc.RewardServiceServicer):
        def Score(self, request, context):
            if request.answer == "FAIL":
                context.abort(grpc.StatusCode.UNAVAILABLE, "asked to fail")
            if request.answer == "SLOW":
                time.sleep(30)
            right = request.completion.strip() == request.answer
            return pb2.ScoreReply(
                reward=1.0 if right else 0.0,
                detail=f"{len(request.completion_token_ids)} tokens, exact={right}",
            )

    return RewardService()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    pb2, pb2_grpc = load_stubs()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers))
    pb2_grpc.add_RewardServiceServicer_to_server(make_servicer(pb2, pb2_grpc), server)
    bound = server.add_insecure_port(f"{args.host}:{args.port}")
    if bound == 0:
        sys.exit(f"cannot listen on {args.host}:{args.port}")
    server.start()
    print(f"reward service listening on {args.host}:{bound}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
