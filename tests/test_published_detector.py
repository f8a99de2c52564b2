"""The published PILArNet-M detector recipes (configs/panda/panseg/*) against the published files.

Every expected value is cited as `<recipe>.py:<line>` of DeepLearnPhysics/pimm
configs/panda/panseg/detector-v1m1-pt-v3m2-ft-<recipe>.py, or names the published module it comes from.
tests/data/published_detector_manifest.json is the published Detector built from the pid-dec and vtx-dec
files' own `model` (scripts/published_reference.py detector-manifest), and the momentum detector of
detector-v1m2-pt-v3m2-ft-pid-dec.py ("v1m2-pid-dec.py:N"; with and without its IoU head). Fast but for the
end-to-end run: configs are loaded and models built on the meta device.
"""

import json
import math

import published_groups
import pytest
import torch
from conftest import REPO, attempts, losses, run_pimm, weights

from pimm.config import load_config
from pimm.config.validate import check_config, panoptic_loss_weights, task_loss
from pimm.data.synth import write_pilarnet
from pimm.engine.optim import build_optimizer, build_scheduler
from pimm.models import build_model

RECIPES = tuple(f"{label}-{kind}" for label in ("pid", "vtx") for kind in ("dec", "fft", "scratch"))
MANIFEST = json.loads((REPO / "tests/data/published_detector_manifest.json").read_text())
SCALE = 768.0 * math.sqrt(3.0) / 2.0  # NormalizeCoord's scale, pid-dec.py:143, vtx-dec.py:135
PIMM_MODEL_KEYS = {"grid_size", "grid_origin"}  # pimm's: the published grid_coord in detector units


def recipe(name: str, version: str = "v1m1") -> dict:
    return load_config(REPO / "configs" / "panda" / "panseg" / f"detector-{version}-pt-v3m2-ft-{name}.py")


def plain(value):
    """A config value as the manifest's JSON holds it (tuples as lists)."""
    return json.loads(json.dumps(value))


def lookup(cfg: dict, path: tuple):
    for key in path:
        cfg = cfg[key]
    return cfg


