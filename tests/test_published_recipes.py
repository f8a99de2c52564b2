"""The published PILArNet-M semantic-segmentation recipes (configs/panda/semseg/*) against the published files.

Every expected value is cited as `<recipe>.py:<line>` of DeepLearnPhysics/pimm
configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-<recipe>.py, or names the published module it
comes from. Fast: configs are loaded, models built on the meta device, transforms run on numpy.
"""

import math

import numpy as np
import published_groups
import pytest
import torch
from conftest import REPO

from pimm.config import load_config
from pimm.config.validate import task_loss
from pimm.data.dataset import build_dataset
from pimm.data.synth import write_pilarnet
from pimm.data.transforms import build_transforms, feature_columns
from pimm.engine.optim import build_optimizer, build_scheduler
from pimm.models import build_model

RECIPES = ("lin", "dec", "fft", "scratch")
SCALE = 768.0 * math.sqrt(3.0) / 2.0  # NormalizeCoord's scale, lin.py:84 / dec.py:107 / fft.py:123
CONTEXT = {"volume_size": 768.0, "energy_scale": 1.0}


def recipe(name: str) -> dict:
    return load_config(REPO / "configs" / "panda" / "semseg" / f"semseg-pt-v3m2-pilarnet-ft-5cls-{name}.py")


def published_energy(e: float) -> float:
    """LogTransform.log_transform of the published pimm/datasets/transform.py with min_val 0.01, max_val 20."""
    lo, hi = 0.01, 20.0
    return 2.0 * (math.log10(e + lo) - math.log10(lo)) / (math.log10(hi + lo) - math.log10(lo)) - 1.0


def test_the_published_energy_feature_has_no_clip():
    energies = np.array([0.01, 1.0, 20.0, 100.0], dtype=np.float32)
    coord = np.array([[0.0, 384.0, 768.0]] * 4, dtype=np.float32)
    feat = feature_columns({"coord": coord, "energy": energies}, 768.0, 1.0, "published")
    np.testing.assert_allclose(feat[:, 3], [published_energy(float(e)) for e in energies], rtol=1e-6)
    assert feat[2, 3] == pytest.approx(1.0, abs=1e-6) and feat[3, 3] == pytest.approx(1.4234, abs=1e-4)
    # NormalizeCoord(center=384, scale=768 * sqrt(3) / 2) of the published transform.py
    np.testing.assert_allclose(feat[0, :3], [-384.0 / SCALE, 0.0, 384.0 / SCALE], rtol=1e-6)


