"""What every course script shares: the command-line flags, device choice, MNIST loading and the small model.

The scripts import this module from their own folder; nothing here knows about distributed training
except `device_for` (which device a rank uses) and `free_port` (a port for a one-machine rendezvous).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # over the 60,000 MNIST training images
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def say(*parts: object) -> None:
    """Print one line from any rank in a single write, flushed at once: lines of processes that share
    one pipe then never cut into each other (print writes the text and the newline separately)."""
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def log(*parts: object, rank: int = 0) -> None:
    """Print from rank 0 only (`say`), flushed at once (a distributed job's output is otherwise held in buffers)."""
    if rank == 0:
        say(*parts)


# -- flags ----------------------------------------------------------------------------------------------------


def training_parser(description: str, **defaults: object) -> argparse.ArgumentParser:
    """The flags of every training script; `defaults` overrides a flag's default (e.g. nproc=4)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA (with NCCL) when a GPU is there, else CPU (with gloo)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="folder with the MNIST IDX files (train-images-idx3-ubyte[.gz], ...)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of one process (see --lr-scaling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20, help="print the loss every this many steps")
    p.add_argument("--metrics", type=Path, default=None, help="write step, samples seen, loss, lr as JSON lines")
    p.add_argument("--save", type=Path, default=None, help="save the final weights (rank 0) to this file")
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="record a torch.profiler trace of a few steps into this folder (open it in Perfetto)")
    p.add_argument("--no-eval", action="store_true", help="skip the test-set accuracy at the end")
    for key, value in defaults.items():
        p.set_defaults(**{key: value})
    return p


def add_nproc(p: argparse.ArgumentParser, default: int = 4) -> None:
    p.add_argument("--nproc", type=int, default=default, help="how many processes this script starts")
    p.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (0: pick a free one)")


def add_lr_scaling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr-scaling", choices=["none", "linear"], default="none",
                   help="linear: lr x world size, since N processes take N times fewer, N times larger steps")


def scaled_lr(base_lr: float, world_size: int, rule: str) -> float:
    """The learning rate for `world_size` processes that each use the batch size of the one-process run."""
    return base_lr * world_size if rule == "linear" else base_lr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_on_this_machine(worker: Callable, nproc: int, port: int, *args: object) -> None:
    """Run worker(rank, nproc, *args) in `nproc` new processes that meet at 127.0.0.1:port (0: a free port).

    What 0_torch_dist.py spells out: init_process_group finds rank 0 through MASTER_ADDR and MASTER_PORT.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port or free_port())
    mp.spawn(worker, args=(nproc, *args), nprocs=nproc)


# -- device ---------------------------------------------------------------------------------------------------


def device_for(choice: str, local_rank: int = 0) -> torch.device:
    """The device of the process with this local rank: cuda:<local_rank> or cpu. `choice` is --device."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False on this machine: "
                         "run with --device cpu (or --device auto)")
    if local_rank >= torch.cuda.device_count():
        raise SystemExit(f"local rank {local_rank} needs GPU {local_rank}, but only {torch.cuda.device_count()} "
                         "are visible: start at most one process per GPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL talks GPU to GPU; gloo moves CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a wall-clock reading means what it says."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- data -----------------------------------------------------------------------------------------------------


def _read_idx(path: Path) -> torch.Tensor:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, count = struct.unpack(">II", data[:8])
    if magic == 2051:  # images: count, rows, cols, then bytes
        rows, cols = struct.unpack(">II", data[8:16])
        return torch.frombuffer(bytearray(data[16:]), dtype=torch.uint8).reshape(count, rows, cols)
    if magic == 2049:  # labels: count, then bytes
        return torch.frombuffer(bytearray(data[8:]), dtype=torch.uint8).reshape(count)
    raise ValueError(f"{path} is not an MNIST IDX file (magic number {magic}, expected 2051 or 2049)")


def _find_idx(data_dir: Path, name: str) -> Path | None:
    for folder in (data_dir, data_dir / "MNIST" / "raw"):  # the second is torchvision's layout
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _mnist_from_idx(data_dir: Path, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    paths = [_find_idx(data_dir, name) for name in IDX_FILES[split]]
    if None in paths:
        return None
    return _read_idx(paths[0]), _read_idx(paths[1])


def _mnist_from_torchvision(data_dir: Path, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        from torchvision.datasets import MNIST
    except ImportError:
        return None
    try:
        ds = MNIST(str(data_dir), train=split == "train", download=True)
    except Exception as exc:  # no network: fall through to the bundled digits
        print(f"torchvision could not download MNIST into {data_dir}: {exc}", flush=True)
        return None
    return ds.data, ds.targets


def _digits_upsampled(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 real 8x8 scans, drawn like MNIST: 20x20 digit centred in 28x28, 0-255."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("no MNIST found and scikit-learn is not installed for the fallback: pass --data-dir "
                         "with the MNIST IDX files, or `pip install scikit-learn`") from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    images = F.interpolate(images[:, None], size=(20, 20), mode="bilinear", align_corners=False)
    images = F.pad(images, (4, 4, 4, 4))[:, 0]
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    labels = torch.tensor(digits.target, dtype=torch.uint8)
    is_test = torch.arange(len(labels)) % 6 == 0  # a fixed 1-in-6 test split: 300 test, 1,497 train
    keep = is_test if split == "test" else ~is_test
    return images[keep], labels[keep]


def load_mnist_raw(
    data_dir: Path | None, split: str = "train", rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(images uint8 [N, 28, 28], labels uint8 [N], where they came from) for split "train" or "test".

    Real MNIST from `data_dir` (IDX files, gzipped or not) or torchvision's download when it can;
    otherwise scikit-learn's bundled digits, with a log line saying so.
    """
    found = None
    if data_dir is not None:
        found = _mnist_from_idx(data_dir, split) or _mnist_from_torchvision(data_dir, split)
        if found is not None:
            return found[0], found[1], f"MNIST from {data_dir}"
    images, labels = _digits_upsampled(split)
    where = f"in {data_dir}" if data_dir else "(no --data-dir given)"
    if split == "train":
        log(f"MNIST not found {where}: using scikit-learn's bundled handwritten digits instead (1,797 8x8 scans "
            "upsampled to 28x28; 1,497 train, 300 test). For real MNIST pass --data-dir with "
            "train-images-idx3-ubyte[.gz] and the three other IDX files.", rank=rank)
    return images, labels, "sklearn digits"


