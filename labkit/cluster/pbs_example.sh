#!/bin/bash
# Lesson 09: the course's experiment under PBS Professional, in the style of
# ABCI 3.0 (AIST): two whole nodes (resource type rt_HF, 8 GPUs each).
#
# mpirun starts labkit/cluster/torchrun_node.sh once per node (-map-by ppr:1:node, as
# ABCI's MPI guide starts one process per node); the first node listed in
# $PBS_NODEFILE hosts the rendezvous.
#
#   qsub labkit/cluster/pbs_example.sh        (from the course's folder, after make lab)
#
# To change for your site: -P (your ABCI group), -q (the resource type),
# walltime, the module line (ABCI 3.0's module names), and PROCS_PER_NODE.
# On ABCI, create the course's .venv once with a Python module loaded, e.g.
# `module load python/3.12/3.12.9` then `make lab PYTHON=python3 TORCH=...`.
#PBS -P grpname
#PBS -q rt_HF
#PBS -l select=2
#PBS -l walltime=00:15:00
#PBS -N labkit-nosync
#PBS -j oe

set -euo pipefail
cd "$PBS_O_WORKDIR"

# Batch jobs on ABCI read the module set-up first. hpcx provides mpirun; torch's
# wheel brings its own CUDA libraries and NCCL.
if [ -f /etc/profile.d/modules.sh ]; then
    source /etc/profile.d/modules.sh
    module load hpcx/2.20
fi

procs_per_node=${PROCS_PER_NODE:-8}  # one rank per GPU
backend=${BACKEND:-nccl}
rdzv_port=${RDZV_PORT:-29500}

# With select=N (one MPI process per chunk), $PBS_NODEFILE has one line per
# node, the first node first.
nnodes=$(awk '!seen[$0]++' "$PBS_NODEFILE" | wc -l)
head_node=$(head -n 1 "$PBS_NODEFILE")

mpirun -np "$nnodes" -map-by ppr:1:node -hostfile "$PBS_NODEFILE" \
    "$PWD/labkit/cluster/torchrun_node.sh" "$nnodes" "$head_node:$rdzv_port" "$PBS_JOBID" \
    "$procs_per_node" "$backend" ${LOCAL_ADDR:+"$LOCAL_ADDR"}