# (key path, {recipe: published value}); scratch.py inherits fft.py (scratch.py:1) with no other change that
# pimm has a key for (it renames the Weights & Biases run)
TABLE = [
    (("seed",), dict.fromkeys(RECIPES, 0)),  # lin.py:12, dec.py:12, fft.py:12
    (("epochs",), dict.fromkeys(RECIPES, 20)),  # lin.py:69, dec.py:69, fft.py:69
    (("batch_size",), dict.fromkeys(RECIPES, 48)),  # lin.py:4, dec.py:4, fft.py:4
    (("num_worker",), dict.fromkeys(RECIPES, 24)),  # lin.py:5, dec.py:5, fft.py:5
    (("clip_grad",), {"lin": None, "dec": 1.0, "fft": None, "scratch": None}),  # lin.py:7, dec.py:7, fft.py:7
    (("amp", "dtype"), dict.fromkeys(RECIPES, "bfloat16")),  # lin.py:10, dec.py:10, fft.py:10
    (("optimizer",), {"lin": {"type": "AdamW", "lr": 0.0015, "weight_decay": 0.01},  # lin.py:71
                      **dict.fromkeys(("dec", "fft", "scratch"),  # dec.py:71,73,93; fft.py:71,73,109
                                      {"type": "AdamW", "lr": 0.0026, "weight_decay": 0.04})}),
    (("scheduler", "pct_start"), dict.fromkeys(RECIPES, 0.05)),  # lin.py:75, dec.py:98, fft.py:114
    (("scheduler", "anneal_strategy"), dict.fromkeys(RECIPES, "cos")),  # lin.py:76, dec.py:99, fft.py:115
    (("scheduler", "div_factor"), dict.fromkeys(RECIPES, 10.0)),  # lin.py:77, dec.py:100, fft.py:116
    (("scheduler", "final_div_factor"), dict.fromkeys(RECIPES, 1000.0)),  # lin.py:78, dec.py:101, fft.py:117
    (("model", "backbone_out_channels"), {"lin": 1232, "dec": 64, "fft": 64, "scratch": 64}),  # lin.py:27, dec.py:27
    (("model", "freeze_backbone"), {"lin": True, "dec": False, "fft": False, "scratch": False}),  # lin.py:65, dec.py:65
    (("model", "backbone", "enc_mode"), {"lin": True, "dec": False, "fft": False, "scratch": False}),  # lin.py:56
    (("model", "backbone", "freeze_encoder"), {"lin": False, "dec": True, "fft": False, "scratch": False}),  # dec.py:57
    (("model", "backbone", "traceable"), {"lin": True, "dec": False, "fft": False, "scratch": False}),  # lin.py:54
    (("model", "backbone", "drop_path"), dict.fromkeys(RECIPES, 0.3)),  # lin.py:47, dec.py:47, fft.py:47
    (("model", "backbone", "layer_scale"), dict.fromkeys(RECIPES, 0.0)),  # lin.py:41, dec.py:44, fft.py:44
    (("model", "backbone", "order"), dict.fromkeys(RECIPES, ("hilbert", "hilbert-trans", "z", "z-trans"))),  # :31
    (("model", "backbone", "enc_depths"), dict.fromkeys(RECIPES, (3, 3, 3, 9, 3))),  # lin.py:33, dec.py:33
    (("model", "backbone", "enc_channels"), dict.fromkeys(RECIPES, (48, 96, 192, 384, 512))),  # :34
    (("model", "backbone", "dec_channels"), dict.fromkeys(RECIPES, (64, 96, 192, 384))),  # :38
    (("model", "grid_origin"), dict.fromkeys(RECIPES, 384.0)),  # NormalizeCoord center, lin.py:84, dec.py:107
    (("model", "grid_size"), dict.fromkeys(RECIPES, 0.001 * SCALE)),  # GridSample 0.001, lin.py:88, dec.py:109
    (("pretrained", "path"), dict.fromkeys(RECIPES, None)),  # weights come from the command line (-w)
    (("pretrained", "strict"), dict.fromkeys(RECIPES, False)),  # CheckpointLoader strict=False, lin.py:186
    (("pretrained", "key_map"), dict.fromkeys(RECIPES, "sonata")),  # student backbone -> backbone, lin.py:184-185
    (("data", "num_classes"), dict.fromkeys(RECIPES, 5)),  # lin.py:123, dec.py:140
    (("data", "names"), dict.fromkeys(RECIPES, ["shower", "track", "michel", "delta", "led"])),  # lin.py:125
] + [
    (("data", split, key), dict.fromkeys(RECIPES, value))
    for split in ("train", "val", "test")
    for key, value in (("type", "PILArNetDataset"), ("revision", "v1"), ("label", "motif"), ("min_points", 1024),
                       ("remove_low_energy_scatters", False), ("features", "published"))  # lin.py:126-163
] + [
    (("data", "train", "energy_threshold"), {"lin": 0.0, "dec": 0.13, "fft": 0.13, "scratch": 0.13}),  # lin.py:134
    (("data", "val", "energy_threshold"), dict.fromkeys(RECIPES, 0.13)),  # lin.py:147, dec.py:162
    (("data", "test", "energy_threshold"), dict.fromkeys(RECIPES, 0.13)),  # lin.py:160, dec.py:174
    (("data", "train", "max_len"), dict.fromkeys(RECIPES, 1_000_000)),  # lin.py:136, dec.py:152
    (("data", "val", "max_len"), dict.fromkeys(RECIPES, 1000)),  # lin.py:149, dec.py:164
    (("data", "test", "max_len"), dict.fromkeys(RECIPES, 1000)),  # lin.py:162, dec.py:176
    (("eval_every_n_steps",), dict.fromkeys(RECIPES, 1000)),  # SemSegEvaluator every_n_steps, lin.py:191
]


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_has_the_published_values(name):
    cfg = recipe(name)
    for path, expected in TABLE:
        value = cfg
        for key in path:
            value = value[key]
        if isinstance(expected[name], float):
            assert value == pytest.approx(expected[name], rel=1e-12), (path, value)
        else:
            assert value == expected[name], (path, value)
    # CrossEntropyLoss weight 1 + LovaszLoss weight 1/20, lin.py:61-63, dec.py:61-63, fft.py:61-63
    assert task_loss(cfg) == [{"type": "CrossEntropy", "weight": 1.0}, {"type": "Lovasz", "weight": 0.05}]


