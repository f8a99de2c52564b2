"""How far pimm's evaluation of PT-v3m2 can be from the published code's, and why.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/published_parity.py [--points 4000] [--draws 5] [--quick]

The published forward (pimm's `model(data_dict)`, which reproduces it: tests/test_ptv3m2.py) draws the
serialization-order permutation of every pooled level from the global RNG, and serializes with the
depth of the whole batch. pimm's own call (`model(coord, feat, offset)`, what `pimm test` and
`pimm predict` run) draws nothing in evaluation and serializes each event with its own depth. This
prints, for the published Panda width (configs/bench/ptv3m2_panda.py, weights drawn per entry by
scripts/published_reference.reference_weights, LayerScale gammas near 1 so that every block counts)
on generated PILArNet-M-like events (pimm.data.synth.distinct_voxels, one point per voxel):

* the published code against itself: `--draws` seeds, every pair compared;
* pimm's call against each published draw;
* the published code on an event alone against the same event batched beside a larger one.

Each row: the largest |logit difference|, the median over points of the largest per point, and the
share of points whose predicted class differs. Random weights are not trained ones: a trained
network's sensitivity to the curve each block attends along is what this measures, not its scale.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from published_reference import reference_weights  # noqa: E402

from pimm.config import load_config  # noqa: E402
from pimm.data.synth import distinct_voxels  # noqa: E402
from pimm.models import build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=int, default=4000, help="voxels of the event (default 4000)")
    p.add_argument("--draws", type=int, default=5, help="published forwards with different seeds (default 5)")
    p.add_argument("--quick", action="store_true", help="a 2-stage model and 300 voxels: proves it runs")
    return p.parse_args(argv)


def differences(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    per_point = (a - b).abs().amax(1)
    return float(per_point.max()), float(per_point.median()), float((a.argmax(1) != b.argmax(1)).double().mean())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model_cfg = load_config(REPO / "configs/bench/ptv3m2_panda.py")["model"]
    if args.quick:
        model_cfg["backbone"].update(stride=(2,), enc_depths=(1, 1), enc_channels=(16, 32), enc_num_head=(2, 4),
                                     enc_patch_size=(64, 64), dec_depths=(1,), dec_channels=(16,), dec_num_head=(2,),
                                     dec_patch_size=(64,))
        model_cfg["backbone_out_channels"] = 16
        args.points, args.draws = 300, 2
    model = build_model(model_cfg).eval()
    state = reference_weights(model.state_dict())
    state.update({k: 1.0 + 0.1 * torch.randn_like(v) for k, v in state.items() if k.endswith("gamma")})
    model.load_state_dict(state)

    grid = torch.from_numpy(distinct_voxels(args.points, seed=3, event=0))
    big = torch.from_numpy(distinct_voxels(args.points * 2, seed=3, event=1))
    feat = torch.randn(len(grid), 4, generator=torch.Generator().manual_seed(0))
    big_feat = torch.randn(len(big), 4, generator=torch.Generator().manual_seed(1))

    def published(seed: int, batched: bool = False) -> torch.Tensor:
        torch.manual_seed(seed)
        g = grid - grid.min(0).values
        if batched:  # the event beside a larger one: the batch's depth is the larger one's
            b = big - big.min(0).values + 1000  # a larger extent: a deeper serialization
            data = {"grid_coord": torch.cat([g, b]), "feat": torch.cat([feat, big_feat]),
                    "offset": torch.tensor([len(g), len(g) + len(b)])}
            return model(data)["seg_logits"][: len(g)]
        return model({"grid_coord": g, "feat": feat, "offset": torch.tensor([len(g)])})["seg_logits"]

    start = time.perf_counter()
    with torch.no_grad():
        draws = [published(seed) for seed in range(args.draws)]
        ours = model(grid.float() + 0.5, feat, torch.tensor([len(grid)]))
        beside = published(0, batched=True)
    rows = {
        "published vs published (other seed)": [differences(a, b) for a, b in itertools.combinations(draws, 2)],
        "pimm vs published": [differences(ours, d) for d in draws],
        "published: alone vs batched (seed 0)": [differences(draws[0], beside)],
    }
    print(f"PT-v3m2 at {sum(p.numel() for p in model.parameters()):,} parameters, one event of {len(grid)} voxels, "
          f"{args.draws} published draws ({time.perf_counter() - start:.0f} s)\n")
    print("| comparison | pairs | max abs logit diff | median per-point max | class changed |")
    print("|---|---:|---:|---:|---:|")
    for name, values in rows.items():
        worst = max(v[0] for v in values)
        median = statistics.median(v[1] for v in values)
        changed = statistics.median(v[2] for v in values)
        print(f"| {name} | {len(values)} | {worst:.3g} | {median:.3g} | {100 * changed:.2f} % |")


if __name__ == "__main__":
    main()
