#!/usr/bin/env bash
# One node of a multi-node torshmon-monitored job: this node's agent, then this node's
# share of the ranks under torchrun. Run it on every node (same NNODES, MASTER_ADDR and
# JOB; NODE_RANK 0..NNODES-1); the aggregator runs once, anywhere the nodes reach:
#
#   openssl rand -hex 16 > token      # copy the same file to every node
#   torshmon aggregator --host 0.0.0.0 --token-file token
#
#   # on node 0 (also the rendezvous host) and node 1:
#   AGGREGATOR_URL=http://head:9470 TOKEN_FILE=token NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 \
#     deploy/multinode/run-node.sh --steps 1000
#   AGGREGATOR_URL=http://head:9470 TOKEN_FILE=token NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 \
#     deploy/multinode/run-node.sh --steps 1000
#
# Settings (environment): AGGREGATOR_URL, TOKEN_FILE, NNODES, NODE_RANK, MASTER_ADDR
# (required); NODE (this node's name in torshmon, default the hostname), NPROC_PER_NODE
# (2), MASTER_PORT (29500), JOB (multinode), METRICS_HOST and METRICS_PORT (the agent's
# node /metrics, 127.0.0.1:9465; 0.0.0.0 for a Prometheus elsewhere), RUN_DIR (a private folder for the agent's
# socket and spool, default $XDG_RUNTIME_DIR/torshmon or /tmp/torshmon-$UID), TRAIN
# (the training script, default deploy/train.py beside this one). Arguments go to TRAIN.
# See docs/multi-node.md.
set -euo pipefail

: "${AGGREGATOR_URL:?set AGGREGATOR_URL, e.g. http://head:9470}"
: "${TOKEN_FILE:?set TOKEN_FILE to the file holding the aggregator's token}"
: "${NNODES:?set NNODES, the number of nodes}"
: "${NODE_RANK:?set NODE_RANK, this node's index 0..NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR, the rendezvous host (node 0)}"
NODE="${NODE:-$(hostname)}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
MASTER_PORT="${MASTER_PORT:-29500}"
JOB="${JOB:-multinode}"
METRICS_HOST="${METRICS_HOST:-127.0.0.1}"
METRICS_PORT="${METRICS_PORT:-9465}"
RUN_DIR="${RUN_DIR:-${XDG_RUNTIME_DIR:-/tmp}/torshmon-$(id -u)}"
TRAIN="${TRAIN:-$(dirname "$0")/../train.py}"
TORSHMON="${TORSHMON:-torshmon}"
TORCHRUN="${TORCHRUN:-torchrun}"

mkdir -p -m 0700 "$RUN_DIR"
socket="$RUN_DIR/agent.sock"

# The agent names the node (--node) in everything it forwards; its spool keeps what the
# aggregator has not acknowledged, so a restarted agent sends it on.
"$TORSHMON" agent --node "$NODE" --socket "$socket" --spool "$RUN_DIR/spool.db" \
  --aggregator "$AGGREGATOR_URL" --token-file "$TOKEN_FILE" \
  --metrics-host "$METRICS_HOST" --metrics-port "$METRICS_PORT" &
agent=$!
trap 'kill -TERM "$agent" 2>/dev/null; wait "$agent" || true' EXIT
for _ in $(seq 100); do
  [[ -S "$socket" ]] && break
  kill -0 "$agent" || { echo "run-node.sh: the agent exited" >&2; exit 1; }
  sleep 0.1
done
[[ -S "$socket" ]] || { echo "run-node.sh: no agent socket at $socket" >&2; exit 1; }

# Every rank's probe finds the agent, the job and its node through the environment.
export TORSHMON_AGENT_SOCKET="$socket" TORSHMON_JOB="$JOB" TORSHMON_NODE="$NODE"
"$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$TRAIN" "$@"
