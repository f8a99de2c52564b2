#!/usr/bin/env bash
# Run a course script on every node of the current Slurm allocation: one torchrun per node, meeting
# at a c10d rendezvous on the first node of the allocation.
#
#   salloc --nodes=2 ...                          # see README.md for the full line
#   ./multinode_setup_and_run.sh 7_mnist_ddp_pt_multinode.py --epochs 1
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per node (default: the GPUs on the node, else 1)
#   PYTHON          the Python that has torch (default: python)
#   RDZV_PORT       rendezvous port on the head node (default: derived from SLURM_JOB_ID)
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 <file>.py [arguments for the script...]" >&2
    exit 2
fi
script=$1
shift
if [[ -z ${SLURM_JOB_ID:-} || -z ${SLURM_JOB_NODELIST:-} ]]; then
    echo "$0: not inside a Slurm allocation (SLURM_JOB_ID is not set): start one with salloc or sbatch first" >&2
    exit 2
fi
if [[ ! -f $script ]]; then
    echo "$0: $script does not exist (run this from examples/course, or give the script's path)" >&2
    exit 2
fi

# The head node is the first host of the allocation; every torchrun must reach it by address.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# Slurm knows each node's address (NodeAddr) even where the node names are not in DNS.
head_addr=$(scontrol show node "$head_node" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2 || true)
is_ipv4() { [[ $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; }
if [[ -z $head_addr ]] || ! is_ipv4 "$head_addr"; then
    # NodeAddr is a host name (or absent): resolve it, or the node name, to IPv4.
    head_addr=$(getent ahostsv4 "${head_addr:-$head_node}" | awk 'NR == 1 {print $1}')
fi
if [[ -z $head_addr ]] || ! is_ipv4 "$head_addr"; then
    echo "$0: could not resolve the head node $head_node to an IPv4 address" >&2
    exit 1
fi
# A port per job, so that two jobs sharing a head node do not meet at the same rendezvous.
port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

if [[ -n ${NPROC_PER_NODE:-} ]]; then
    nproc=$NPROC_PER_NODE
elif command -v nvidia-smi >/dev/null && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ $gpus -gt 0 ]]; then
    nproc=$gpus
else
    nproc=1
fi
nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
python=${PYTHON:-python}

echo "head node $head_node ($head_addr), rendezvous $head_addr:$port, $nnodes node(s) x $nproc process(es)"
# One task per node, each with all the CPUs Slurm gave this job on its node; --kill-on-bad-exit ends
# the others when one node fails, instead of leaving them waiting at the next collective.
srun --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
    --kill-on-bad-exit=1 \
    "$python" -m torch.distributed.run \
        --nnodes="$nnodes" --nproc-per-node="$nproc" \
        --rdzv-backend=c10d --rdzv-endpoint="$head_addr:$port" --rdzv-id="$SLURM_JOB_ID" \
        "$script" "$@"