PID, VTX = RECIPES[:3], RECIPES[3:]
# (key path, {recipe: published value}); *-scratch.py inherit *-fft.py (pid-scratch.py:1, vtx-scratch.py:1) and
# change nothing pimm has a key for
TABLE = [
    (("seed",), dict.fromkeys(RECIPES, 0)),  # pid-dec.py:13, vtx-dec.py:13
    (("epochs",), dict.fromkeys(RECIPES, 20)),  # pid-dec.py:22, vtx-dec.py:21
    (("batch_size",), dict.fromkeys(RECIPES, 48)),  # pid-dec.py:4, vtx-dec.py:4
    (("num_worker",), dict.fromkeys(RECIPES, 24)),  # pid-dec.py:5, vtx-dec.py:5
    (("clip_grad",), dict.fromkeys(RECIPES, 1.0)),  # pid-dec.py:8, pid-fft.py:8, vtx-dec.py:8, vtx-fft.py:8
    (("amp",), dict.fromkeys(RECIPES, {"enabled": True, "dtype": "bfloat16"})),  # pid-dec.py:10-11
    (("optimizer",), dict.fromkeys(RECIPES, {"type": "AdamW", "lr": 2e-4, "weight_decay": 0.01})),  # pid-dec.py:109-130
    (("scheduler",), {**{k: {"type": "OneCycleLR", "max_lr": 2e-4, "pct_start": 0.025, "anneal_strategy": "cos",
                              "div_factor": 10.0, "final_div_factor": 1000.0} for k in PID},  # pid-dec.py:131-138
                      **{k: {"type": "OneCycleLR", "max_lr": 2e-4, "pct_start": 0.05, "anneal_strategy": "cos",
                             "div_factor": 10.0, "final_div_factor": 1000.0} for k in VTX}}),  # vtx-dec.py:123-130
    (("model", "backbone", "freeze_encoder"), {k: k.endswith("dec") for k in RECIPES}),  # pid-dec.py:64, pid-fft.py:64
    (("model", "grid_origin"), dict.fromkeys(RECIPES, 384.0)),  # NormalizeCoord center, pid-dec.py:143
    (("model", "grid_size"), dict.fromkeys(RECIPES, 0.001 * SCALE)),  # GridSample 0.001, pid-dec.py:145
    (("pretrained", "path"), dict.fromkeys(RECIPES, None)),  # weights come from the command line (-w)
    (("pretrained", "key_map"), {k: [] if k.endswith("scratch") else "sonata" for k in RECIPES}),  # pid-dec.py:223-227
    (("pretrained", "strict"), {k: k.endswith("scratch") for k in RECIPES}),  # CheckpointLoader's strict=False
    (("task", "label"), {**dict.fromkeys(PID, "particle"), **dict.fromkeys(VTX, "interaction")}),  # pid-dec.py:150
    (("task", "stuff_classes"), {**dict.fromkeys(PID, [5]), **dict.fromkeys(VTX, [0])}),  # pid-dec.py:242, vtx:249
    (("task", "iou_threshold"), dict.fromkeys(RECIPES, 0.5)),  # iou_thresh, pid-dec.py:243
    (("task", "best_metric"), dict.fromkeys(RECIPES, "detection_f1_pooled")),  # evaluator.py: ins_det_f1
    (("data", "num_classes"), dict.fromkeys(RECIPES, 6)),  # pid-dec.py:173 (vtx: pimm's, the reader's pid labels)
    (("eval_every_n_steps",), dict.fromkeys(RECIPES, 1000)),  # evaluator every_n_steps, pid-dec.py:239
] + [
    (("data", split, key), dict.fromkeys(RECIPES, value))
    for split in ("train", "val", "test")
    for key, value in (("type", "PILArNetDataset"), ("revision", "v2"), ("label", "pid"), ("instances", True),
                       ("min_points", 1024), ("energy_threshold", 0.13), ("remove_low_energy_scatters", False),
                       ("features", "published"), ("max_len", 1_000_000 if split == "train" else 1000))
]  # pid-dec.py:176-211, vtx-dec.py:183-217


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_is_a_valid_config_with_the_published_values(name):
    cfg = recipe(name)
    check_config(cfg)
    for path, expected in TABLE:
        value = lookup(cfg, path)
        if isinstance(expected[name], float):
            assert value == pytest.approx(expected[name], rel=1e-12), (path, value)
        else:
            assert plain(value) == expected[name], (path, value)
    # the published InstanceSegmentationLoss, pasted: pid-dec.py:88-105, vtx-dec.py:81-97
    criteria = MANIFEST["pid-dec" if name.startswith("pid") else "vtx-dec"]["config"]["criteria"]
    assert plain(task_loss(cfg)) == criteria
    assert panoptic_loss_weights(task_loss(cfg))["dice"] == 5.0  # loss_weight_dice, pid-dec.py:95
    transforms = {split: cfg["data"][split]["transforms"] for split in ("train", "val", "test")}
    grid = {"type": "GridSample", "grid_size": pytest.approx(0.001 * SCALE), "mode": "random",
            "return_grid_coord": True}
    assert transforms["val"] == transforms["test"] == [grid]  # test_transform, pid-dec.py:158-169
    assert transforms["train"][0] == grid and [t["type"] for t in transforms["train"][1:]] == [  # pid-dec.py:142-157
        "RandomRotate", "RandomRotate", "RandomRotate", "RandomFlip"]


@pytest.mark.parametrize("name", RECIPES)
def test_the_model_is_the_published_one_name_for_name(name):
    """The recipe's model is the published file's `model` (plus pimm's grid keys; fft only unfreezes the
    encoder, pid-fft.py:64), and pimm's Detector built from it has the published Detector's state_dict:
    every name, shape and dtype."""
    reference = MANIFEST[name.split("-")[0] + "-dec"]
    model_cfg = recipe(name)["model"]
    published = dict(reference["config"])
    if not name.endswith("dec"):
        published["backbone"] = {**published["backbone"], "freeze_encoder": False}
    assert set(model_cfg) - set(published) == PIMM_MODEL_KEYS
    assert plain({k: model_cfg[k] for k in published}) == published
    with torch.device("meta"):
        model = build_model(model_cfg)
    ours = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()}
    expected = reference["state_dict"]
    assert sorted(set(expected) - set(ours)) == [] and sorted(set(ours) - set(expected)) == []
    assert {k: v for k, v in ours.items() if expected[k] != v} == {}