def published_lr_and_decay(name: str, model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """Name -> (lr, weight decay) of every trained parameter under the published recipe: build_optimizer of
    pimm/utils/optimizer.py (the first param_dicts keyword contained in the name, else the default group),
    then the WeightDecayExclusion hook of pimm/engines/hooks/misc.py where the recipe lists it."""
    if name == "lin":
        base_lr, base_wd, keywords, exclusion = 0.0015, 0.01, [("block", 0.00015)], False  # lin.py:71, 80
    else:
        base_lr, base_wd, exclusion = 0.0026, 0.04, True  # dec.py:71, 73, 194-201
        dec_depths, enc_depths = (2, 2, 2, 2), (3, 3, 3, 9, 3)
        keywords = []
        if name in ("fft", "scratch"):  # fft.py:86-94, backbone_mult 0.05 (fft.py:76)
            for e, depth in enumerate(enc_depths):
                for b in range(depth):
                    exponent = (sum(enc_depths) - sum(enc_depths[:e]) - b - 1) + sum(dec_depths)
                    keywords.append((f"enc{e}.block{b}.", base_lr * (0.9**exponent) * 0.05))
        for e, depth in enumerate(dec_depths):  # dec.py:83-91, fft.py:97-105
            for b in range(depth):
                exponent = sum(dec_depths) - sum(dec_depths[:e]) - b - 1
                keywords.append((f"dec{e}.block{b}.", base_lr * (0.9**exponent)))
    return published_groups.published_lr_and_decay(model, keywords, base_lr, base_wd, exclusion)


@pytest.mark.parametrize("name", RECIPES)
def test_param_groups_give_every_parameter_the_published_lr_and_weight_decay(name):
    cfg = recipe(name)
    with torch.device("meta"):
        model = build_model(cfg["model"])
    expected = published_lr_and_decay(name, model)
    seen, groups = published_groups.pimm_lr_and_decay(model, cfg)
    wrong = published_groups.mismatches(seen, expected)
    assert not wrong, wrong[:5]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if name == "lin":  # freeze_backbone, lin.py:65: only the head trains
        assert set(expected) == {"seg_head.weight", "seg_head.bias"}
    elif name == "dec":  # freeze_encoder, dec.py:57
        encoder = ("backbone.embedding.", "backbone.enc.")
        assert frozen == {n for n, _ in model.named_parameters() if n.startswith(encoder)}
    else:
        assert not frozen
    # OneCycleLR's peak per group is the group's lr, as the published max_lr list (dec.py:97, fft.py:113)
    optimizer = build_optimizer(cfg["optimizer"], groups)
    build_scheduler(cfg["scheduler"], optimizer, total_steps=100)
    for group in optimizer.param_groups:
        assert group["max_lr"] == pytest.approx(cfg["optimizer"]["lr"] * group["lr_scale"], rel=1e-12)
        assert group["initial_lr"] == pytest.approx(group["max_lr"] / 10.0)
        assert group["lr"] == pytest.approx(group["initial_lr"], rel=1e-12)


def voxel_event(n: int = 4000, seed: int = 0) -> dict:
    """Distinct integer voxels of the 768 cube, as PILArNet-M stores its points."""
    rng = np.random.default_rng(seed)
    flat = rng.choice(768**3, size=n, replace=False)
    coord = np.stack(np.unravel_index(flat, (768, 768, 768)), axis=1).astype(np.float32)
    return {"coord": coord, "energy": rng.uniform(0.14, 50.0, n).astype(np.float32),
            "segment": rng.integers(0, 5, n), "point_index": np.arange(n)}


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipe_transforms_keep_every_voxel_and_move_only_the_feature_coordinates(name):
    cfg = recipe(name)
    for split in ("train", "val", "test"):
        compose = build_transforms(cfg["data"][split]["transforms"])
        ev = voxel_event(seed=len(split))
        for index in range(4):
            out = compose(dict(ev), seed=0, epoch=1, index=index, context=CONTEXT)
            # GridSample 0.001 of the normalised coordinates keeps every voxel, and its grid_coord is what the
            # model voxelises: the stored coordinates, whatever the later transforms do (dec.py:109-114)
            assert np.array_equal(out["point_index"], np.arange(len(ev["coord"])))
            assert np.array_equal(out["coord"], ev["coord"])
            feat = feature_columns(out, 768.0, 1.0, "published")
            centred = (ev["coord"].astype(np.float64) - 384.0) / SCALE
            augmented = cfg["data"][split]["transforms"][1:] != []
            if not augmented:  # test_transform: NormalizeCoord only (dec.py:125-127)
                np.testing.assert_allclose(feat[:, :3], centred, atol=1e-6)
            elif name != "lin":  # rotations and flips about the volume centre keep distances from it
                np.testing.assert_allclose(np.linalg.norm(feat[:, :3], axis=1), np.linalg.norm(centred, axis=1),
                                           rtol=1e-5)
            else:  # CenterShift first (lin.py:94), then rotations, flips and a jitter cut at 0.001 (lin.py:99)
                box = (ev["coord"].min(0) + ev["coord"].max(0)) / 2.0
                shifted = (ev["coord"].astype(np.float64) - box) / SCALE
                gap = np.linalg.norm(feat[:, :3], axis=1) - np.linalg.norm(shifted, axis=1)
                assert np.abs(gap).max() <= 0.001 * math.sqrt(3.0) + 1e-6


def test_rotation_probability_and_jitter_cut():
    ev = voxel_event(500)
    rotated = 0
    for index in range(400):
        out = build_transforms([dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8)])(
            dict(ev), 0, 0, index, CONTEXT)
        rotated += not np.array_equal(out["coord"], ev["coord"])
    assert 0.74 <= rotated / 400 <= 0.86  # p=0.8 (dec.py:111-113)
    never = build_transforms([dict(type="RandomRotate", p=0.0)])(dict(ev), 0, 0, 0, CONTEXT)
    assert np.array_equal(never["coord"], ev["coord"])
    jitter = build_transforms([dict(type="Jitter", sigma=1.0, clip=0.5)])
    noise = jitter(dict(ev), 0, 0, 0, CONTEXT)["coord"] - ev["coord"]
    assert np.abs(noise).max() <= 0.5 + 1e-4 and (np.abs(noise) > 0.49).mean() > 0.5
    shifted = build_transforms([dict(type="CenterShift")])(dict(ev), 0, 0, 0, CONTEXT)["coord"]
    np.testing.assert_allclose((shifted.min(0) + shifted.max(0)) / 2.0, [384.0] * 3, atol=1e-3)


