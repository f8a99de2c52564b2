"""Step 3: 4 processes each train the model of step 2 on the whole data set, with nothing shared.

    python 3_mnist_distributed.py --epochs 1
    python 3_mnist_distributed.py --nproc 2 --max-steps 10

Starting processes is not data-parallel training. Same seed, same data, same order: every process
computes exactly the same thing. At the end the script gathers every process's weights and prints
that they are identical and that N processes did N times the work for one model's worth of progress.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import (
    Net,
    add_nproc,
    backend_for,
    device_for,
    end_distributed,
    load_mnist,
    log,
    say,
    spawn_on_this_machine,
    training_parser,
)
from torch.utils.data import DataLoader


def worker(rank: int, world_size: int, args) -> None:
    device = device_for(args.device, rank)
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)  # the same seed on every rank: same initial weights, same shuffling
    train_set = load_mnist(args.data_dir, "train", rank)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)  # every rank sees all of it
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start, step, samples = time.perf_counter(), 0, 0
    for _ in range(args.epochs):
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # no communication at all: each rank updates its own copy
            step, samples = step + 1, samples + len(labels)
            if step % args.log_every == 0:
                say(f"rank {rank} step {step}: loss {loss.item():.4f}")
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    elapsed = time.perf_counter() - start

    # The evidence: gather every rank's flattened weights on every rank and compare them with rank 0's.
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    max_diff = max((w - everyone[0]).abs().max().item() for w in everyone)
    say(f"rank {rank}: {samples} samples in {step} steps, {elapsed:.2f} s, last loss {loss.item():.4f}")
    dist.barrier()
    log(f"all {world_size} models identical: {max_diff == 0.0} (largest weight difference {max_diff:.3g})", rank=rank)
    log(f"{world_size} processes processed {world_size * samples} samples for one model that saw {samples}: "
        f"{world_size}x the work, no gain. Step 4 splits the data instead.", rank=rank)
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    parser = training_parser(__doc__.splitlines()[0])
    add_nproc(parser, default=4)
    args = parser.parse_args()
    spawn_on_this_machine(worker, args.nproc, args.port, args)  # worker(rank, nproc, args) in each process
