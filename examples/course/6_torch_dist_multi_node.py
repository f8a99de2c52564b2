"""Step 6: the all_reduce of step 0 across nodes. torchrun starts the processes, one torchrun per node.

    torchrun --standalone --nproc-per-node 4 6_torch_dist_multi_node.py     # one machine
    ./multinode_setup_and_run.sh 6_torch_dist_multi_node.py                 # every node of a Slurm allocation

Each torchrun meets the others at the c10d rendezvous (--rdzv-endpoint HOST:PORT), they agree on the
ranks, and torchrun hands each process RANK, LOCAL_RANK and WORLD_SIZE in its environment; so
init_process_group needs no arguments but the backend. Every rank prints where it runs; rank 0 prints
the node list and the all_reduce result.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
from course_common import backend_for, device_for, end_distributed, log, say, torchrun_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args()
    rank, local_rank, world_size = torchrun_ranks("6_torch_dist_multi_node.py")
    device = device_for(args.device, local_rank)
    dist.init_process_group(backend_for(device))  # MASTER_ADDR/PORT, RANK, WORLD_SIZE come from torchrun
    node = int(os.environ.get("GROUP_RANK", 0))  # torchrun's name for the node's rank
    host = socket.gethostname()
    say(f"rank {rank}/{world_size}: node {node}, local rank {local_rank}, host {host}, device {device}")

    tensor = torch.tensor([float(rank)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    places = [None] * world_size
    dist.all_gather_object(places, (node, host))  # every rank learns every rank's node and host
    expected = world_size * (world_size - 1) / 2
    nodes = sorted(set(places))
    log(f"{len(nodes)} node(s): " + ", ".join(f"node {n} = {h}" for n, h in nodes), rank=rank)
    log(f"all_reduce over {world_size} ranks: {tensor.item():.0f} (expected {expected:.0f})", rank=rank)
    assert tensor.item() == expected
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    main()
