"""The PointTransformer backbone: space-filling-curve serialization, the model's event isolation
and gradients, the sizes of its configs, 1 vs 2 rank parity through `pimm launch` (DDP and
FSDP2), and the backbone benchmark end to end."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
    assert_bitwise_equal,
    kill_run,
    losses,
    metrics_lines,
    pimm_in_process,
    processes_of,
    run_pimm,
    signal_all,
    start_launch,
    steps,
    wait_for_run,
    wait_until,
    weights,
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
    ("configs/tests/tiny_ptv3.py", 20e3, 60e3),
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


# ----------------------------------------------------------------------------- through pimm launch


def launch_ptv3(exp, tiny_data, nproc: int, name: str, *overrides: str):
    res = run_pimm(["launch", "--train.config", TINY_PTV3, "--resources.nproc-per-node", str(nproc), "--run.name",
                    name, "--run.no-timestamp", "--paths.exp-root", str(exp), "--",
                    f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", "max_steps=4",
                    "log_event_ids=true", *overrides], cwd=REPO)
    assert res.returncode == 0, res.stderr
    run_dir = exp / "tests" / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def ptv3_reference(tmp_path_factory, tiny_data):
    """An uninterrupted 2-rank DDP epoch (12 steps) of tiny_ptv3 with loader workers (num_worker=4): the
    SIGUSR1 test's reference, and (its first 4 steps) the 2-rank DDP run of the parity test."""
    exp = tmp_path_factory.mktemp("ptv3")
    reference = start_launch(exp, tiny_data, 2, "num_worker=4", "epochs=1", "log_event_ids=true", name="reference",
                             extra=["--train.config", TINY_PTV3])
    try:
        out, err = reference.communicate(timeout=300)
    finally:
        kill_run(reference)
    assert reference.returncode == 0, err
    return exp / "tests" / "reference"


def test_one_and_two_ranks_and_accumulation_train_alike_under_ddp_and_fsdp2(tmp_path, tiny_data, ptv3_reference):
    """With drop path on (tiny_ptv3: 0.2) and shuffled curves: 1 rank, 2 ranks (DDP, FSDP2) and 1 rank
    in 2 micro-batches give the same losses: the randomness is keyed by step and event, not rank. The
    2-rank DDP run is the first 4 steps of the module's reference epoch (constant learning rate; loader
    workers change no event)."""
    one, loss1 = launch_ptv3(tmp_path, tiny_data, 1, "one")
    two_steps = {step: ids for step, ids in steps(ptv3_reference).items() if step <= 4}
    loss2 = [loss for step, loss in sorted(losses(ptv3_reference).items()) if step <= 4]
    fsdp, loss3 = launch_ptv3(tmp_path, tiny_data, 2, "fsdp2", "parallel.strategy=fsdp2",
                              "parallel.wrap_classes=[TransformerBlock]")
    accum, loss4 = launch_ptv3(tmp_path, tiny_data, 1, "accum", "grad_accum_steps=2")
    assert steps(one) == two_steps == steps(fsdp) == steps(accum)  # the same global batches, by construction
    assert len(loss1) == 4
    for other in (loss2, loss3, loss4):
        worst = max(abs(a - b) / abs(a) for a, b in zip(loss1, other, strict=True))
        assert worst <= LOSS_RTOL, (loss1, other)
    log = (fsdp / "logs" / "rank0.log").read_text()
    assert "fsdp2: 5 TransformerBlock module(s) sharded" in log


def test_sigusr1_to_every_process_with_loader_workers_then_resume_is_bit_exact(tmp_path, tiny_data, ptv3_reference):
    """As a cluster stops a job: every process (launcher, torchrun, 2 ranks, their loader workers) gets
    SIGUSR1; the resumed run draws the same shuffled curves and drop-path masks (keyed by the
    optimizer step and the event ids) and ends with the uninterrupted run's losses and weights, bit
    for bit."""
    common = ("num_worker=4", "epochs=1", "log_event_ids=true")
    extra = ["--train.config", TINY_PTV3]  # the same run as ptv3_reference, stopped and resumed
    proc = start_launch(tmp_path, tiny_data, 2, *common, name="job", extra=extra)
    run_dir = tmp_path / "tests" / "job"
    try:
        wait_for_run(proc, lambda: metrics_lines(run_dir) >= 3)
        assert wait_until(lambda: len(processes_of(proc)) >= 8, timeout=30), processes_of(proc)
        signal_all(processes_of(proc), signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_run(proc)
    assert proc.returncode == 75, err
    stopped_at = json.loads((run_dir / "model/last/.complete").read_text())["step"]
    assert stopped_at < 12
    res = run_pimm(["launch", "--train.config", TINY_PTV3, "--run.name", "job", "--run.no-timestamp",
                    "--paths.exp-root", str(tmp_path), "--train.resume"], cwd=REPO)
    assert res.returncode == 0, res.stderr
    ref_dir = ptv3_reference
    assert steps(run_dir) == steps(ref_dir)
    assert losses(run_dir) == losses(ref_dir)
    assert_bitwise_equal(weights(run_dir), weights(ref_dir))


@pytest.mark.parametrize(("override", "message"), [
    ("model.enc_depths=[1,1]", "model.enc_channels=[16, 32, 64] is not allowed: it has 3 entries but the encoder"),
    ("model.dec_depths=[1,1,1]", "it has 3 entries but the decoder has 2 stage(s) (len(enc_depths) - 1)"),
    ("model.orders=[z,peano]", "must be a non-empty list of z, z-trans, hilbert, hilbert-trans"),
    ("model.enc_num_head=[3,3,3]", "enc_channels must be divisible by it stage by stage (16 by 3)"),
    ("model.drop_path=1.5", "model.drop_path=1.5 is not allowed: model.drop_path must be a number in [0, 1)"),
    ("model.grid_size=0", "model.grid_size=0 is not allowed: model.grid_size must be a finite number > 0"),
])
def test_bad_model_options_exit_2_before_any_process(tmp_path, tiny_data, override, message):
    res = pimm_in_process(["launch", "--train.config", TINY_PTV3, "--paths.exp-root", str(tmp_path), "--dry-run", "--",
                           f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}",
                           "model.enc_depths=[1,1,1]", "model.enc_channels=[16,32,64]", "model.enc_num_head=[2,4,4]",
                           "model.enc_patch_size=[16,16,16]", "model.dec_depths=[1,1]", "model.dec_channels=[16,32]",
                           "model.dec_num_head=[2,4]", "model.dec_patch_size=[16,16]", override])
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not any(tmp_path.iterdir())


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