def published_lr_and_decay(name: str, model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """Name -> (lr, weight decay) of every trained parameter under the published recipe: build_optimizer of
    pimm/utils/optimizer.py (the first param_dicts keyword contained in the name, else the default group),
    then the WeightDecayExclusion hook (pid-dec.py:248-255, pimm/engines/hooks/misc.py)."""
    base_lr, base_wd, lr_decay, depth = 2e-4, 0.01, 0.97, 3  # pid-dec.py:108-110, 70
    keywords = []
    if not name.endswith("dec"):  # pid-fft.py:120-129, backbone_mult 1.0 (pid-fft.py:111)
        enc_depths = (3, 3, 3, 9, 3)
        for e, blocks in enumerate(enc_depths):
            for b in range(blocks):
                exponent = (sum(enc_depths) - sum(enc_depths[:e]) - b - 1) + depth
                keywords.append((f"enc{e}.block{b}.", base_lr * lr_decay**exponent * 1.0))
    keywords += [(f"decoder.blocks.{b}.", base_lr * lr_decay ** (depth - b - 1)) for b in range(depth)]
    return published_groups.published_lr_and_decay(model, keywords, base_lr, base_wd)


@pytest.mark.parametrize("name", RECIPES)
def test_param_groups_give_every_parameter_the_published_lr_and_weight_decay(name):
    check_param_groups(recipe(name), name)


def check_param_groups(cfg: dict, name: str) -> None:
    with torch.device("meta"):
        model = build_model(cfg["model"])
    expected = published_lr_and_decay(name, model)
    seen, groups = published_groups.pimm_lr_and_decay(model, cfg)
    wrong = published_groups.mismatches(seen, expected)
    assert not wrong, wrong[:5]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if name.endswith("dec"):  # freeze_encoder with enc_mode (pid-dec.py:63-64): the whole backbone is fixed
        assert frozen == {n for n, _ in model.named_parameters() if n.startswith("backbone.")}
        assert all(n.startswith("decoder.") for n in expected)
    else:
        assert not frozen
        assert expected["backbone.embedding.stem.linear.weight"] == (2e-4, 0.01)  # in no published keyword: base_lr
    # OneCycleLR's peak per group is the group's lr, as the published max_lr list (pid-dec.py:133)
    optimizer = build_optimizer(cfg["optimizer"], groups)
    build_scheduler(cfg["scheduler"], optimizer, total_steps=100)
    for group in optimizer.param_groups:
        assert group["max_lr"] == pytest.approx(cfg["optimizer"]["lr"] * group["lr_scale"], rel=1e-12)
        assert group["initial_lr"] == pytest.approx(group["max_lr"] / 10.0)


PID_KINDS = ("dec", "fft", "scratch")
MOMENTUM = {"type": "MomentumTransform", "keys": ["momentum"]}  # v1m2-pid-dec.py:147, 164; v1m2-pid-fft.py:158, 175


@pytest.mark.parametrize("kind", PID_KINDS)
def test_each_momentum_recipe_is_a_valid_config_with_the_published_values(kind):
    """The v1m2 pid files equal the v1m1 ones but for the model type, train_filter_use_gt and predict_iou (dec),
    iou_loss_weight (dec) and MomentumTransform: TABLE's values hold for them as for v1m1's."""
    name = f"pid-{kind}"
    cfg = recipe(name, "v1m2")
    check_config(cfg)
    for path, expected in TABLE:
        value = lookup(cfg, path)
        if isinstance(expected[name], float):
            assert value == pytest.approx(expected[name], rel=1e-12), (path, value)
        else:
            assert plain(value) == expected[name], (path, value)
    # dec: v1m2-pid-dec.py:89-107 (iou_loss_weight=1.0, :100); fft and scratch: v1m1's (v1m2-pid-fft.py:89-105)
    criteria = MANIFEST["v1m2-pid-dec" if kind == "dec" else "pid-dec"]["config"]["criteria"]
    assert plain(task_loss(cfg)) == criteria
    assert panoptic_loss_weights(task_loss(cfg)).get("iou") == (1.0 if kind == "dec" else None)
    transforms = {split: plain(cfg["data"][split]["transforms"]) for split in ("train", "val", "test")}
    grid = {"type": "GridSample", "grid_size": pytest.approx(0.001 * SCALE), "mode": "random",
            "return_grid_coord": True}
    assert transforms["val"] == transforms["test"] == [MOMENTUM, grid]  # test_transform, v1m2-pid-dec.py:161-173
    assert transforms["train"][:2] == [MOMENTUM, grid] and [t["type"] for t in transforms["train"][2:]] == [
        "RandomRotate", "RandomRotate", "RandomRotate", "RandomFlip"]  # v1m2-pid-dec.py:144-160
    assert transforms["train"][2:] == plain(recipe(name)["data"]["train"]["transforms"][1:])


@pytest.mark.parametrize("kind", PID_KINDS)
def test_the_momentum_model_is_the_published_one_name_for_name(kind):
    """The v1m2 recipe's model is the published file's `model` (fft: v1m2-pid-fft.py:32 train_filter_use_gt=False,
    :64 freeze_encoder=False, no predict_iou (:34 in dec), v1m1's criteria) and pimm's detector-v1m2 built from it
    has the published state_dict, decoder.momentum_regressor.backbone.fc{1,2} included; with predict_iou=True
    also decoder.iou_pred.mlp.fc{1,2}."""
    model_cfg = recipe(f"pid-{kind}", "v1m2")["model"]
    published = dict(MANIFEST["v1m2-pid-dec"]["config"])
    if kind != "dec":
        published.pop("predict_iou")
        published.update(train_filter_use_gt=False, criteria=MANIFEST["pid-dec"]["config"]["criteria"],
                         backbone={**published["backbone"], "freeze_encoder": False})
    assert set(model_cfg) - set(published) == PIMM_MODEL_KEYS
    assert plain({k: model_cfg[k] for k in published}) == published
    for changes, reference in (({}, "v1m2-pid-dec"), ({"predict_iou": True}, "v1m2-pid-dec-iou")):
        with torch.device("meta"):
            model = build_model({**model_cfg, **changes})
        ours = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()}
        assert ours == MANIFEST[reference]["state_dict"]
    assert "decoder.momentum_regressor.backbone.fc1.weight" in ours and "decoder.iou_pred.mlp.fc2.bias" in ours


