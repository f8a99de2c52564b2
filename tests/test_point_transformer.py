"""The PointTransformer backbone: space-filling-curve serialization, the model's event isolation
and gradients, the sizes of its configs, and the backbone benchmark end to end. (configs/tests/tiny_ptv3.py
is PT-v3m2: its launches are in test_ptv3m2.py.)"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
)

from pimm.config import load_config
from pimm.models import build_model
from pimm.models.point_transformer import Level, PointTransformer, event_keys, event_uniforms, step_key
from pimm.models.serialization import ORDERS, encode, serialize

TINY_PTV3 = "tests/tiny_ptv3"
# 1 vs 2 ranks: each event's logits are the same rows of the same matmuls in other batch shapes, and
# the 2-rank gradient is the all-reduced sum of the two halves instead of one sum: float32 rounding
# in another order (~1e-7 relative), compounded over 4 AdamW steps. Measured: 7e-8. A rank drawing
# other curves, or a patch mixing events, moves the loss by 1e-3 or more.
LOSS_RTOL = 1e-5


def tiny_model(**overrides) -> PointTransformer:
    """Two stages of 16 and 32 channels with patches of 16 voxels."""
    cfg = dict(type="PointTransformer", in_channels=4, num_classes=5, grid_size=2.0, enc_depths=[2, 2],
               enc_channels=[16, 32], enc_num_head=[2, 4], enc_patch_size=[16, 16], dec_depths=[1],
               dec_channels=[16], dec_num_head=[2], dec_patch_size=[16], mlp_ratio=2.0)
    return build_model({**cfg, **overrides})


def random_events(sizes: list[int], seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Events of `sizes` points: a track-like line plus scatter, in detector units, and 4 features."""
    g = torch.Generator().manual_seed(seed)
    coords, feats = [], []
    for i, n in enumerate(sizes):
        t = torch.rand(n, 1, generator=g) * 120
        line = t * torch.nn.functional.normalize(torch.randn(1, 3, generator=g), dim=1)
        coords.append(line + 3 * torch.randn(n, 3, generator=g) + 40 * i + 10)
        feats.append(torch.randn(n, 4, generator=g))
    return coords, feats


def pack(coords: list[torch.Tensor], feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    offset = torch.cumsum(torch.tensor([len(c) for c in coords]), 0)
    return torch.cat(coords), torch.cat(feats), offset


# ----------------------------------------------------------------------------- serialization


@pytest.mark.parametrize("order", ORDERS)
def test_each_order_is_a_permutation_that_keeps_events_together(order):
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, 5, (700,), generator=g)  # events interleaved in the input
    grid = torch.randint(0, 40, (700, 3), generator=g)
    (order_idx,), (inverse,) = serialize(grid, batch, (order,))
    arange = torch.arange(700)
    assert torch.equal(order_idx.sort().values, arange)
    assert torch.equal(inverse[order_idx], arange) and torch.equal(order_idx[inverse], arange)
    assert bool((batch[order_idx].diff() >= 0).all())  # event 0's voxels, then event 1's, ...
    codes = encode(grid, batch, order)
    assert bool((codes[order_idx].diff() >= 0).all())


def test_z_order_codes_of_known_cells():
    grid = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [3, 5, 6], [3, 5, 6]])
    batch = torch.tensor([0, 0, 0, 0, 1])
    # (3, 5, 6) = x 011, y 101, z 110 -> bit triples (x y z) from the top: 011 101 110 = 238;
    # event 1 adds 1 << (3 x 3 bits)
    assert encode(grid, batch, "z", depth=3).tolist() == [4, 2, 1, 238, 512 + 238]
    # z-trans is z-order of (y, x, z)
    assert encode(grid, batch, "z-trans", depth=3).tolist() == [2, 4, 1, 5 * 64 + 3 * 8 + 6, 512 + 350]


