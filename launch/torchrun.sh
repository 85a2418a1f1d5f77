#!/usr/bin/env bash
# Launch `zcvae train` with torchrun on one node or on several.
#
#   launch/torchrun.sh [--dry-run] [zcvae train flags...]
#
# Environment (defaults in brackets):
#   NPROC_PER_NODE  worker processes per node, usually the GPU count [1]
#   NNODES          nodes [1]; 1 uses --standalone (a private rendezvous on a free port)
#   NODE_RANK       this node's rank, 0..NNODES-1 (several nodes; optional: c10d assigns node ranks itself
#                   and torch warns that it ignores --node_rank; passed on only when set)
#   MASTER_ADDR     host of the c10d rendezvous, reachable from every node (several nodes: required)
#   MASTER_PORT     its port [29500]
#   RDZV_ID         job id shared by all nodes of one run [zcvae]
#   RDZV_CONF       extra rendezvous settings, e.g. join_timeout=900 (seconds to wait for all nodes) []
#   TORCHRUN        the launcher command [torchrun]; e.g. "python -m torch.distributed.run"
#   DRY_RUN=1       same as --dry-run: print the command and exit 0 without running it
#
# One node, 8 GPUs:        NPROC_PER_NODE=8 launch/torchrun.sh --task sort --max-steps 1000
# Two nodes (on each):     NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=node0 NPROC_PER_NODE=8 launch/torchrun.sh ...
set -euo pipefail

dry_run="${DRY_RUN:-0}"
args=()
for arg in "$@"; do
  if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else args+=("$arg"); fi
done

nnodes="${NNODES:-1}"
nproc="${NPROC_PER_NODE:-1}"
read -r -a cmd <<< "${TORCHRUN:-torchrun}"

if [[ "$nnodes" == 1 ]]; then
  cmd+=(--standalone --nproc_per_node "$nproc")
else
  if [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "torchrun.sh: NNODES=$nnodes needs MASTER_ADDR (the rendezvous host, reachable from every node)" >&2
    exit 2
  fi
  cmd+=(--nnodes "$nnodes" --nproc_per_node "$nproc")
  if [[ -n "${NODE_RANK:-}" ]]; then cmd+=(--node_rank "$NODE_RANK"); fi
  cmd+=(--rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR}:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-zcvae}")
  if [[ -n "${RDZV_CONF:-}" ]]; then cmd+=(--rdzv_conf "$RDZV_CONF"); fi
fi
cmd+=(-m zcvae train ${args[@]+"${args[@]}"})

if [[ "$dry_run" == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
