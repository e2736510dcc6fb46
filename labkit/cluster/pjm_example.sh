#!/bin/bash
# Lesson 09: the course's experiment under Fujitsu's PJM (pjsub), in the style
# of Wisteria/BDEC-01 Aquarius (University of Tokyo): two GPU nodes, 8 GPUs each.
#
# mpiexec starts labkit/cluster/torchrun_node.sh once per node (-npernode 1); the first
# node listed in $PJM_O_NODEINF hosts the rendezvous.
#
#   pjsub labkit/cluster/pjm_example.sh       (from the course's folder, after make lab)
#
# To change for your site: -g (your group), rscgrp (the resource group, e.g.
# short-a or regular-a on Aquarius), elapse, the module line, and PROCS_PER_NODE.
# Fugaku's nodes have no GPU: there, run the ranks on the CPU (BACKEND=gloo,
# PROCS_PER_NODE set to the processes you want per node, rscgrp=small), and
# check in its guide how a job finds its first node's address.
#PJM -L rscgrp=short-a
#PJM -L node=2
#PJM --mpi proc=2
#PJM -L elapse=00:15:00
#PJM -g gz00
#PJM -j

set -euo pipefail
cd "$PJM_O_WORKDIR"

# An MPI that can start a process on each node (Aquarius: Open MPI for CUDA).
if type module >/dev/null 2>&1; then
    module load aquarius cuda/12.2 ompi-cuda/4.1.5-12.2
fi

procs_per_node=${PROCS_PER_NODE:-8}  # one rank per GPU
backend=${BACKEND:-nccl}
rdzv_port=${RDZV_PORT:-29500}

nnodes=$(awk '!seen[$0]++' "$PJM_O_NODEINF" | wc -l)
head_node=$(head -n 1 "$PJM_O_NODEINF")

mpiexec -machinefile "$PJM_O_NODEINF" -n "$nnodes" -npernode 1 \
    "$PWD/labkit/cluster/torchrun_node.sh" "$nnodes" "$head_node:$rdzv_port" "$PJM_JOBID" \
    "$procs_per_node" "$backend" ${LOCAL_ADDR:+"$LOCAL_ADDR"}
