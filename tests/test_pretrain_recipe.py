"""The published PILArNet-M pretraining recipe (configs/panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask.py)
against the published file: every expected value is cited as `pt.py:<line>` of DeepLearnPhysics/pimm
configs/panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask.py, or names the published module it comes from.
Fast: configs are loaded and checked, models built on the meta device.
"""

import math

import published_groups
import pytest
import torch
from conftest import REPO

from pimm.config import load_config
from pimm.config.validate import check_config
from pimm.engine.optim import build_optimizer, build_scheduler, check_parameter_patterns
from pimm.models import build_model

SCALE = 768.0 * math.sqrt(3.0) / 2.0  # NormalizeCoord's scale, pt.py:125
BASE_LR, LR_DECAY, BASE_WD = 0.0026, 0.9, 0.04  # pt.py:95, 96, 98
ENC_DEPTHS = (3, 3, 3, 9, 3)  # pt.py:38


def recipe() -> dict:
    return load_config(REPO / "configs" / "panda" / "pretrain" / "pretrain-sonata-v1m1-pilarnet-smallmask.py")


def meta_model(model_cfg: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(model_cfg)


TABLE = [  # (config path, published value, where)
    (("seed",), 0, "pt.py:21"),
    (("epochs",), 100, "pt.py:94"),
    (("batch_size",), 48, "pt.py:8"),
    (("num_worker",), 24, "pt.py:9"),
    (("batch_size_val",), 32, "pt.py:10"),
    (("clip_grad",), 3.0, "pt.py:12"),
    (("amp", "dtype"), "bfloat16", "pt.py:15"),
    (("model", "backbone", "enc_channels"), (48, 96, 192, 384, 512), "pt.py:39"),
    (("model", "backbone", "drop_path"), 0.3, "pt.py:48"),
    (("model", "backbone", "layer_scale"), 1e-5, "pt.py:44"),
    (("model", "teacher_custom", "drop_path"), 0.0, "pt.py:64"),
    (("model", "head_in_channels"), 1088, "pt.py:66"),
    (("model", "head_hidden_channels"), 4096, "pt.py:67"),
    (("model", "head_embed_channels"), 256, "pt.py:68"),
    (("model", "head_num_prototypes"), 4096, "pt.py:69"),
    (("model", "num_local_view"), 6, "pt.py:71"),
    (("model", "mask_size_base"), 0.075, "pt.py:73"),
    (("model", "mask_ratio_base"), 0.9, "pt.py:76"),
    (("model", "mask_jitter"), 0.0005, "pt.py:78"),
    (("model", "teacher_temp_base"), 0.07, "pt.py:80"),
    (("model", "student_temp"), 0.1, "pt.py:82"),
    (("model", "unmask_loss_weight"), 0.5, "pt.py:85"),
    (("model", "momentum_base"), 0.994, "pt.py:86"),
    (("model", "match_max_r"), 0.002, "pt.py:88"),
    (("model", "up_cast_level"), 2, "pt.py:89"),
    (("model", "grid_size"), 0.001, "pt.py:26, handed to the model by Update, pt.py:180"),
    (("optimizer", "lr"), BASE_LR, "pt.py:112"),
    (("optimizer", "weight_decay"), BASE_WD, "pt.py:112"),
    (("scheduler", "pct_start"), 0.05, "pt.py:116"),
    (("scheduler", "div_factor"), 10.0, "pt.py:118"),
    (("scheduler", "final_div_factor"), 1000.0, "pt.py:119"),
    (("data", "train", "revision"), "v1", "pt.py:206"),
    (("data", "train", "energy_threshold"), 0.13, "pt.py:211"),
    (("data", "train", "min_points"), 1024, "pt.py:212"),
    (("data", "train", "max_len"), 1_000_000, "pt.py:213"),
    (("data", "train", "features"), "published", "NormalizeCoord and LogTransform, pt.py:125-132"),
    (("data", "val", "max_len"), 250, "PretrainEvaluator max_test_events, hooks/evaluator.py:407"),
    (("model", "probe_classes"), 5, "the PretrainEvaluator's probe of the 5 motif classes, pt.py:202, 299-305"),
    (("eval_every_n_steps",), 1000, "pt.py:303"),
    (("checkpoint_every_n_steps",), 1000, "pt.py:297"),
]


def test_the_recipe_loads_passes_check_config_and_has_the_published_values():
    cfg = recipe()
    check_config(cfg)
    check_parameter_patterns(cfg)
    for path, expected, where in TABLE:
        value = cfg
        for key in path:
            value = value[key]
        if isinstance(expected, float):
            assert value == pytest.approx(expected, rel=1e-12), (path, value, where)
        else:
            assert value == expected, (path, value, where)
    assert cfg["task"] == {"type": "SelfDistillation"}
    # GridSample at 0.001 normalised units (pt.py:133), in detector units: 0.665 voxel, every voxel kept
    (grid,) = cfg["data"]["train"]["transforms"]
    assert grid["type"] == "GridSample" and grid["grid_size"] == pytest.approx(0.001 * SCALE) and grid["grid_size"] < 1


def test_the_recipe_builds_student_and_teacher_whose_encoder_the_published_fine_tuning_recipes_load():
    """On the meta device: the student's and the teacher's PT-v3m2 encoders and their heads; every student.backbone.*
    tensor (what `pimm export --layout published` writes as module.student.backbone.*) has a tensor of the same name
    (after key_map="sonata") and shape in the published lin recipe's model, the mask token aside."""
    cfg = recipe()
    model = meta_model(cfg["model"])
    student = {n: p.shape for n, p in model.named_parameters() if n.startswith("student.")}
    teacher = {n: p.shape for n, p in model.named_parameters() if n.startswith("teacher.")}
    assert {n.replace("teacher.", "student.", 1): s for n, s in teacher.items()} == student
    assert {n.split(".")[1] for n in student} == {"backbone", "mask_head", "unmask_head"}
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("teacher."))
    assert student["student.mask_head.mlp.0.weight"] == (4096, 1088)  # hidden x head_in_channels, pt.py:66-67
    assert student["student.mask_head.prototype.parametrizations.weight.original1"] == (4096, 256)  # pt.py:68-69

    lin = load_config(REPO / "configs" / "panda" / "semseg" / "semseg-pt-v3m2-pilarnet-ft-5cls-lin.py")
    target = {n: p.shape for n, p in meta_model(lin["model"]).named_parameters()}
    encoder = {n.removeprefix("student."): s for n, s in student.items()
               if n.startswith("student.backbone.") and not n.endswith("mask_token")}
    assert encoder and all(target.get(n) == s for n, s in encoder.items())
    assert {n for n in target if n.startswith("backbone.")} == set(encoder)