@pytest.mark.parametrize("name", ["lin", "dec"])
def test_a_recipe_reader_gives_the_model_the_stored_voxels_and_the_published_features(tmp_path, name):
    write_pilarnet(tmp_path, 3, seed=4, revision="v1", split="train", points_per_event=1500)
    spec = dict(recipe(name)["data"]["train"], path=str(tmp_path), min_points=0)
    dataset = build_dataset(spec, seed=0)
    for index in range(len(dataset)):
        raw, item = dataset.read_raw(index), dataset[(1, index)]
        keep = raw["energy"] > spec["energy_threshold"]  # pilarnet.py: points above the threshold
        coord, energy = raw["coord"][keep].astype(np.float64), raw["energy"][keep].astype(np.float64)
        # energy features of the points stored in each voxel (a voxel may be stored in two clusters)
        choices: dict[tuple, list] = {}
        for c, e in zip(map(tuple, coord), energy):
            choices.setdefault(c, []).append(published_energy(e))
        got, feat = item["coord"].double().numpy(), item["feat"].double().numpy()
        assert sorted(map(tuple, got)) == sorted(choices)  # one point per stored voxel, not moved
        assert all(min(abs(f - x) for x in choices[tuple(c)]) < 1e-6 for c, f in zip(got, feat[:, 3]))
        if name == "dec":  # rotated and flipped about the volume centre: the same distance from it
            radius = np.linalg.norm((got - 384.0) / SCALE, axis=1)
            np.testing.assert_allclose(np.linalg.norm(feat[:, :3], axis=1), radius, rtol=1e-5)


