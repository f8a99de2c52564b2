"""Step 1: the all_reduce of step 0 on GPUs: one process per GPU, NCCL moving the data GPU to GPU.

    python 1_torch_dist_gpu.py                # one process per visible GPU, at most 4
    python 1_torch_dist_gpu.py --nproc 2

Without a GPU it says so and exits 0: run 0_torch_dist.py for the CPU version.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from course_common import end_distributed, free_port, say


def worker(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)  # rank r drives GPU r; NCCL needs each rank on its own device
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    tensor = torch.full((4,), float(rank), device="cuda")  # lives in GPU memory
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    expected = world_size * (world_size - 1) / 2
    say(f"rank {rank}/{world_size} on {torch.cuda.get_device_name(rank)}: after all_reduce: "
        f"{tensor.tolist()} (expected {expected:.0f} everywhere)")
    assert torch.all(tensor == expected).item()
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="default: the number of GPUs, at most 4")
    parser.add_argument("--port", type=int, default=0, help="0: pick a free port")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing to run here. "
              "Step 0 (0_torch_dist.py) does the same all_reduce on the CPU.", flush=True)
        sys.exit(0)
    gpus = torch.cuda.device_count()
    nproc = args.nproc or min(gpus, 4)
    if nproc > gpus:
        sys.exit(f"--nproc {nproc} needs {nproc} GPUs, but {gpus} are visible")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port or free_port())
    mp.spawn(worker, args=(nproc,), nprocs=nproc)
    print(f"all {nproc} GPUs agreed on the sum", flush=True)
