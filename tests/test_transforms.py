"""data.<split>.transforms: each transform's effect, seeding, the config check and a 1- vs 2-rank run."""

import numpy as np
import pytest
from conftest import LR0_OVERRIDES, LR0_TRANSFORMS, REPO, TINY, losses, pimm_in_process

from pimm import names
from pimm.config import apply_overrides, load_config, parse_overrides
from pimm.config.validate import TRANSFORM_ARGUMENTS, check_transforms
from pimm.data.dataset import LArTPCDataset, PILArNetDataset, build_dataset
from pimm.data.synth import write_pilarnet
from pimm.data.transforms import build_transforms, feature_columns
from pimm.errors import ConfigError

VOLUME = 100.0
CONTEXT = {"volume_size": VOLUME, "energy_scale": 1.0}


def event(n: int = 200, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"coord": rng.uniform(0, VOLUME, (n, 3)).astype(np.float32),
            "energy": rng.uniform(0.1, 2.0, n).astype(np.float32),
            "segment": rng.integers(0, 5, n), "point_index": np.arange(n)}


def run(specs, ev=None, epoch=0, index=3, seed=5):
    return build_transforms(specs)(ev or event(), seed, epoch, index, CONTEXT)


def test_the_names_table_and_the_argument_rules_agree():
    assert {k: set(v) for k, v in names.TRANSFORMS.items()} == {k: set(v) for k, v in TRANSFORM_ARGUMENTS.items()}


def test_rotation_keeps_distances_from_the_axis_through_the_centre_and_the_axis_coordinate():
    ev = event()
    out = run([dict(type="RandomRotate", axis="z")], ev)
    c0, c1 = ev["coord"] - VOLUME / 2, out["coord"] - VOLUME / 2
    np.testing.assert_allclose(np.linalg.norm(c0, axis=1), np.linalg.norm(c1, axis=1), rtol=1e-5)
    np.testing.assert_allclose(c0[:, 2], c1[:, 2], atol=1e-4)
    assert not np.allclose(c0[:, :2], c1[:, :2], atol=1e-2)


def test_flip_mirrors_about_the_centre():
    ev = event()
    out = run([dict(type="RandomFlip", axes=["x"], p=1.0)], ev)
    np.testing.assert_allclose(out["coord"][:, 0], VOLUME - ev["coord"][:, 0], atol=1e-4)
    np.testing.assert_allclose(out["coord"][:, 1:], ev["coord"][:, 1:], atol=1e-4)
    assert np.array_equal(run([dict(type="RandomFlip", p=0.0)], ev)["coord"], ev["coord"])


def test_scale_stays_in_its_range_and_jitter_has_its_sigma():
    ev = event(2000)
    for i in range(5):
        out = run([dict(type="RandomScale", scale=[0.9, 1.1])], ev, index=i)
        ratio = (out["coord"] - VOLUME / 2) / (ev["coord"] - VOLUME / 2)
        assert 0.9 <= ratio.mean() <= 1.1 and np.allclose(ratio, ratio.mean(), rtol=1e-3)
    noise = run([dict(type="Jitter", sigma=0.5)], ev)["coord"] - ev["coord"]
    assert abs(noise.std() - 0.5) < 0.02 and abs(noise.mean()) < 0.02


def test_grid_sample_keeps_the_first_point_of_each_voxel_and_tracks_stored_indices():
    ev = event(2000)
    out = run([dict(type="GridSample", grid_size=20.0)], ev)
    cells = np.floor(out["coord"] / 20.0).astype(int)
    assert len(np.unique(cells, axis=0)) == len(cells) == len(np.unique(np.floor(ev["coord"] / 20.0), axis=0))
    pi = out["point_index"]
    assert np.all(np.diff(pi) > 0)  # stored order
    for key in ("coord", "energy", "segment"):
        assert np.array_equal(out[key], ev[key][pi])
    summed = run([dict(type="GridSample", grid_size=20.0, mode="sum")], ev)
    assert np.isclose(summed["energy"].sum(), ev["energy"].sum(), rtol=1e-4)


def test_crop_keeps_max_points_nearest_a_point_and_features_follow_the_kept_points():
    ev = event(500)
    out = run([dict(type="NormalizeCoord"), dict(type="LogEnergy", scale=2.0), dict(type="RandomCrop", max_points=50)],
              ev)
    assert len(out["coord"]) == len(out["feat_coord"]) == 50
    assert np.array_equal(out["coord"], ev["coord"][out["point_index"]])
    feat = feature_columns(out, VOLUME, 1.0)
    assert feat.shape == (50, len(names.FEATURE_COLUMNS))
    np.testing.assert_allclose(feat[:, 3], np.log1p(out["energy"] / 2.0), rtol=1e-6)
    full = run([dict(type="NormalizeCoord")], ev)["feat_coord"]
    assert np.isclose(np.linalg.norm(full, axis=1).max(), 1.0) and np.allclose(full.mean(axis=0), 0, atol=1e-5)
    assert len(run([dict(type="RandomCrop", max_points=1000)], ev)["coord"]) == 500


def test_same_seed_epoch_and_index_give_the_same_event_another_epoch_does_not():
    specs = [dict(type="RandomRotate"), dict(type="RandomFlip"), dict(type="Jitter", sigma=0.1),
             dict(type="RandomScale"), dict(type="GridSample", grid_size=5.0), dict(type="RandomCrop", max_points=80)]
    a, b, c = run(specs, epoch=1), run(specs, epoch=1), run(specs, epoch=2)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    assert not np.array_equal(a["point_index"], c["point_index"])


