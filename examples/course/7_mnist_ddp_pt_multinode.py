"""Step 7: step 5's DDP training, started by torchrun so that it runs on any number of nodes.

    torchrun --standalone --nproc-per-node 4 7_mnist_ddp_pt_multinode.py --epochs 1
    ./multinode_setup_and_run.sh 7_mnist_ddp_pt_multinode.py --epochs 1

The differences from step 5: torchrun, not the script, starts the processes; the GPU is picked by
LOCAL_RANK (the rank within the node), while the data is split by RANK (the rank in the whole job);
and only global rank 0 writes files.
"""

import os
import socket

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
    global_mean,
    load_mnist,
    log,
    scaled_lr,
    torchrun_ranks,
    training_parser,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def main() -> None:
    parser = training_parser(__doc__.splitlines()[0])
    add_lr_scaling(parser)
    args = parser.parse_args()
    rank, local_rank, world_size = torchrun_ranks("7_mnist_ddp_pt_multinode.py")
    device = device_for(args.device, local_rank)
    dist.init_process_group(backend_for(device))
    places = [None] * world_size
    dist.all_gather_object(places, (int(os.environ.get("GROUP_RANK", 0)), socket.gethostname()))
    nodes = sorted(set(places))
    log(f"{world_size} ranks on {len(nodes)} node(s) ({', '.join(h for _, h in nodes)}), device type {device.type}",
        rank=rank)

    torch.manual_seed(args.seed)
    model = DDP(Net().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    lr = scaled_lr(args.lr, world_size, args.lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    train_set = load_mnist(args.data_dir, "train", rank)  # --data-dir must be readable on every node
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    global_batch = world_size * args.batch_size
    log(f"{len(sampler)} images per rank, {len(loader)} steps per epoch, global batch {global_batch}, lr {lr:g}",
        rank=rank)

    clock, metrics, step = StepClock(device), MetricsLog(args.metrics if rank == 0 else None), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            clock.tick()
            if step % args.log_every == 0:
                mean_loss = global_mean(loss, world_size)  # the loss over the global batch
                log(f"epoch {epoch} step {step}: loss {mean_loss:.4f}", rank=rank)
                metrics.write(step=step, samples_seen=step * global_batch, loss=mean_loss, lr=lr)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    log(clock.summary(global_batch), rank=rank)
    finish(model.module, args, device, rank)
    metrics.close()
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    main()
