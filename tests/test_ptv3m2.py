"""PT-v3m2 and DefaultSegmentorV2 as published: parameter names and shapes against the manifest derived
from the published source, outputs against the published code's (tests/data, written by
scripts/published_reference.py), the published config pasted as it is, and the properties pimm's own
call adds (an event's result independent of its batch, keyed training draws)."""

from __future__ import annotations

import json
import signal
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

from pimm.errors import ConfigError
from pimm.models import build_model
from pimm.models.point_transformer_v3m2 import Level

sys.path.insert(0, str(REPO / "scripts"))
from published_reference import CONFIGURATIONS, reference_weights  # noqa: E402  (the script is the source of both)

MANIFEST = json.loads((REPO / "tests/data/published_ptv3m2_manifest.json").read_text())
OUTPUTS = torch.load(REPO / "tests/data/published_ptv3m2_outputs.pt", weights_only=True)
TINY_PTV3 = "tests/tiny_ptv3"  # PT-v3m2, ~105k parameters
# 1 vs 2 ranks: each event's logits are the same rows of the same matmuls in other batch shapes, and the
# 2-rank gradient is the all-reduced sum of the two halves: float32 rounding in another order, compounded
# over 4 AdamW steps. A rank drawing other curves or other drop-path masks moves the loss by 1e-3 or more.
LOSS_RTOL = 1e-5
# the published outputs were computed in float32 by spconv, torch_scatter and per-window attention;
# pimm sums the same products in another order: measured max |difference| 2.6e-6 on logits of size ~1
OUTPUT_ATOL = 2e-5


def tiny(**backbone) -> torch.nn.Module:
    """A 3-stage PT-v3m2 segmentor of 16-32 channels, windows of 24 voxels."""
    cfg = dict(type="PT-v3m2", in_channels=4, order=("hilbert", "hilbert-trans", "z", "z-trans"), stride=(2, 2),
               enc_depths=(2, 2, 2), enc_channels=(16, 24, 32), enc_num_head=(2, 3, 4), enc_patch_size=(24, 24, 24),
               dec_depths=(2, 2), dec_channels=(16, 24), dec_num_head=(2, 3), dec_patch_size=(24, 24), mlp_ratio=2,
               layer_scale=0.5, drop_path=0.0)
    return build_model(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=16,
                            backbone={**cfg, **backbone}))


