"""Step 0: start 4 processes on this machine and add up one number from each with all_reduce.

    python 0_torch_dist.py            # 4 processes, CPU, gloo
    python 0_torch_dist.py --nproc 2

Every process (a "rank") holds a tensor with its own rank in it; after all_reduce(SUM) every rank
holds 0 + 1 + 2 + 3 = 6. That is the one collective data-parallel training is built on.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from course_common import end_distributed, free_port, say


def worker(rank: int, world_size: int) -> None:
    # MASTER_ADDR and MASTER_PORT (set below) tell every rank where rank 0 waits for the others.
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tensor = torch.tensor([float(rank)])
    say(f"rank {rank}/{world_size}: before all_reduce: {tensor.item():.0f}")
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # every rank ends with the sum
    expected = world_size * (world_size - 1) / 2
    say(f"rank {rank}/{world_size}: after all_reduce: {tensor.item():.0f} (expected {expected:.0f})")
    assert tensor.item() == expected
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--port", type=int, default=0, help="0: pick a free port")
    args = parser.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port or free_port())
    mp.spawn(worker, args=(args.nproc,), nprocs=args.nproc)  # one new Python process per rank
    print(f"all {args.nproc} processes agreed on the sum", flush=True)