def to_inputs(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] -> normalised float [N, 1, 28, 28], the model's input."""
    return ((images.float() / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)


def load_mnist(data_dir: Path | None, split: str = "train", rank: int = 0) -> TensorDataset:
    """The split as an in-memory dataset of (normalised image, label) pairs."""
    images, labels, _ = load_mnist_raw(data_dir, split, rank)
    return TensorDataset(to_inputs(images), labels.long())


# -- model ----------------------------------------------------------------------------------------------------


class Net(nn.Module):
    """Two conv layers and two linear layers (about 200k parameters): small enough for a laptop CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 28 -> 14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 14 -> 7
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, device: torch.device, batch_size: int = 1000) -> float:
    """Fraction of `dataset` that `model` classifies correctly."""
    model.eval()
    images, labels = dataset.tensors
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = model(images[start:start + batch_size].to(device))
        correct += (logits.argmax(1).cpu() == labels[start:start + batch_size]).sum().item()
    model.train()
    return correct / len(labels)


# -- bookkeeping ----------------------------------------------------------------------------------------------


class StepClock:
    """Wall time per step, leaving out the first `warmup` steps (allocations, lazy init, first collectives)."""

    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        self.device, self.warmup, self.steps, self.start = device, warmup, 0, None

    def tick(self) -> None:
        self.steps += 1
        if self.steps == self.warmup:
            sync(self.device)
            self.start = time.perf_counter()

    def seconds_per_step(self) -> float | None:
        if self.start is None or self.steps <= self.warmup:
            return None
        sync(self.device)
        return (time.perf_counter() - self.start) / (self.steps - self.warmup)

    def summary(self, samples_per_step: int) -> str:
        per_step = self.seconds_per_step()
        if per_step is None:
            return f"timing: too few steps ({self.steps}) to time after {self.warmup} warm-up steps"
        return (f"timing: {per_step * 1000:.1f} ms per step, {samples_per_step / per_step:.0f} samples/s "
                f"({samples_per_step} samples per step, {self.steps - self.warmup} steps timed)")


class MetricsLog:
    """JSON lines of {step, samples_seen, loss, lr}: compare runs by samples seen, not by step."""

    def __init__(self, path: Path | None) -> None:
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("w")

    def write(self, **record: float) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def profiler(profile_dir: Path | None, rank: int = 0):
    """A torch.profiler over steps 2-4 writing a Chrome trace per rank (Perfetto and TensorBoard read it),
    or None. Call `.step()` after every optimizer step."""
    if profile_dir is None:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # tensorboard_trace_handler only writes <worker>.<time>.pt.trace.json files: it needs no tensorboard.
    handler = tensorboard_trace_handler(str(profile_dir), worker_name=f"rank{rank}")
    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=handler, record_shapes=True)


def global_mean(value: torch.Tensor, world_size: int) -> float:
    """The mean of a scalar over all ranks, with one all_reduce: for the log, not for training."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / world_size


def finish(model: nn.Module, args: argparse.Namespace, device: torch.device, rank: int = 0,
           load_test: Callable[[], TensorDataset] | None = None) -> None:
    """On rank 0: print the test accuracy (unless --no-eval) and save the weights (with --save)."""
    if rank != 0:
        return
    if not args.no_eval:
        test_set = load_test() if load_test else load_mnist(args.data_dir, "test")
        log(f"test accuracy: {accuracy(model, test_set, device):.3f}")
    save_weights(model, args.save)


def save_weights(model: nn.Module, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
    print(f"saved the final weights to {path}", flush=True)


def torchrun_ranks(script: str) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the variables torchrun sets; a clear exit when they are missing."""
    if "RANK" not in os.environ:
        raise SystemExit(f"{script} is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE:\n"
                         f"  torchrun --standalone --nproc-per-node 4 {script}    (one machine)\n"
                         f"  ./multinode_setup_and_run.sh {script}                (inside a Slurm allocation)")
    _die_with_torchrun()
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def _die_with_torchrun() -> None:
    """torchrun starts each rank in a session of its own: ask Linux to kill this rank when its
    torchrun dies (SIGKILLed by a scheduler, say), so no rank trains on as an orphan."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError:
        pass  # not Linux: nothing to ask for


def end_distributed() -> None:
    """`destroy_process_group()`, then leave this process at once. With gloo in torch 2.13 the
    interpreter's own teardown can hang: freeing the last reference to the process group (DDP's
    reducer holds one) joins gloo's threads while holding the GIL, and a thread that still releases
    a finished collective's tensor waits for the GIL (pytorch/pytorch#56297). Call it last."""
    dist.destroy_process_group()
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