def events(sizes: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Track-like events of `sizes` points (coordinates in detector units, on distinct unit cells)."""
    g = torch.Generator().manual_seed(seed)
    coords, feats = [], []
    for i, n in enumerate(sizes):
        steps = torch.randint(-1, 2, (3 * n + 1, 3), generator=g)
        cells = torch.unique(steps.cumsum(0) + 30 * i, dim=0)[:n]
        coords.append(cells.double() + 0.25 + 0.5 * torch.rand(len(cells), 3, generator=g, dtype=torch.float64))
        feats.append(torch.randn(len(cells), 4, generator=g))
    return torch.cat(coords).float(), torch.cat(feats), torch.tensor([len(c) for c in coords]).cumsum(0)


# ----------------------------------------------------------------------------- published names and function

@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_state_dict_has_the_published_names_shapes_and_dtypes(name):
    with torch.device("meta"):
        model = build_model(CONFIGURATIONS[name])
    ours = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()}
    published = MANIFEST[name]["state_dict"]
    assert sorted(set(published) - set(ours)) == [] and sorted(set(ours) - set(published)) == []
    assert {k: v for k, v in ours.items() if published[k] != v} == {}


@pytest.mark.parametrize("name", sorted(OUTPUTS["models"]))
def test_published_input_dict_gives_the_published_logits(name):
    """Seeded as the published forward was: its pooled levels draw their order permutation from the
    global RNG, and pimm draws at the same places."""
    reference = OUTPUTS["models"][name]
    model = build_model(reference["config"]).eval()
    model.load_state_dict(reference_weights(model.state_dict()))
    torch.manual_seed(reference["rng_seed"])
    with torch.no_grad():
        out = model({k: v.clone() if torch.is_tensor(v) else v for k, v in OUTPUTS["inputs"].items()})
    torch.testing.assert_close(out["seg_logits"], reference["seg_logits"], rtol=0, atol=OUTPUT_ATOL)


def test_the_published_dec_recipe_model_pasted_as_it_is_builds():
    source = (REPO / "configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec.py")
    if source.is_file():
        from pimm.config import load_config
        model_cfg = load_config(source)["model"]
    else:
        model_cfg = CONFIGURATIONS["semseg-dec"]
    with torch.device("meta"):
        model = build_model(model_cfg)
    assert sum(p.numel() for p in model.parameters()) == 107_093_573  # the published count (manifest)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]  # freeze_encoder=True
    assert frozen and all(n.startswith(("backbone.embedding.", "backbone.enc.")) for n in frozen)


@pytest.mark.parametrize(("override", "message"), [
    ({"enable_rpe": True}, "model.backbone.enable_rpe=True is not allowed"),
    ({"enc_channels": (16, 24)}, "model.backbone.enc_channels"),
    ({"stride": (2,)}, "model.backbone.stride"),
    ({"order": ("z", "morton")}, "model.backbone.order"),
    ({"patch": 3}, "model.backbone.patch is not an option of PT-v3m2"),
])
def test_backbone_options_it_cannot_build_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny(**override)


def test_level_zero_is_the_published_computation_without_order_draws(monkeypatch):
    """pimm's call on points one per cell equals the published call given the same grid_coord, once the
    published pooled levels draw no permutation: the depth of a lone event is the batch's."""
    model = tiny().eval()
    coord, feat, offset = events([90])
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: torch.arange(n))
    with torch.no_grad():
        ours = model(coord, feat, offset)
        grid = torch.floor(coord).long()
        published = model({"grid_coord": grid - grid.min(0).values, "feat": feat, "offset": offset,
                           "coord": coord, "grid_size": 1.0})["seg_logits"]
    torch.testing.assert_close(ours, published, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- pimm's call

def test_each_events_output_is_the_same_alone_or_in_any_batch():
    torch.manual_seed(0)
    model = tiny().eval()
    sizes = [1, 7, 0, 300, 40]  # smaller than a window, empty, many windows
    coord, feat, offset = events(sizes)
    with torch.no_grad():
        batched = model(coord, feat, offset)
        assert batched.shape == (sum(sizes), 5) and bool(torch.isfinite(batched).all())
        start = 0
        for n in sizes:
            alone = model(coord[start:start + n], feat[start:start + n], torch.tensor([n]))
            torch.testing.assert_close(alone, batched[start:start + n], rtol=0, atol=2e-5)
            start += n


def test_points_sharing_a_cell_share_its_logits():
    model = tiny(stride=(2, 2)).eval()
    coord, feat, offset = events([60])
    twins = torch.cat([coord, coord[:10] + 0.01])  # ten points in cells already taken
    with torch.no_grad():
        out = model(twins, torch.cat([feat, feat[:10]]), torch.tensor([70]))
    torch.testing.assert_close(out[60:], out[:10], rtol=0, atol=0)


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = tiny(drop_path=0.2).train()
    coord, feat, offset = events([1, 7, 300])
    logits = model(coord, feat, offset, event_id=torch.tensor([3, 4, 5]))
    torch.nn.functional.cross_entropy(logits, torch.randint(0, 5, (len(coord),))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert bool(p.grad.abs().sum() > 0), name


def test_training_draws_of_an_event_depend_on_the_step_and_its_id_only():
    """Drop path and order permutations with announced steps: an event's training output is the same
    alone or in a batch, in any position (1 vs N ranks, micro-batches); another step or id draws otherwise."""
    torch.manual_seed(3)
    model = tiny(drop_path=0.5).train()
    sizes = [40, 60, 90]
    coord, feat, offset = events(sizes, seed=1)
    parts = list(zip(coord.split(sizes), feat.split(sizes)))
    ids = torch.tensor([11, 12, 13])

    def run(step: int, order: list[int], event_ids: torch.Tensor) -> list[torch.Tensor]:
        model.backbone.begin_optimizer_step(step)
        c = torch.cat([parts[i][0] for i in order])
        f = torch.cat([parts[i][1] for i in order])
        out = model(c, f, torch.tensor([sizes[i] for i in order]).cumsum(0), event_id=event_ids[order])
        return list(out.split([sizes[i] for i in order]))

    batched = run(5, [0, 1, 2], ids)
    for i in range(3):
        torch.testing.assert_close(batched[i], run(5, [i], ids)[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(batched[i], run(5, [2, 0, 1], ids)[(i + 1) % 3], rtol=0, atol=2e-5)
    assert all(torch.equal(a, b) for a, b in zip(batched, run(5, [0, 1, 2], ids)))
    assert any(not torch.allclose(a, b) for a, b in zip(batched, run(6, [0, 1, 2], ids)))
    assert any(not torch.allclose(a, b) for a, b in zip(batched, run(5, [0, 1, 2], ids + 100)))


def test_windows_follow_the_published_padding():
    """An event of n > P voxels repeats the P - n % P voxels before its last window; n <= P is one
    window of n (the rest masked); the published non-flash path shrinks P to the smallest event."""
    grid = torch.stack([torch.arange(30), torch.zeros(30, dtype=torch.long), torch.zeros(30, dtype=torch.long)], 1)
    batch = torch.tensor([0] * 10 + [1] * 20)
    level = Level(grid, batch, 2, published=True)
    level.serialize(["z"], None)
    flash = level.windows(0, 8, shrink_to_smallest=False)
    # event 0 (10 voxels): windows [0..7], [2..9]; event 1 (20): [10..17], [18..25], [22..29]
    expected = [*range(0, 8), *range(8, 10), *range(2, 8), *range(10, 18), *range(18, 26), *range(26, 30),
                *range(22, 26)]
    assert level.order_idx[0][flash.gather].tolist() == expected and flash.key_mask is None
    small = level.windows(0, 16, shrink_to_smallest=False)  # event 0 one window of 10 (6 masked)
    assert small.key_mask is not None and small.key_mask.view(-1)[:16].tolist() == [True] * 10 + [False] * 6
    assert level.windows(0, 16, shrink_to_smallest=True).size == 10  # published non-flash: the smallest event


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
    """PT-v3m2 with drop path on (tiny_ptv3: 0.2, per voxel) and shuffled curves: 1 rank, 2 ranks (DDP,
    FSDP2) and 1 rank in 2 micro-batches give the same losses: the randomness is keyed by step and event, not rank. The
    2-rank DDP run is the first 4 steps of the module's reference epoch (constant learning rate; loader
    workers change no event)."""
    one, loss1 = launch_ptv3(tmp_path, tiny_data, 1, "one")
    two_steps = {step: ids for step, ids in steps(ptv3_reference).items() if step <= 4}
    loss2 = [loss for step, loss in sorted(losses(ptv3_reference).items()) if step <= 4]
    fsdp, loss3 = launch_ptv3(tmp_path, tiny_data, 2, "fsdp2", "parallel.strategy=fsdp2",
                              "parallel.wrap_classes=[Block]")
    accum, loss4 = launch_ptv3(tmp_path, tiny_data, 1, "accum", "grad_accum_steps=2")
    assert steps(one) == two_steps == steps(fsdp) == steps(accum)  # the same global batches, by construction
    assert len(loss1) == 4
    for other in (loss2, loss3, loss4):
        worst = max(abs(a - b) / abs(a) for a, b in zip(loss1, other, strict=True))
        assert worst <= LOSS_RTOL, (loss1, other)
    log = (fsdp / "logs" / "rank0.log").read_text()
    assert "fsdp2: 5 Block module(s) sharded" in log


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
    ("model.backbone.enc_depths=[1,1]", "model.backbone.enc_channels=[16, 32, 64] is not allowed: it has 3 entries"),
    ("model.backbone.dec_depths=[1,1,1]", "it has 3 entries but the decoder has 2 stage(s) (len(enc_depths) - 1)"),
    ("model.backbone.order=[z,peano]", "model.backbone.order must be one of z, z-trans, hilbert, hilbert-trans"),
    ("model.backbone.enc_num_head=[3,3,3]", "enc_channels must be divisible by it stage by stage (16 by 3)"),
    ("model.backbone.drop_path=1.5", "model.backbone.drop_path=1.5 is not allowed: model.backbone.drop_path must be"),
    ("model.grid_size=0", "model.grid_size=0 is not allowed: model.grid_size must be a finite number > 0"),
    ("model.backbone.layer_scale=-1", "model.backbone.layer_scale=-1 is not allowed"),
])
def test_bad_model_options_exit_2_before_any_process(tmp_path, tiny_data, override, message):
    res = pimm_in_process(["launch", "--train.config", TINY_PTV3, "--paths.exp-root", str(tmp_path), "--dry-run", "--",
                           f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}",
                           "model.backbone.enc_depths=[1,1,1]", "model.backbone.enc_channels=[16,32,64]",
                           "model.backbone.enc_num_head=[2,4,4]", "model.backbone.enc_patch_size=[16,16,16]",
                           "model.backbone.stride=[2,2]", "model.backbone.dec_depths=[1,1]",
                           "model.backbone.dec_channels=[16,32]", "model.backbone.dec_num_head=[2,4]",
                           "model.backbone.dec_patch_size=[16,16]", override])
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not any(tmp_path.iterdir())


def test_published_criteria_become_the_tasks_loss_terms():
    from pimm.config import load_config
    from pimm.tasks import build_task

    cfg = load_config(REPO / "configs/tests/tiny_ptv3.py")
    cfg["model"]["criteria"] = [  # the published dec recipe's, as written there
        dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1),
        dict(type="LovaszLoss", mode="multiclass", loss_weight=1.0 / 20.0, ignore_index=-1, class_weights=None)]
    terms = build_task(cfg).loss_terms
    assert [(w, type(t).__name__) for w, t in terms] == [(1.0, "CrossEntropy"), (0.05, "Lovasz")]
    cfg["task"]["loss"] = [dict(type="CrossEntropy")]
    with pytest.raises(ConfigError, match="task.loss and model.criteria are both set"):
        build_task(cfg)
    cfg["task"]["loss"] = None
    cfg["model"]["criteria"][0]["weight"] = [1.0, 2.0, 1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match=r"model.criteria\[0\].weight=.* set task.class_weights instead"):
        build_task(cfg)


def test_the_backbone_alone_takes_the_published_input_dict():
    """PT-v3m2 called as the published backbone is (model.backbone(data_dict)): .feat per point, the
    features the segmentor's head reads."""
    model = tiny().eval()
    coord, feat, offset = events([50, 80])
    grid = torch.floor(coord).long()
    with pytest.raises(ValueError, match="grid_coord must be >= 0"):
        model({"grid_coord": grid - 1000, "feat": feat, "offset": offset})
    data = {"grid_coord": grid - grid.min(0).values, "feat": feat, "offset": offset}
    with torch.no_grad():
        torch.manual_seed(0)
        point = model.backbone(data)
        torch.manual_seed(0)
        logits = model(data)["seg_logits"]
    assert point.feat.shape == (len(coord), 16)
    torch.testing.assert_close(model.seg_head(point.feat), logits, rtol=0, atol=0)
