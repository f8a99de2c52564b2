"""Step 8: step 7 with a loader that streams the training set from an HDF5 file chunk by chunk,
instead of holding it in memory: what a data set larger than RAM needs.

    python create_mnist_h5.py --out data/mnist.h5
    torchrun --standalone --nproc-per-node 4 8_mnist_ddp_pt_multinode_streaming.py --h5 data/mnist.h5
    ./multinode_setup_and_run.sh 8_mnist_ddp_pt_multinode_streaming.py --h5 data/mnist.h5

Each epoch, every rank shuffles the list of chunks with the same seed, takes every world_size-th chunk,
and hands every num_workers-th of those to each DataLoader worker; a worker reads one chunk (one
contiguous HDF5 read), shuffles it and yields its samples. So each sample is read exactly once per
epoch across all ranks, and no process holds more than a chunk per worker.

Chunks do not split evenly, so ranks may get a different number of batches; DDP's Join lets the ranks
that run out early keep answering the others' gradient all_reduces instead of hanging.
"""

import json
from pathlib import Path

import h5py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import (
    MetricsLog,
    Net,
    StepClock,
    add_lr_scaling,
    backend_for,
    device_for,
    end_distributed,
    finish,
    log,
    say,
    scaled_lr,
    to_inputs,
    torchrun_ranks,
    training_parser,
)
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info


def chunks_for(num_samples: int, chunk_size: int, epoch: int, seed: int, rank: int, world_size: int,
               worker: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
    """The (start, stop) chunks that loader worker `worker` of rank `rank` reads in `epoch`.

    Over all ranks and workers the chunks cover range(num_samples) exactly once.
    """
    chunks = [(start, min(start + chunk_size, num_samples)) for start in range(0, num_samples, chunk_size)]
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    mine = [chunks[i] for i in order[rank::world_size]]
    return mine[worker::num_workers]


class H5ChunkStream(IterableDataset):
    """(image, label, index) from `split` of a create_mnist_h5.py file, read one chunk at a time."""

    def __init__(self, path: Path, split: str, rank: int, world_size: int, seed: int = 0) -> None:
        self.path, self.split, self.seed, self.epoch = path, split, seed, 0
        self.rank, self.world_size = rank, world_size
        with h5py.File(path, "r") as f:
            self.num_samples = len(f[split]["labels"])
            self.chunk_size = f[split]["images"].chunks[0]  # read in the file's own chunks

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        chunks = chunks_for(self.num_samples, self.chunk_size, self.epoch, self.seed, self.rank, self.world_size,
                            worker, num_workers)
        shuffle = torch.Generator().manual_seed(self.seed + self.epoch * 1_000_003 + self.rank * 1009 + worker)
        with h5py.File(self.path, "r") as f:  # opened here, in the worker: h5py handles do not survive fork
            images, labels = f[self.split]["images"], f[self.split]["labels"]
            for start, stop in chunks:
                chunk_images = torch.from_numpy(images[start:stop])  # one contiguous read from disk
                chunk_labels = torch.from_numpy(labels[start:stop]).long()
                for i in torch.randperm(stop - start, generator=shuffle).tolist():
                    yield to_inputs(chunk_images[i:i + 1])[0], chunk_labels[i], start + i


def read_test_split(path: Path) -> TensorDataset:
    with h5py.File(path, "r") as f:  # the test split is small: read it whole
        images, labels = f["test/images"][:], f["test/labels"][:]
    return TensorDataset(to_inputs(torch.from_numpy(images)), torch.from_numpy(labels).long())


def main() -> None:
    parser = training_parser(__doc__.splitlines()[0])
    add_lr_scaling(parser)
    parser.add_argument("--h5", type=Path, default=Path("data/mnist.h5"), help="written by create_mnist_h5.py")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--record-indices", type=Path, default=None,
                        help="folder: each rank writes the sample indices it trained on, per epoch")
    args = parser.parse_args()
    if not args.h5.is_file():
        raise SystemExit(f"{args.h5} does not exist: write it first with `python create_mnist_h5.py --out {args.h5}`")
    rank, local_rank, world_size = torchrun_ranks("8_mnist_ddp_pt_multinode_streaming.py")
    device = device_for(args.device, local_rank)
    dist.init_process_group(backend_for(device))

    torch.manual_seed(args.seed)
    model = DDP(Net().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    lr = scaled_lr(args.lr, world_size, args.lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    stream = H5ChunkStream(args.h5, "train", rank, world_size, args.seed)
    loader = DataLoader(stream, batch_size=args.batch_size, num_workers=args.workers)
    log(f"streaming {stream.num_samples} images from {args.h5} in chunks of {stream.chunk_size}, "
        f"{world_size} ranks x {args.workers} workers, lr {lr:g}", rank=rank)

    clock, metrics, step = StepClock(device), MetricsLog(args.metrics if rank == 0 else None), 0
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)  # before iterating: the workers get a copy of the stream as it is now
        seen = []
        with Join([model]):  # ranks with fewer batches shadow the others' all_reduces until all are done
            for images, labels, indices in loader:
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                clock.tick()
                seen += indices.tolist()
                if step % args.log_every == 0:  # rank 0's own loss: no extra collective inside Join
                    log(f"epoch {epoch} step {step}: loss {loss.item():.4f} (rank 0's batch)", rank=rank)
                    metrics.write(step=step, loss=loss.item(), lr=lr)
                if step == args.max_steps:
                    break
        say(f"rank {rank}: epoch {epoch}: {len(seen)} samples")
        if args.record_indices:
            args.record_indices.mkdir(parents=True, exist_ok=True)
            (args.record_indices / f"rank{rank}_epoch{epoch}.json").write_text(json.dumps(seen))
        if step == args.max_steps:
            break
    log(clock.summary(world_size * args.batch_size), rank=rank)
    finish(model.module, args, device, rank, load_test=lambda: read_test_split(args.h5))
    metrics.close()
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    main()
