#!/usr/bin/env bash
# Launch `zcvae train --engine deepspeed` with the DeepSpeed launcher, on one node or several.
#
#   launch/deepspeed.sh [--dry-run] [zcvae train flags...]
#
# Environment (defaults in brackets):
#   NUM_GPUS        processes (GPUs) per node [$NPROC_PER_NODE, else 1]
#   NNODES          nodes [1]; the first NNODES hosts of HOSTFILE
#   HOSTFILE        MPI-style hostfile, lines like "worker-1 slots=8" (several nodes: required; see
#                   launch/hostfile.example). Without it on one node the launcher uses the local GPUs.
#   MASTER_ADDR     address of the first node [the launcher infers it with `hostname -I`]
#   MASTER_PORT     [29500]
#   NO_SSH=1        start the launcher on every node yourself instead of over pdsh/ssh; needs NODE_RANK and
#                   MASTER_ADDR on each node
#   NODE_RANK       this node's rank, 0..NNODES-1 (with NO_SSH=1)
#   INCLUDE/EXCLUDE hosts/slots to use or skip, e.g. "worker-1:0,1" (deepspeed --include/--exclude)
#   DS_CONFIG       DeepSpeed JSON config [ds_configs/zero2.json]
#   DEEPSPEED       the launcher command [deepspeed]
#   DRY_RUN=1       same as --dry-run: print the command and exit 0 without running it
#
# Variables the remote nodes need (NCCL_SOCKET_IFNAME, PYTHONPATH, ...) go in a `.deepspeed_env` file
# (NAME=value lines) in the current directory or $HOME: the launcher exports them on every node.
# --no_local_rank: rank information arrives through the environment (LOCAL_RANK, RANK, WORLD_SIZE), and
# `zcvae train` has no --local_rank flag.
set -euo pipefail

dry_run="${DRY_RUN:-0}"
args=()
for arg in "$@"; do
  if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else args+=("$arg"); fi
done

nnodes="${NNODES:-1}"
num_gpus="${NUM_GPUS:-${NPROC_PER_NODE:-1}}"
ds_config="${DS_CONFIG:-ds_configs/zero2.json}"
read -r -a cmd <<< "${DEEPSPEED:-deepspeed}"

if [[ -n "${HOSTFILE:-}" ]]; then
  if [[ ! -r "$HOSTFILE" ]]; then
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE is not a readable file" >&2
    exit 2
  fi
  cmd+=(--hostfile "$HOSTFILE")
elif [[ "$nnodes" != 1 ]]; then
  echo "deepspeed.sh: NNODES=$nnodes needs HOSTFILE (lines like 'worker-1 slots=8')" >&2
  exit 2
fi
cmd+=(--num_nodes "$nnodes" --num_gpus "$num_gpus")
if [[ -n "${INCLUDE:-}" ]]; then cmd+=(--include "$INCLUDE"); fi
if [[ -n "${EXCLUDE:-}" ]]; then cmd+=(--exclude "$EXCLUDE"); fi
if [[ -n "${MASTER_ADDR:-}" ]]; then cmd+=(--master_addr "$MASTER_ADDR"); fi
cmd+=(--master_port "${MASTER_PORT:-29500}")
if [[ "${NO_SSH:-0}" == 1 ]]; then
  if [[ -z "${NODE_RANK:-}" || -z "${MASTER_ADDR:-}" ]]; then
    echo "deepspeed.sh: NO_SSH=1 needs NODE_RANK and MASTER_ADDR on every node" >&2
    exit 2
  fi
  cmd+=(--no_ssh --node_rank "$NODE_RANK")
fi
if [[ "$dry_run" != 1 && ! -r "$ds_config" ]]; then
  echo "deepspeed.sh: DS_CONFIG=$ds_config not found (run from the repository root or set DS_CONFIG)" >&2
  exit 2
fi
cmd+=(--no_local_rank --module zcvae train --engine deepspeed --deepspeed-config "$ds_config"
      ${args[@]+"${args[@]}"})

if [[ "$dry_run" == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
