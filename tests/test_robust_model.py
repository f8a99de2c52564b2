"""Model options and run names are checked before any process starts: through `pimm launch` (real
launch and --dry-run) every refusal is one line, exit 2, and nothing is written anywhere. The launches
run pimm's CLI in the test process (pimm_in_process): what is tested happens before any process starts."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import REPO, TINY, pimm_in_process

from pimm import names
from pimm.config.validate import MODEL_OPTIONS, check_config
from pimm.errors import ConfigError


def data_args(tiny_data) -> list[str]:
    return [f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"]


def assert_refused(res, message: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pimm: error: "), res.stderr
    assert message in lines[0], res.stderr


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "launch"])
@pytest.mark.parametrize(("override", "message"), [
    ("model.in_channels=3", "model.in_channels=3 but every data set gives 4 feature columns per point"),
    ("model.grid_sizes=abc", "model.grid_sizes='abc' is not allowed: model.grid_sizes must be a non-empty list"),
    ("model.channels=-4", "model.channels=-4 is not allowed: model.channels must be an integer >= 1"),
    ("model.channels=0", "model.channels=0 is not allowed"),
    ("model.grid_sizes=[0]", "model.grid_sizes=[0] is not allowed: model.grid_sizes must be a non-empty list of "
                             "finite numbers > 0"),
    ("model.grid_sizes=[]", "model.grid_sizes=[] is not allowed"),
    ("model.grid_sizes=[4, .nan]", "model.grid_sizes=[4, nan] is not allowed"),
])
def test_bad_point_seg_net_options_exit_2_and_write_nothing(tmp_path, tiny_data, override, message, dry_run):
    exp = tmp_path / "exp"
    res = pimm_in_process(["launch", "--train.config", TINY, "--paths.exp-root", str(exp),
                           *(["--dry-run"] if dry_run else []), "--", *data_args(tiny_data), override], cwd=tmp_path)
    assert_refused(res, message)
    assert not exp.exists()


def test_an_unknown_model_option_in_a_config_file_is_named_with_the_closest_one(tmp_path, tiny_data):
    config = tmp_path / "typo.py"
    config.write_text((REPO / "configs/tests/tiny_semseg.py").read_text()
                      .replace('_base_ = ["../_base_/', f'_base_ = ["{REPO}/configs/_base_/')
                      .replace("channels=16", "chanels=16"))
    res = pimm_in_process(["launch", "--train.config", str(config), "--paths.exp-root", str(tmp_path / "exp"), "--",
                           *data_args(tiny_data)], cwd=tmp_path)
    assert_refused(res, "model.chanels is not an option of PointSegNet: did you mean 'model.channels'?")
    assert not (tmp_path / "exp").exists()


# the published models with a backbone dict have their own tests (below, test_published_detector, test_pretraining)
@pytest.mark.parametrize("model_type", [m for m in names.MODELS
                                        if m not in ("DefaultSegmentorV2", *names.DETECTORS, "Sonata-v1m1")])
def test_every_registered_model_checks_every_argument(model_type):
    """The option table is the constructor's signature; the defaults pass it and read the data's
    features; a value of the wrong type or range for any option is refused naming it."""
    from pimm.models import MODELS

    signature = inspect.signature(MODELS.get(model_type)).parameters
    assert set(MODEL_OPTIONS[model_type]) == set(signature)
    assert signature["in_channels"].default == len(names.FEATURE_COLUMNS)
    MODELS.build({"type": model_type})  # the defaults pass the model's own check
    base = {"seed": 0, "epochs": 1, "batch_size": 1, "log_every": 1, "eval_every_epochs": 1,
            "optimizer": {"type": "SGD"}, "checkpoint_async": False, "checkpoint_keep_last": 2,
            "data": {"num_classes": 5, "train": {"type": "LArTPCDataset", "path": "x.h5"}}}
    for key in MODEL_OPTIONS[model_type]:
        for bad in ("abc", -4, None):
            with pytest.raises(ConfigError, match=rf"model\.{key}="):
                check_config({**base, "model": {"type": model_type, key: bad}})
        with pytest.raises(ConfigError, match=rf"model\.{key}="):
            MODELS.build({"type": model_type, key: -4})  # the rank's own build refuses it as a config error


def test_the_published_segmentor_and_its_backbone_check_every_argument():
    """DefaultSegmentorV2 and PT-v3m2 (a backbone): the option tables are the constructors' signatures,
    the published defaults pass (in_channels 6 is the published default; the config check asks for 4),
    a bad value of any option is refused naming model.<key> or model.backbone.<key>."""
    from pimm.config.validate import BACKBONE_OPTIONS
    from pimm.models import MODELS, PointTransformerV3

    segmentor = inspect.signature(MODELS.get("DefaultSegmentorV2")).parameters
    assert set(MODEL_OPTIONS["DefaultSegmentorV2"]) == set(segmentor)
    assert set(BACKBONE_OPTIONS["PT-v3m2"]) == set(inspect.signature(PointTransformerV3).parameters)
    required = {"num_classes": 5, "backbone_out_channels": 64, "backbone": {"type": "PT-v3m2", "in_channels": 4}}
    with torch.device("meta"):
        MODELS.build({"type": "DefaultSegmentorV2", **required})
    base = {"seed": 0, "epochs": 1, "batch_size": 1, "log_every": 1, "eval_every_epochs": 1,
            "optimizer": {"type": "SGD"}, "checkpoint_async": False, "checkpoint_keep_last": 2,
            "data": {"num_classes": 5, "train": {"type": "LArTPCDataset", "path": "x.h5"}}}
    for key in MODEL_OPTIONS["DefaultSegmentorV2"]:
        for bad in ("abc",) if key == "grid_origin" else ("abc", -4):  # any finite origin is one
            with pytest.raises(ConfigError, match=rf"model\.{key}"):
                check_config({**base, "model": {"type": "DefaultSegmentorV2", **required, key: bad}})
    for key in BACKBONE_OPTIONS["PT-v3m2"]:
        for bad in ("abc", -4):
            backbone = {**required["backbone"], key: bad}
            with pytest.raises(ConfigError, match=rf"model\.backbone\.{key}"):
                check_config({**base, "model": {"type": "DefaultSegmentorV2", **required, "backbone": backbone}})
            with pytest.raises(ConfigError, match=rf"model\.backbone\.{key}"):
                MODELS.build({"type": "DefaultSegmentorV2", **required, "backbone": backbone})


def test_datasets_give_the_feature_columns_models_are_checked_against(tiny_data):
    from pimm.data.dataset import LArTPCDataset

    item = LArTPCDataset(str(tiny_data["val"]))[0]
    assert item["feat"].shape[1] == len(names.FEATURE_COLUMNS)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "launch"])
@pytest.mark.parametrize("name", ["../../escape", "/abs/path", ".", "..", "a/b", "", ".hidden", "sp ace", "x" * 201])
def test_a_run_name_that_is_not_one_safe_folder_name_is_refused(tmp_path, tiny_data, name, dry_run):
    exp = tmp_path / "root" / "exp"
    res = pimm_in_process(["launch", "--train.config", TINY, "--paths.exp-root", str(exp), "--run.name", name,
                           "--run.no-timestamp", *(["--dry-run"] if dry_run else []), "--", *data_args(tiny_data)],
                          cwd=tmp_path)
    # a name that is too long is refused for its length (the length seen and the limit), not its characters
    expected = "a run name has at most 200" if len(name) > 200 else "is not allowed: a run name is one folder name"
    assert_refused(res, expected)
    assert not (tmp_path / "root").exists() and not (tmp_path / "escape").exists()
    assert not (tmp_path / "abs").exists()


def test_a_config_outside_a_folder_named_like_a_path_stays_inside_the_root(tmp_path, tiny_data):
    """`--train.config ../x.py`: the group is never '..' (the config's folder name is used only when
    it is a safe name), so the run directory is under the root."""
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "cfg.py").write_text((REPO / "configs/tests/tiny_semseg.py").read_text()
                                     .replace('_base_ = ["../_base_/', f'_base_ = ["{REPO}/configs/_base_/'))
    res = pimm_in_process(["launch", "--train.config", "../cfg.py", "--paths.exp-root", "exp", "--run.no-timestamp",
                           "--dry-run", "--", *data_args(tiny_data)], cwd=work)
    assert res.returncode == 0, res.stderr
    assert "run directory: exp/default/cfg" in res.stdout


@pytest.mark.parametrize(("line", "message"), [
    ("lr = 0.1", "config key 'lr' is not used by pimm, so its value would be ignored. Did you mean 'optimizer.lr'?"),
    ("data['train']['pth'] = 'x.h5'", "config key 'data.train.pth' is not used by pimm"),
    ("epoch = 3", "Did you mean 'epochs'?"),
])
def test_an_unknown_key_in_a_config_file_is_refused_with_the_keys_it_likely_means(tmp_path, tiny_data, line, message):
    config = tmp_path / "typo.py"
    text = (REPO / "configs/tests/tiny_semseg.py").read_text()
    text = text.replace('_base_ = ["../_base_/', f'_base_ = ["{REPO}/configs/_base_/')
    config.write_text(f"{text}\n{line}\n_mine = 1\n")
    res = pimm_in_process(["launch", "--train.config", str(config), "--paths.exp-root", str(tmp_path / "exp"),
                           "--dry-run", "--", *data_args(tiny_data)], cwd=tmp_path)
    assert_refused(res, message)
