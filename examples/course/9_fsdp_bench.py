"""Step 9: FSDP against DDP on a model large enough to matter: what each rank holds, and what a step costs.

    torchrun --standalone --nproc-per-node 4 9_fsdp_bench.py --strategy ddp
    torchrun --standalone --nproc-per-node 4 9_fsdp_bench.py --strategy fsdp
    python 9_fsdp_bench.py --help     # --width/--depth size the model, --max-steps the run

The model is an MLP on flattened MNIST images, --depth hidden layers of --width units (the default,
8 x 2048, has 33.6M parameters: 134 MB in fp32), trained with Adam, which keeps two more tensors per
parameter. DDP keeps all of it on every rank: parameters, gradients, Adam's two moments, 4 x 134 MB.
FSDP (FSDP2's `fully_shard`, as pimm uses it) keeps 1/world_size of each on each rank and gathers a
layer's full parameters only while that layer runs, so the per-rank state shrinks by the world size,
paid for with an all_gather per layer forward and backward and a reduce_scatter of the gradients.

Every rank measures its own parameter, gradient and optimizer-state bytes, its peak memory (peak RSS
of the process on CPU, torch.cuda.max_memory_allocated on CUDA) and its time per step; rank 0 prints
them as a table. Run both strategies with the same flags and compare the two tables.
"""

import contextlib
import ctypes
import json
import resource
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import (
    StepClock,
    backend_for,
    device_for,
    end_distributed,
    load_mnist,
    log,
    torchrun_ranks,
    training_parser,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

MB = 1e6
# Initialising sharded parameters on a CPU mesh is fine here; torch warns that DTensor's RNG is made for GPUs.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(28 * 28, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x.flatten(1)))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def apply_fsdp(model: MLP, world_size: int, device: torch.device) -> nn.Module:
    """Shard every hidden layer, then the rest (input and output layers) as one more group."""
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)  # this layer's parameters are all_gathered just for its forward/backward
    fully_shard(model, mesh=mesh)
    return model


def apply_ddp(model: MLP, device: torch.device) -> nn.Module:
    # gradient_as_bucket_view: the gradients live in DDP's all_reduce buckets instead of a second copy
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: its own shard when it is a DTensor (FSDP), else all of it."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def return_freed_memory_to_the_os() -> None:
    """Make glibc serve every allocation over 1 MiB with its own mmap, given back to the OS when freed.

    By default glibc raises that threshold after the first large free, and FSDP's per-layer gather
    buffers then pile up in the heap: the peak RSS would measure the allocator, not the strategy.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the RSS numbers are rougher, that is all
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # -3 is M_MMAP_THRESHOLD


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MB


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # Linux reports KiB


def main() -> None:
    parser = training_parser(__doc__.splitlines()[0], max_steps=20, lr=1e-3, log_every=5, batch_size=64)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the measurements here")
    args = parser.parse_args()
    rank, local_rank, world_size = torchrun_ranks("9_fsdp_bench.py")
    device = device_for(args.device, local_rank)
    if device.type == "cpu":
        return_freed_memory_to_the_os()
    dist.init_process_group(backend_for(device))
    rss_before_model = rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    torch.manual_seed(args.seed)
    if args.strategy == "fsdp":
        with torch.device("meta"):  # shapes only: no rank ever holds the full model, not even to initialise it
            model = MLP(args.width, args.depth)
        model = apply_fsdp(model, world_size, device)
        model.to_empty(device=device)  # allocate this rank's shards...
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()  # ...and initialise them in place
    else:
        model = apply_ddp(MLP(args.width, args.depth).to(device), device)
    full_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel() is its full size
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_set = load_mnist(args.data_dir, "train", rank)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    log(f"{args.strategy} on {world_size} ranks ({device.type}): MLP {args.depth} x {args.width}, "
        f"{full_params / 1e6:.1f}M parameters ({full_params * 4 / MB:.0f} MB in fp32), Adam", rank=rank)

    clock, step, start = StepClock(device), 0, time.perf_counter()
    while step < args.max_steps:
        sampler.set_epoch(step)
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            clock.tick()
            if step % args.log_every == 0:
                log(f"step {step}: loss {loss.item():.4f}", rank=rank)
            if step == args.max_steps:
                break
    per_step = clock.seconds_per_step() or (time.perf_counter() - start) / step

    # What this rank holds now, after a step: its parameters, their gradients, Adam's exp_avg and exp_avg_sq.
    mine = {
        "rank": rank,
        "params_mb": sum(local_bytes(p) for p in model.parameters()) / MB,
        "grads_mb": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None) / MB,
        "optim_mb": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0) / MB,  # leave out Adam's scalar step counters
        "peak_mb": peak_mb(device),
        "rss_before_model_mb": rss_before_model,
        "ms_per_step": per_step * 1000,
    }
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        peak_name = "peak RSS" if device.type == "cpu" else "max allocated"
        print(f"{'rank':>4} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {peak_name + ' MB':>17} {'ms/step':>8}")
        for r in everyone:
            print(f"{r['rank']:>4} {r['params_mb']:>10.1f} {r['grads_mb']:>9.1f} {r['optim_mb']:>9.1f} "
                  f"{r['peak_mb']:>17.1f} {r['ms_per_step']:>8.1f}")
        state = everyone[0]["params_mb"] + everyone[0]["grads_mb"] + everyone[0]["optim_mb"]
        full_state = full_params * 4 * 4 / MB  # parameters + gradients + two Adam moments, fp32
        print(f"{args.strategy}: each rank holds {state:.1f} MB of model state "
              f"({state / full_state:.2f} of the full {full_state:.1f} MB)", flush=True)
        if device.type == "cpu":
            print(f"(peak RSS includes about {everyone[0]['rss_before_model_mb']:.0f} MB that the process "
                  "held before the model was built: Python, torch, the data)", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"strategy": args.strategy, "world_size": world_size,
                                             "parameters": full_params, "ranks": everyone}, indent=1))
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    main()