@pytest.mark.parametrize("kind", PID_KINDS)
def test_momentum_param_groups_are_the_published_ones(kind):
    """The v1m2 pid files' param_dicts and weight-decay rule are the v1m1 files' (v1m2-pid-dec.py:110-140)."""
    check_param_groups(recipe(f"pid-{kind}", "v1m2"), f"pid-{kind}")


def test_the_decoder_positions_are_the_feature_coordinates_as_the_published_point_coord(monkeypatch):
    """The published decoder's pos_emb reads point.coord (detector_v1m1.py:807): the coordinates after
    NormalizeCoord and the augmentations, which are pimm's x, y, z feature columns, not the voxel grid's."""
    model = build_model(load_config(REPO / "configs/tests/tiny_published_detector.py")["model"]).train()
    generator = torch.Generator().manual_seed(0)
    coord = torch.stack([torch.randperm(768, generator=generator)[:300] for _ in range(3)], 1).float()
    feat = torch.randn(300, 4, generator=generator)  # one point per voxel: each voxel's mean is its point
    seen = []
    decode = model.decoder.forward
    monkeypatch.setattr(model.decoder, "forward", lambda f, offset, position, rows: seen.append(position[rows]) or
                        decode(f, offset, position, rows))
    model(coord, feat, torch.tensor([300]))
    rows = sorted(map(tuple, seen[0].tolist()))
    assert len(rows) <= 300 and set(rows) <= set(map(tuple, feat[:, :3].tolist()))


def test_a_sonata_checkpoint_fine_tuned_with_the_detector_dec_recipe_keeps_its_frozen_encoder(tmp_path):
    """The pid dec recipe (configs/tests/tiny_published_detector.py: its data, transforms, task, losses and
    groups at a small width) from a Sonata pretraining payload ({"state_dict": {"module.student.backbone.*",
    teacher, heads}}, key_map="sonata"), 1 rank, 2 steps: the student's encoder loads, the teacher and heads
    are left out, the frozen encoder ends bitwise as loaded; both steps have a finite loss."""
    root = tmp_path / "pil"
    write_pilarnet(root, 8, seed=51, split="train", revision="v2", points_per_event=500)
    write_pilarnet(root, 4, seed=52, split="val", revision="v2", points_per_event=500)
    cfg = load_config(REPO / "configs/tests/tiny_published_detector.py")
    torch.manual_seed(5)
    pretrained = build_model(cfg["model"])
    encoder = {k: v for k, v in pretrained.state_dict().items() if k.startswith("backbone.")}
    payload = {f"module.student.{k}": v for k, v in encoder.items()}
    payload.update({f"module.teacher.{k}": v.clone() + 1.0 for k, v in encoder.items()})
    payload["module.student.heads.proto.weight"] = torch.zeros(8, 4)
    checkpoint = tmp_path / "sonata.pth"
    torch.save({"epoch": 3, "state_dict": payload}, checkpoint)

    res = run_pimm(["launch", "--train.config", "tests/tiny_published_detector", "--run.name", "det",
                    "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), "--",
                    f"pretrained.path={checkpoint}", "data.test=null", "max_steps=2", "data.train.min_points=100",
                    "data.val.min_points=100", *(f"data.{s}.path={root}" for s in ("train", "val"))],
                   cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = tmp_path / "exp" / "tests" / "det"
    attempt = attempts(run_dir)[-1]
    assert attempt["world_size"] == 1 and attempt["pretrained"]["loaded"] == len(encoder)
    assert f"loaded {len(encoder)} of" in res.stdout and "left out by key_map='sonata'" in res.stdout
    final = weights(run_dir)
    for name, value in encoder.items():  # freeze_encoder=True with enc_mode (pid-dec.py:63-64): all fixed
        assert torch.equal(final[name], value), name
    trained = losses(run_dir)
    assert sorted(trained) == [1, 2] and all(math.isfinite(v) and v > 0 for v in trained.values()), trained
