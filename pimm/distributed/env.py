"""Process-group setup and the facts every rank needs (rank, world size, device)."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as torchrun described it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Read torchrun's environment; join the process group when the world has more than one rank.

    NCCL on CUDA (one GPU per local rank), gloo on CPU. World size one gets no process group.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node_rank = int(os.environ.get("GROUP_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=_attempt_store(timeout),
            rank=rank,
            world_size=world_size,
        )
    return DistEnv(rank, local_rank, world_size, local_world_size, node_rank, device)


MMAP_THRESHOLD_BYTES = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory_to_os() -> str | None:
    """Make glibc map every block of MMAP_THRESHOLD_BYTES or more on its own, so that freeing it gives
    it back to the OS. glibc's default threshold grows with the largest block freed (up to 32 MiB on
    64-bit), after which large tensors are carved from a heap that it keeps: FSDP2's all-gathered
    parameters, freed after each module, then stay resident, and its peak RSS exceeded DDP's although
    it holds half the bytes. The price is fresh pages for each large tensor (step time; FSDP2 calls
    this on CPU, where its point is memory; docs/performance.md). MALLOC_MMAP_THRESHOLD_ in the
    environment is the user's own choice and is left as it is; PIMM_HOST_ALLOCATOR=glibc keeps glibc's
    defaults (the baseline of `pimm bench memory`). Returns what was done, for provenance; None where
    there is no glibc (macOS)."""
    if os.environ.get("PIMM_HOST_ALLOCATOR") == "glibc":
        return "glibc defaults (PIMM_HOST_ALLOCATOR=glibc)"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return f"glibc, MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} (from the environment)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return None
    return f"glibc, mmap threshold {MMAP_THRESHOLD_BYTES} bytes (set by pimm for FSDP2: freed tensors go to the OS)"


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The GPU this rank drives. Normally local rank r -> GPU r of the node; when the scheduler
    gives every task its own CUDA_VISIBLE_DEVICES (one GPU visible), that one GPU is index 0."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise RuntimeError(
        f"local rank {local_rank} has no GPU: {visible} visible (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run one process per visible GPU"
    )


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun the agent's store outlives a restart, and the new workers would read the
    dead workers' gloo addresses from it: give every restart a key space of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # plain env:// initialisation
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"pimm/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place (no-op without a process group); returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum of `tensor` over ranks in place (no-op without a process group); returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(value) -> list:
    """Every rank's `value` (small and picklable), in rank order, on every rank ([value] without a
    process group). Every rank must call it."""
    if dist.is_available() and dist.is_initialized():
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, value)
        return box
    return [value]


def broadcast_from_rank0(value):
    """Rank 0's `value` on every rank (a small picklable value such as a list of paths; rank 0's own
    value when there is no process group). Every rank must call it."""
    if dist.is_available() and dist.is_initialized():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value
