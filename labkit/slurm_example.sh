#!/bin/bash
# Lesson 09: the course's experiment on a real cluster, two nodes x 4 GPUs.
#
# One `srun` task per node starts one torchrun agent; the agents meet at a
# c10d rendezvous on the first node of the allocation, and each starts
# --nproc-per-node worker processes (ranks), one per GPU. The script that
# runs is the same `python -m labkit nosync` as on a laptop: labkit reads its
# rank and the world size from torchrun.
#
#   sbatch docs/slurm_example.sh
#
# Adjust the #SBATCH lines (partition, account, GPU syntax) to your site.

#SBATCH --job-name=labkit-nosync
#SBATCH --nodes=2                 # number of machines
#SBATCH --ntasks-per-node=1       # one torchrun agent per machine
#SBATCH --gpus-per-node=4         # GPUs on each machine (--gres=gpu:4 at some sites)
#SBATCH --cpus-per-task=16        # CPU cores for the agent and its 4 workers
#SBATCH --time=00:15:00
#SBATCH --output=labkit-nosync-%j.out

set -euo pipefail

# The first node of the allocation hosts the rendezvous.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
rdzv_port=29500

# The course's environment (see README: make lab TORCH="torch==... --index-url ...").
source .venv/bin/activate

# srun starts the same command on every node; --rdzv-id must be the same
# everywhere and unique to this job, so the job id is used.
srun torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node 4 \
    --rdzv-backend c10d \
    --rdzv-endpoint "$head_node:$rdzv_port" \
    --rdzv-id "$SLURM_JOB_ID" \
    --max-restarts 0 \
    -m labkit nosync --backend nccl --accum 4 --hidden 1024 --depth 3 \
    --json "nosync-$SLURM_JOB_ID.json"
