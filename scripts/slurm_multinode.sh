#!/usr/bin/env bash
# slurm_multinode.sh: compose4d across machines, one torchrun agent per node, a c10d rendezvous
# on the first node. Submit with:
#
#     sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_multinode.sh --tp 8 --pp 2 --mode train \
#         --model /shared/llama --data /shared/text --save /shared/ckpt --resume /shared/ckpt
#
# Every argument goes to compose4d.py. --save / --resume must be on a filesystem every node
# sees (a checkpoint is written by several ranks and read by all). The same script runs any
# strategy file: STRATEGY=fsdp.py sbatch ... (HSDP's --replicate then defaults to the number of
# nodes, ZeRO++'s --node-size to the ranks per node).
#SBATCH --job-name=parallelisms
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
STRATEGY=${STRATEGY:-compose4d.py}
NPROC=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PORT:-29500}
# NCCL settings worth knowing (docs/training.md, "Across machines"): uncomment what applies.
# export NCCL_SOCKET_IFNAME=eth0        # the interface the nodes reach each other on
# export NCCL_IB_HCA=mlx5               # InfiniBand adapters to use
# export NCCL_DEBUG=WARN                # INFO to see the rings and transports chosen
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective ends the process
# torchrun's workers share its rendezvous store by default; a restarted group (--max-restarts)
# then reads the previous attempt's addresses and fails to connect (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun --kill-on-bad-exit=1 python -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" --nproc_per_node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    "$STRATEGY" "$@"
