"""Step 4: data-parallel training by hand: each process trains on its own share of the data and the
processes average their gradients with all_reduce before every optimizer step.

    python 4_mnist_manual_ddp.py --epochs 1
    python 4_mnist_manual_ddp.py --nproc 2 --max-steps 20 --save runs/manual.pt

Two changes to step 3 make it real data parallelism:
  1. DistributedSampler gives rank r every world_size-th sample (after a shuffle all ranks agree on),
     so an epoch is split across the ranks instead of repeated by each.
  2. After backward, all_reduce sums each gradient over the ranks; dividing by world_size gives the
     gradient of the mean loss over the global batch (world_size x --batch-size samples).
The weights stay identical on every rank because every rank applies the same averaged gradient.
Step 5 gets the same result from DistributedDataParallel; tests/test_course.py checks they agree.
"""


import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import (
    MetricsLog,
    Net,
    StepClock,
    add_lr_scaling,
    add_nproc,
    backend_for,
    device_for,
    end_distributed,
    finish,
    global_mean,
    load_mnist,
    log,
    scaled_lr,
    spawn_on_this_machine,
    training_parser,
)
from torch.utils.data import DataLoader, DistributedSampler


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size


def worker(rank: int, world_size: int, args) -> None:
    device = device_for(args.device, rank)
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)
    model = Net().to(device)
    for param in model.parameters():  # start from rank 0's weights, whatever seed the others used
        dist.broadcast(param.data, src=0)
    lr = scaled_lr(args.lr, world_size, args.lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    train_set = load_mnist(args.data_dir, "train", rank)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    global_batch = world_size * args.batch_size
    log(f"{world_size} ranks on {device}: {len(sampler)} of {len(train_set)} images per rank, {len(loader)} steps "
        f"per epoch, global batch {global_batch}, lr {lr:g}", rank=rank)

    clock, metrics, step = StepClock(device), MetricsLog(args.metrics if rank == 0 else None), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            average_gradients(model, world_size)  # the whole of DDP, done by hand
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
    finish(model, args, device, rank)
    metrics.close()
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    parser = training_parser(__doc__.splitlines()[0])
    add_nproc(parser, default=4)
    add_lr_scaling(parser)
    args = parser.parse_args()
    spawn_on_this_machine(worker, args.nproc, args.port, args)  # worker(rank, nproc, args) in each process