def test_grid_sample_random_keeps_one_point_of_each_voxel_drawn_per_event_and_epoch():
    coord = np.array([[0, 0, 0], [5, 5, 5], [0, 0, 0], [0, 0, 0], [9, 9, 9]], dtype=np.float32)
    ev = {"coord": coord, "energy": np.arange(5, dtype=np.float32), "segment": np.arange(5),
          "point_index": np.arange(5)}
    compose = build_transforms([dict(type="GridSample", grid_size=1.0, mode="random")])
    kept = [compose(dict(ev), 0, epoch, 0, CONTEXT)["point_index"] for epoch in range(60)]
    assert all(len(k) == 3 and k[0] in (0, 2, 3) and list(k[1:]) == [1, 4] for k in kept)
    assert {int(k[0]) for k in kept} == {0, 2, 3}  # each of the voxel's points is drawn
    assert np.array_equal(compose(dict(ev), 0, 7, 0, CONTEXT)["point_index"], kept[7])  # seeded


def test_a_sonata_checkpoint_fine_tuned_with_the_dec_recipe_at_two_ranks_keeps_its_frozen_encoder(tmp_path):
    """The dec recipe (configs/tests/tiny_published_dec.py: its data, transforms, losses and groups at a small
    width) from a Sonata pretraining payload ({"state_dict": {"module.student.backbone.*", teacher, heads}},
    key_map="sonata"), 2 ranks with loader workers: the student's encoder loads, the teacher and heads are
    left out, the frozen encoder ends bitwise as loaded."""
    from conftest import attempts, run_pimm, weights

    root = tmp_path / "pil"
    write_pilarnet(root, 16, seed=41, split="train", revision="v1", points_per_event=600)
    write_pilarnet(root, 4, seed=42, split="val", revision="v1", points_per_event=600)
    cfg = load_config(REPO / "configs/tests/tiny_published_dec.py")
    torch.manual_seed(5)
    pretrained = build_model({**cfg["model"], "backbone": {**cfg["model"]["backbone"], "enc_mode": True}})
    encoder = {k: v for k, v in pretrained.state_dict().items() if k.startswith("backbone.")}
    payload = {f"module.student.{k}": v for k, v in encoder.items()}
    payload.update({f"module.teacher.{k}": v.clone() + 1.0 for k, v in encoder.items()})
    payload["module.student.heads.proto.weight"] = torch.zeros(8, 4)
    checkpoint = tmp_path / "sonata.pth"
    torch.save({"epoch": 3, "state_dict": payload}, checkpoint)

    res = run_pimm(["launch", "--train.config", "tests/tiny_published_dec", "--resources.nproc-per-node", "2",
                    "--run.name", "dec", "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), "--",
                    f"pretrained.path={checkpoint}", "data.test=null", "max_steps=2", "data.train.min_points=100",
                    "data.val.min_points=100", *(f"data.{s}.path={root}" for s in ("train", "val"))],
                   cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = tmp_path / "exp" / "tests" / "dec"
    attempt = attempts(run_dir)[-1]
    assert attempt["world_size"] == 2 and attempt["pretrained"]["loaded"] == len(encoder)
    assert f"loaded {len(encoder)} of" in res.stdout and "left out by key_map='sonata'" in res.stdout
    final = weights(run_dir)
    for name, value in encoder.items():  # freeze_encoder=True (dec.py:65): embedding and encoder untouched
        if name.startswith(("backbone.embedding.", "backbone.enc.")):
            assert torch.equal(final[name], value), name