def published_lr_and_decay(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """Name -> (lr, weight decay) of every trained parameter under the published recipe: build_optimizer of
    pimm/utils/optimizer.py (the first param_dicts keyword, pt.py:102-109, contained in the name, else the default
    group at base_lr), then the WeightDecayExclusion hook (pt.py:281-288, hooks/misc.py)."""
    keywords = [(f"enc{e}.block{b}.", BASE_LR * LR_DECAY ** (sum(ENC_DEPTHS) - sum(ENC_DEPTHS[:e]) - b - 1))
                for e in range(len(ENC_DEPTHS)) for b in range(ENC_DEPTHS[e])]
    # the teacher and the heads' fixed norms have no gradient: AdamW leaves them alone
    return published_groups.published_lr_and_decay(model, keywords, BASE_LR, BASE_WD)


def test_param_groups_give_every_parameter_the_published_lr_and_weight_decay():
    cfg = recipe()
    model = meta_model(cfg["model"])
    expected = published_lr_and_decay(model)
    seen, groups = published_groups.pimm_lr_and_decay(model, cfg)
    wrong = published_groups.mismatches(seen, expected)
    assert not wrong, wrong[:5]
    lrs = {lr for lr, _ in expected.values()}
    assert min(lrs) == pytest.approx(BASE_LR * LR_DECAY**20) and max(lrs) == BASE_LR  # enc0.block0 .. default
    # OneCycleLR's peak per group is the group's lr, as the published max_lr list (pt.py:115)
    optimizer = build_optimizer(cfg["optimizer"], groups)
    build_scheduler(cfg["scheduler"], optimizer, total_steps=100)
    for group in optimizer.param_groups:
        assert group["max_lr"] == pytest.approx(cfg["optimizer"]["lr"] * group["lr_scale"], rel=1e-12)
        assert group["initial_lr"] == pytest.approx(group["max_lr"] / 10.0)
