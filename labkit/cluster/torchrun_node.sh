#!/bin/bash
# One node's part of the course's cluster examples (slurm_example.sh,
# pbs_example.sh, pjm_example.sh, lesson 09): the scheduler's launcher (srun,
# mpirun, mpiexec) runs this once on every node. It starts one torchrun agent,
# which meets the other nodes' agents at the c10d rendezvous on the first node
# and starts one worker process (rank) per GPU; every rank runs the same
# `python -m labkit nosync` as on a laptop, and rank 0 writes the result.
#
#   torchrun_node.sh NNODES HEAD_NODE:PORT JOB_ID PROCS_PER_NODE BACKEND [LOCAL_ADDR]
#
# Arguments rather than environment variables: MPI launchers do not pass the
# job script's environment on to the other nodes unless told to.
# LOCAL_ADDR: the address this node gives the others (torchrun --local-addr);
# by default its host name. Needed where the host name does not reach the
# node's fast network, or, in the course's tests, where every "node" is one
# machine's loopback.
set -euo pipefail
if [ $# -lt 5 ]; then
    echo "usage: $0 NNODES HEAD_NODE:PORT JOB_ID PROCS_PER_NODE BACKEND [LOCAL_ADDR]" >&2
    exit 2
fi
nnodes=$1 endpoint=$2 job_id=$3 procs_per_node=$4 backend=$5 local_addr=${6:-}

# The course's environment, made once with `make lab` (see README), two folders up.
course=$(cd "$(dirname "$0")/../.." && pwd)

exec "$course/.venv/bin/python" -m torch.distributed.run \
    --nnodes "$nnodes" \
    --nproc-per-node "$procs_per_node" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$endpoint" \
    --rdzv-id "$job_id" \
    ${local_addr:+--local-addr "$local_addr"} \
    --max-restarts 0 \
    -m labkit nosync --backend "$backend" --accum 4 --hidden 1024 --depth 3 \
    --json "nosync-$job_id.json"
