"""Step 5: step 4 with PyTorch's DistributedDataParallel (DDP) doing the gradient all_reduce.

    python 5_mnist_ddp_pt.py --epochs 1
    python 5_mnist_ddp_pt.py --nproc 2 --max-steps 20 --save runs/ddp.pt
    python 5_mnist_ddp_pt.py --nproc 4 --lr-scaling linear --metrics runs/ddp4_linear.jsonl
    python 5_mnist_ddp_pt.py --nproc 2 --max-steps 20 --profile-dir runs/profile_ddp

DDP(model) broadcasts rank 0's weights when it is built, and during backward it all_reduces the
gradients in buckets, overlapping the communication with the rest of backward. The training loop is
step 2's loop; only the sampler and the wrapper are new. From the same seed it ends with the same
weights as step 4 (tests/test_course.py compares them).
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
    profiler,
    scaled_lr,
    spawn_on_this_machine,
    training_parser,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def worker(rank: int, world_size: int, args) -> None:
    device = device_for(args.device, rank)
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)
    model = DDP(Net().to(device), device_ids=[rank] if device.type == "cuda" else None)
    lr = scaled_lr(args.lr, world_size, args.lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    train_set = load_mnist(args.data_dir, "train", rank)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    global_batch = world_size * args.batch_size
    log(f"{world_size} ranks on {device}: {len(sampler)} of {len(train_set)} images per rank, {len(loader)} steps "
        f"per epoch, global batch {global_batch}, lr {lr:g}", rank=rank)

    clock, metrics = StepClock(device), MetricsLog(args.metrics if rank == 0 else None)
    prof = profiler(args.profile_dir, rank)
    if prof:
        prof.start()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP's hooks all_reduce (and average) the gradients here
            optimizer.step()
            step += 1
            clock.tick()
            if prof:
                prof.step()
            if step % args.log_every == 0:
                mean_loss = global_mean(loss, world_size)  # the loss over the global batch
                log(f"epoch {epoch} step {step}: loss {mean_loss:.4f}", rank=rank)
                metrics.write(step=step, samples_seen=step * global_batch, loss=mean_loss, lr=lr)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    if prof:
        prof.stop()
        log(f"profiler traces written to {args.profile_dir}, one per rank (open them in https://ui.perfetto.dev)",
            rank=rank)
    log(clock.summary(global_batch), rank=rank)
    finish(model.module, args, device, rank)  # .module: the plain model, without DDP's wrapper
    metrics.close()
    end_distributed()  # destroy_process_group, then exit (see course_common)


if __name__ == "__main__":
    parser = training_parser(__doc__.splitlines()[0])
    add_nproc(parser, default=4)
    add_lr_scaling(parser)
    args = parser.parse_args()
    spawn_on_this_machine(worker, args.nproc, args.port, args)  # worker(rank, nproc, args) in each process
