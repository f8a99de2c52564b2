"""GPU checks that CPU tests cannot make, as one short script for a machine with a CUDA GPU.

    .venv/bin/python benchmarks/gpu_checks.py [--steps 30] [--demo] [--out gpu_checks.json]

1. Voxel pooling under bf16 autocast against float32 on a dense event (3000 points, 2990 of
   them in one voxel): the relative error of the pooled mean and of one `Block`'s output.
2. Host synchronisations per training step: `torch.cuda.set_sync_debug_mode("warn")` during
   `--steps` steps of the real trainer step (world size 1, demo model, synthetic data); every
   warning is one synchronising call, reported with the line of pimm that made it.
3. With --demo: a 1-GPU run of the demo config through `pimm launch` (wall time, final mIoU).

Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def pooling_error() -> dict:
    from pimm.models.point_seg_net import Block, voxel_clusters, voxel_mean

    torch.manual_seed(0)
    device = torch.device("cuda")
    n = 3000
    coord = torch.cat([torch.rand(n - 10, 3) * 0.5, torch.rand(10, 3) * 50 + 10]).to(device)
    cluster, counts = voxel_clusters(coord, torch.zeros(n, dtype=torch.long, device=device), 4.0)
    features = (torch.randn(n, 8, device=device) + 3.0).bfloat16()
    exact = voxel_mean(features.double(), cluster, counts)
    pooled = voxel_mean(features, cluster, counts).double()
    block = Block(64).to(device)
    x = torch.randn(n, 64, device=device)
    reference = block(x, cluster, counts)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mixed = block(x, cluster, counts)
    return {
        "points_in_densest_voxel": int(counts.max()),
        "pooled_mean_max_rel_error": float(((pooled - exact).abs() / exact.abs()).max()),
        "block_output_max_rel_error": float((mixed.float() - reference).abs().max() / reference.abs().max()),
    }


def syncs_per_step(steps: int) -> dict:
    """Count synchronising CUDA calls per trainer step; group them by the pimm line that made them."""
    from pimm.config import apply_overrides, load_config
    from pimm.data.synth import write_dataset
    from pimm.distributed.env import init_distributed
    from pimm.engine.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="pimm-gpu-"))
    train = write_dataset(tmp / "train.h5", 16 * (steps + 5), seed=1)
    cfg = apply_overrides(
        load_config(REPO / "configs/demo/semseg.py"),
        [("data.train.path", str(train)), ("data.val", None), ("num_worker", 0), ("epochs", 1)],
    )
    (tmp / "logs").mkdir()
    trainer = Trainer(cfg, tmp, init_distributed())
    batches = iter(trainer.train_loader)
    for _ in range(3):  # warm-up: allocator, cuDNN/cuBLAS handles
        trainer._train_step(next(batches))
    torch.cuda.synchronize()
    where: collections.Counter = collections.Counter()
    total = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                trainer._train_step(next(batches))
                trainer.stop.agreed()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" not in str(w.message):
            continue
        total += 1
        where[f"{w.filename}:{w.lineno}"] += 1  # the Python line that made the synchronising call
    return {"steps": steps, "syncs_per_step": total / steps, "by_line": dict(where.most_common())}


def demo_run() -> dict:
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "pimm", "launch", "--train.config", "demo/semseg", "--resources.nproc-per-node", "1"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    line = next((ln for ln in res.stdout.splitlines() if "validation mIoU" in ln), "")
    return {"returncode": res.returncode, "wall_s": round(time.perf_counter() - start, 1), "final": line.strip(),
            "stderr_tail": res.stderr[-1500:] if res.returncode else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--demo", action="store_true", help="also run the demo config on one GPU")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA GPU visible; nothing to check here (run this on a GPU machine)")
        return 0
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pooling": pooling_error(),
               "syncs": syncs_per_step(args.steps)}
    if args.demo:
        results["demo"] = demo_run()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
