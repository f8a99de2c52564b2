"""Compare training runs by the loss they reach after the same number of samples (not steps).

    python 2_mnist_training.py --epochs 3 --metrics runs/1proc.jsonl
    python 5_mnist_ddp_pt.py --nproc 4 --epochs 3 --metrics runs/4proc.jsonl
    python 5_mnist_ddp_pt.py --nproc 4 --epochs 3 --lr-scaling linear --metrics runs/4proc_linear.jsonl
    python compare_loss_curves.py runs/1proc.jsonl runs/4proc.jsonl runs/4proc_linear.jsonl [--plot curves.png]

With N processes each step uses N times as many samples, so there are N times fewer steps per epoch.
At the same learning rate the N-process curve lags per sample; scaling the learning rate by N
(--lr-scaling linear) brings it back close to the one-process curve.
"""

import argparse
import json
from pathlib import Path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loss_at(records: list[dict], samples: int) -> float | None:
    """The loss of the last record at or before `samples` samples seen."""
    before = [r for r in records if r["samples_seen"] <= samples]
    return before[-1]["loss"] if before else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="--metrics files of the training scripts")
    parser.add_argument("--points", type=int, default=8, help="how many sample counts to compare at")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the curves into this PNG")
    args = parser.parse_args()
    runs = {path.stem: read(path) for path in args.runs}
    if not all(runs.values()):
        raise SystemExit("a metrics file is empty: run longer or lower --log-every")
    last = min(records[-1]["samples_seen"] for records in runs.values())
    first = max(records[0]["samples_seen"] for records in runs.values())
    marks = [first + (last - first) * i // max(args.points - 1, 1) for i in range(args.points)]
    print(f"{'samples seen':>12} " + " ".join(f"{name:>16}" for name in runs))
    for mark in marks:
        print(f"{mark:>12} " + " ".join(f"{loss_at(records, mark):>16.4f}" for records in runs.values()))
    for name, records in runs.items():
        print(f"{name}: lr {records[0]['lr']:g}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for name, records in runs.items():
            plt.plot([r["samples_seen"] for r in records], [r["loss"] for r in records], label=name)
        plt.xlabel("samples seen")
        plt.ylabel("training loss")
        plt.legend()
        plt.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