@pytest.mark.parametrize("order,bits", [("hilbert", 2), ("hilbert", 3), ("hilbert-trans", 3)])
def test_hilbert_curve_visits_every_cell_stepping_to_a_face_neighbour(order, bits):
    side = 1 << bits
    grid = torch.tensor(list(itertools.product(range(side), repeat=3)))
    codes = encode(grid, torch.zeros(len(grid), dtype=torch.long), order, depth=bits)
    assert torch.equal(codes.sort().values, torch.arange(side**3))  # a bijection onto 0 .. 8^bits - 1
    path = grid[codes.argsort()]
    assert (path[1:] - path[:-1]).abs().sum(dim=1).tolist() == [1] * (side**3 - 1)
    z_path = grid[encode(grid, torch.zeros(len(grid), dtype=torch.long), "z", depth=bits).argsort()]
    assert (z_path[1:] - z_path[:-1]).abs().sum(dim=1).max() > 1  # which z-order is not


def test_a_grid_too_large_for_63_bits_is_refused():
    grid = torch.zeros(4, 3, dtype=torch.long)
    batch = torch.arange(4)
    encode(grid, batch, "hilbert", depth=20, num_events=8)  # 60 + 3 bits fit
    with pytest.raises(ValueError, match="exceed the 63 bits"):
        encode(grid, batch, "hilbert", depth=20, num_events=9)
    with pytest.raises(ValueError, match="larger grid_size"):
        encode(torch.tensor([[1 << 21, 0, 0]]), torch.zeros(1, dtype=torch.long), "z")
    with pytest.raises(ValueError, match="unknown serialization order"):
        encode(grid, batch, "peano")


def test_neighbour_edges_are_the_occupied_cells_of_each_3x3x3_kernel_within_the_event():
    g = torch.Generator().manual_seed(1)
    level = Level(torch.randint(0, 3, (300,), generator=g).sort().values,
                  torch.randint(0, 6, (300, 3), generator=g), depth=3, num_events=3)
    offsets = list(itertools.product((-1, 0, 1), repeat=3))
    expected = set()
    for i, j in itertools.product(range(level.num_voxels), repeat=2):
        step = tuple((level.grid[j] - level.grid[i]).tolist())
        if i != j and level.batch[i] == level.batch[j] and step in offsets:
            expected.add((i, j, offsets.index(step)))
    centre, neighbour, offset = level.neighbours()
    assert len(centre) == len(expected)
    assert set(zip(centre.tolist(), neighbour.tolist(), offset.tolist())) == expected


# ----------------------------------------------------------------------------- the model


def test_each_events_output_is_the_same_alone_or_in_any_batch():
    torch.manual_seed(0)
    model = tiny_model().eval()
    sizes = [1, 7, 0, 300, 40]  # smaller than a patch, empty, many patches
    coords, feats = random_events(sizes)
    with torch.no_grad():
        batched = model(*pack(coords, feats))
        assert batched.shape == (sum(sizes), 5) and bool(torch.isfinite(batched).all())
        for i, rows in enumerate(torch.cumsum(torch.tensor(sizes), 0).tolist()):
            alone = model(*pack([coords[i]], [feats[i]]))
            torch.testing.assert_close(alone, batched[rows - sizes[i]:rows], rtol=0, atol=1e-5)


