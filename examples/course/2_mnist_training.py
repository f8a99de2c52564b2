"""Step 2: train the MNIST classifier in one process on one device. Every later step is measured against this.

    python 2_mnist_training.py --epochs 2
    python 2_mnist_training.py --data-dir ~/data/mnist --metrics runs/single.jsonl
    python 2_mnist_training.py --max-steps 20 --profile-dir runs/profile   # a trace for Perfetto

It prints the loss every --log-every steps, the time per step, and the test accuracy.
"""

import torch
import torch.nn.functional as F
from course_common import (
    MetricsLog,
    Net,
    StepClock,
    device_for,
    finish,
    load_mnist,
    log,
    profiler,
    training_parser,
)
from torch.utils.data import DataLoader


def main() -> None:
    args = training_parser(__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(args.seed)
    device = device_for(args.device)
    train_set = load_mnist(args.data_dir, "train")
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    log(f"device {device}: {len(train_set)} training images, {len(loader)} steps per epoch of {args.batch_size}")

    clock, metrics, prof = StepClock(device), MetricsLog(args.metrics), profiler(args.profile_dir)
    if prof:
        prof.start()
    step = 0
    for epoch in range(args.epochs):
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            clock.tick()
            if prof:
                prof.step()
            if step % args.log_every == 0:
                log(f"epoch {epoch} step {step}: loss {loss.item():.4f}")
                metrics.write(step=step, samples_seen=step * args.batch_size, loss=loss.item(), lr=args.lr)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    if prof:
        prof.stop()
        log(f"profiler trace written to {args.profile_dir} (open the .pt.trace.json in https://ui.perfetto.dev)")
    log(clock.summary(args.batch_size))
    metrics.close()
    finish(model, args, device)


if __name__ == "__main__":
    main()