def test_dataset_applies_transforms_and_reports_kept_point_indices(tiny_data):
    specs = [dict(type="RandomRotate", axis="x"), dict(type="GridSample", grid_size=4.0),
             dict(type="RandomCrop", max_points=40)]
    ds = LArTPCDataset(tiny_data["val"], seed=3, transforms=specs)
    item, again = ds[(2, 1)], ds[(2, 1)]
    assert item["feat"].shape[1] == 4 and len(item["coord"]) <= 40
    assert all((item[k] == again[k]).all() for k in ("coord", "feat", "segment"))
    stored = ds.read_raw(1)
    pi = ds.point_index((2, 1))
    assert len(pi) == len(item["coord"]) and np.array_equal(stored["segment"][pi], item["segment"].numpy())
    # transforms=None: exactly the built-in path
    plain, aug = LArTPCDataset(tiny_data["val"], seed=3), LArTPCDataset(tiny_data["val"], seed=3, augment=True)
    assert np.array_equal(plain.point_index(1), np.arange(len(stored["coord"])))
    assert len(aug.point_index((1, 1))) == len(aug[(1, 1)]["coord"])
    with pytest.raises(ConfigError, match="augment=False"):
        LArTPCDataset(tiny_data["val"], augment=True, transforms=specs)


def test_pilarnet_point_indices_are_rows_of_the_stored_event_through_the_energy_cut(tmp_path):
    (path,) = write_pilarnet(tmp_path / "p.h5", 3, seed=6)
    specs = [dict(type="GridSample", grid_size=8.0), dict(type="RandomCrop", max_points=30)]
    for transforms in (None, specs):
        ds = PILArNetDataset(path, energy_threshold=0.5, transforms=transforms)
        item, raw, pi = ds[0], ds.read_raw(0), ds.point_index(0)
        assert len(pi) == len(item["coord"]) < len(raw["point"])
        np.testing.assert_array_equal(raw["point"][pi, :3].astype(np.float32), item["coord"].numpy())


@pytest.mark.parametrize(("specs", "message"), [
    ([dict(type="RandomRotat")], "did you mean 'RandomRotate'"),
    ([dict(type="Jitter", sigmaa=1)], "Did you mean 'sigma'"),
    ([dict(type="Jitter", sigma=-0.1)], "sigma must be a finite number >= 0"),
    ([dict(type="RandomScale", scale=[0, 1])], "0 < lo <= hi"),
    ([dict(type="RandomScale", scale=[1.2, 1.1])], "0 < lo <= hi"),
    ([dict(type="GridSample", grid_size=0)], "grid_size must be a finite number > 0"),
    ([dict(type="RandomCrop", max_points=0)], "max_points must be an integer >= 1"),
    ([dict(type="RandomRotate", axis="w")], "axis must be one of x, y, z"),
    ([dict(type="NormalizeCoord"), dict(type="Jitter")], "put NormalizeCoord after it"),
])
def test_bad_transforms_are_config_errors(specs, message):
    with pytest.raises(ConfigError, match=message):
        check_transforms({"transforms": specs}, "data.train")


def test_launch_refuses_bad_transforms_before_any_process_starts(tmp_path, tiny_data):
    config = tmp_path / "bad.py"
    config.write_text(f"_base_ = ['{REPO / 'configs' / TINY}.py']\n"
                      "data = dict(train=dict(augment=False, transforms=[dict(type='Jiter', sigma=0.1)]))\n")
    for args in (["--train.config", str(config), "--"],
                 ["--train.config", TINY, "--", "data.train.augment=false",
                  "data.train.transforms=[{type: GridSample, grid_size: -1}]"]):
        res = pimm_in_process(["launch", *args[:2], "--dry-run", "--paths.exp-root", str(tmp_path / "exp"), *args[2:],
                               f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"])
        assert res.returncode == 2, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "Jitter" in lines[0] or "grid_size" in lines[0], lines[0]
    res = pimm_in_process(["launch", "--train.config", TINY, "--dry-run", "--paths.exp-root", str(tmp_path / "exp"),
                           "--", "data.train.transforms=[{type: RandomFlip}]"])
    assert res.returncode == 2 and "set data.train.augment=False" in res.stderr, res.stderr


def test_one_and_two_ranks_train_on_the_same_transformed_events(lr0_runs, tiny_data):
    """conftest's shared pair of lr=0 runs at 1 and 2 ranks, with every transform on the training set
    (and a CrossEntropy + Lovasz loss, which tests/test_losses.py checks on the same runs)."""
    assert LR0_TRANSFORMS in LR0_OVERRIDES and "data.train.augment=false" in LR0_OVERRIDES
    l1, l2 = losses(lr0_runs[1]), losses(lr0_runs[2])
    assert len(l1) == len(l2) == 3
    for step in l1:
        assert abs(l1[step] - l2[step]) <= 1e-5 * abs(l1[step]), (step, l1[step], l2[step])
    # the override reaches the training set: at most 300 points an event, as RandomCrop says
    cfg = apply_overrides(load_config(REPO / "configs" / f"{TINY}.py"), parse_overrides(
        [f"data.train.path={tiny_data['train']}", *LR0_OVERRIDES]))
    train = build_dataset(cfg["data"]["train"], seed=cfg["seed"])
    assert len(train.read_raw(0)["coord"]) > 300 >= len(train[(0, 0)]["coord"])
