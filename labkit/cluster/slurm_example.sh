#!/bin/bash
# Lesson 09: the course's experiment on a real cluster, two nodes x 4 GPUs.
#
# One `srun` task per node runs labkit/cluster/torchrun_node.sh, which starts one
# torchrun agent; the agents meet at a c10d rendezvous on the first node of the
# allocation, and each starts one worker process (rank) per GPU. The script
# that runs is the same `python -m labkit nosync` as on a laptop: labkit reads
# its rank and the world size from torchrun.
#
#   sbatch labkit/cluster/slurm_example.sh    (from the course's folder, after make lab)
#
# Adjust the #SBATCH lines (partition, account, GPU syntax) and PROCS_PER_NODE
# to your site.

#SBATCH --job-name=labkit-nosync
#SBATCH --nodes=2                 # number of machines
#SBATCH --ntasks-per-node=1       # one torchrun agent per machine
#SBATCH --gpus-per-node=4         # GPUs on each machine (--gres=gpu:4 at some sites)
#SBATCH --cpus-per-task=16        # CPU cores for the agent and its 4 workers
#SBATCH --time=00:15:00
#SBATCH --output=labkit-nosync-%j.out

set -euo pipefail

procs_per_node=${PROCS_PER_NODE:-4}  # one rank per GPU
backend=${BACKEND:-nccl}
rdzv_port=${RDZV_PORT:-29500}

# The first node of the allocation hosts the rendezvous.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

# srun starts labkit/cluster/torchrun_node.sh once on every node (one task per node);
# the job id names the rendezvous: the same everywhere, unique to this job.
srun "$PWD/labkit/cluster/torchrun_node.sh" "$SLURM_NNODES" "$head_node:$rdzv_port" \
    "$SLURM_JOB_ID" "$procs_per_node" "$backend" ${LOCAL_ADDR:+"$LOCAL_ADDR"}
