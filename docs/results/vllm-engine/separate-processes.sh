#!/usr/bin/env bash
# The vLLM main job with every role as its own process over a real nats-server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
A=target/debug/asyncrl
OUT=runs/arith-eta4-vllm-nats
# Role configs and logs go to /tmp/nrun.
rm -rf "$OUT" /tmp/nrun/js; mkdir -p /tmp/nrun/js
.venv/bin/nats-server -js -p 4333 -sd /tmp/nrun/js > /tmp/nrun/nats.log 2>&1 &
NATS=$!
sleep 1
B=nats://127.0.0.1:4333
for role in coordinator buffer learner worker; do
  sed "s#^output_dir = \"runs/arith-eta4-vllm\"#output_dir = \"$OUT\"#; s#^listen = \"127.0.0.1:9465\"#listen = \"127.0.0.1:0\"#; s#runs/arith-eta4-vllm/engine-weights#$OUT/engine-weights#" examples/arith-vllm.toml > /tmp/nrun/$role.toml
done
$A coordinator --config /tmp/nrun/coordinator.toml --bus $B > /tmp/nrun/coordinator.log 2>&1 & C=$!
$A buffer --config /tmp/nrun/buffer.toml --bus $B > /tmp/nrun/buffer.log 2>&1 & BU=$!
$A worker --config /tmp/nrun/worker.toml --bus $B > /tmp/nrun/worker.log 2>&1 & W=$!
started=$SECONDS
$A learner --config /tmp/nrun/learner.toml --bus $B > /tmp/nrun/learner.log 2>&1
echo "learner exited after $((SECONDS - started)) s"
kill -TERM $W $BU $C; wait $W $BU $C || true
kill $NATS
echo done