def test_padding_is_inert_whatever_the_patch_size():
    # an event of 7 points is one patch of 16 slots or of 64: 9 or 57 masked padding slots
    torch.manual_seed(0)
    model = tiny_model().eval()
    wide = tiny_model(enc_patch_size=[64, 64], dec_patch_size=[64]).eval()
    wide.load_state_dict(model.state_dict())
    coords, feats = random_events([7, 12])
    with torch.no_grad():
        torch.testing.assert_close(model(*pack(coords, feats)), wide(*pack(coords, feats)), rtol=0, atol=1e-5)


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = tiny_model(drop_path=0.2).train()
    logits = model(*pack(*random_events([1, 7, 300])))
    torch.nn.functional.cross_entropy(logits, torch.randint(0, 5, (308,))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert bool(p.grad.abs().sum() > 0), name


def test_shuffled_curves_follow_the_build_seed_and_the_step_not_the_rank_stream():
    # the trainer seeds, builds the model, then reseeds each rank differently
    batch = pack(*random_events([50, 80]))
    models = []
    for rank_seed in (1, 2):
        torch.manual_seed(7)
        models.append(tiny_model())
        torch.manual_seed(rank_seed)
    for _ in range(3):  # three training forwards: the curves change with the step, alike on both "ranks"
        torch.testing.assert_close(models[0](*batch), models[1](*batch), rtol=0, atol=0)


def test_training_randomness_of_an_event_depends_on_the_step_and_its_id_only():
    """Drop path and curves, announced steps: an event's training output is the same alone or in
    a batch with others, in any position (what 1 vs N ranks and micro-batches need); another step
    or another id draws otherwise; with the same step announced twice, the same again."""
    torch.manual_seed(3)
    model = tiny_model(drop_path=0.5).train()
    coords, feats = random_events([40, 60, 90], seed=1)
    ids = torch.tensor([11, 12, 13])

    def run(step: int, order: list[int], event_ids: torch.Tensor) -> list[torch.Tensor]:
        model.begin_optimizer_step(step)
        out = model(*pack([coords[i] for i in order], [feats[i] for i in order]), event_id=event_ids[order])
        return list(out.split([len(coords[i]) for i in order]))

    batched = run(5, [0, 1, 2], ids)
    alone = [run(5, [i], ids)[0] for i in range(3)]
    reordered = run(5, [2, 0, 1], ids)
    for i in range(3):
        torch.testing.assert_close(batched[i], alone[i], rtol=0, atol=2e-6)
        torch.testing.assert_close(batched[i], reordered[(i + 1) % 3], rtol=0, atol=2e-6)
    again = run(5, [0, 1, 2], ids)
    assert all(torch.equal(a, b) for a, b in zip(batched, again))
    other_step = run(6, [0, 1, 2], ids)
    other_ids = run(5, [0, 1, 2], ids + 100)
    assert any(not torch.allclose(a, b) for a, b in zip(batched, other_step))
    assert any(not torch.allclose(a, b) for a, b in zip(batched, other_ids))
    # the draws: keep rates near 1 - p over many events, independent streams per branch
    keys = event_keys(torch.arange(20000), step_key(7, 1))
    first, second = event_uniforms(keys, 0), event_uniforms(keys, 1)
    assert abs(float((first >= 0.3).double().mean()) - 0.7) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.03


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("config,low,high", [
    ("configs/demo/semseg_ptv3.py", 0.5e6, 1.5e6),  # the small one: 0.74M
    ("configs/bench/ptv3_large.py", 90e6, 110e6),  # 99.2M
])
def test_config_sizes(config, low, high):
    cfg = load_config(REPO / config)
    with torch.device("meta"):
        model = build_model(cfg["model"])
    count = sum(p.numel() for p in model.parameters())
    print(f"{config}: {count:,} parameters")
    assert low <= count <= high, count
    assert cfg["parallel"]["wrap_classes"] == ["TransformerBlock"]


def test_a_model_built_from_defaults_it_cannot_use_is_a_config_error():
    """Keys the config leaves to the defaults are checked when the model is built (in the rank):
    the same check, reported as a config error, not a raw ValueError."""
    from pimm.errors import ConfigError

    with pytest.raises(ConfigError, match="enc_channels.* is not allowed: it has 5 entries but the encoder has 2"):
        build_model({"type": "PointTransformer", "enc_depths": [1, 1]})


# ----------------------------------------------------------------------------- benchmark


def test_backbone_benchmark_prints_its_table(tmp_path):
    argv = [sys.executable, str(REPO / "benchmarks" / "backbones.py"), "--seconds", "3", "--events", "40",
            "--val-events", "16"]
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    for column in ("params", "train ev/s", "steps", "eval ev/s", "val mIoU", "PointSegNet", "PointTransformer",
                   "ratio PointTransformer/PointSegNet: val mIoU"):
        assert column in res.stdout, column
