"""Fine-tuning: weights from elsewhere (key_map, skip, strict), frozen parameters, parameter groups."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import attempts, launch, launch_args, losses, pimm_in_process, weights

TINY_MODEL = dict(type="PointSegNet", in_channels=4, num_classes=5, channels=16, grid_sizes=[4, 16])


def model_state(**changes) -> dict:
    from pimm.models import build_model

    torch.manual_seed(123)
    return build_model({**TINY_MODEL, **changes}).state_dict()


def refused(res, *texts) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for text in texts:
        assert text in lines[0], lines[0]


def test_a_pointcept_style_checkpoint_loads_strictly(tmp_path, tiny_data):
    source = model_state()
    path = tmp_path / "pointcept.pth"
    torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in source.items()}}, path)
    res, run_dir = launch(tmp_path, tiny_data, 1, "max_steps=1", "optimizer.lr=0", name="wrapped",
                          extra=["--train.weight", str(path)])
    assert res.returncode == 0, res.stderr
    assert "loaded 24 of 24, skipped 0, missing 0, unexpected 0, shape-mismatched 0" in res.stdout
    for key, value in weights(run_dir).items():
        assert torch.equal(value, source[key]), key  # lr=0: the step changed nothing
    assert attempts(run_dir)[-1]["pretrained"]["loaded"] == 24


def test_a_new_head_loads_partially_and_strict_refuses(tmp_path, tiny_data):
    source = model_state(num_classes=6)
    path = tmp_path / "six_classes.pth"
    torch.save(source, path)
    # the refusals come before any process starts: pimm's CLI in this process
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, "max_steps=1", name="strict",
                                      extra=["--train.weight", str(path)]))
    refused(res, "do not fit model", "2 shape mismatches (head.1.weight: [6, 16] in the file, [5, 16] in the model",
            "pretrained.strict=false")
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, "max_steps=1", "pretrained.strict=false",
                                      "pretrained.key_map=[['', 'backbone.']]", name="nothing",
                                      extra=["--train.weight", str(path)]))
    refused(res, "share no parameter", "pretrained.key_map")

    res, run_dir = launch(tmp_path, tiny_data, 1, "max_steps=1", "optimizer.lr=0", "pretrained.strict=false",
                          "pretrained.skip=['head.1.weight']", f"pretrained.path={path}", name="partial")
    assert res.returncode == 0, res.stderr
    line = ("loaded 22 of 24, skipped 1 (head.1.weight), missing 0, unexpected 0, "
            "shape-mismatched 1 (head.1.bias [6] in the file, [5] in the model)")
    assert line in res.stdout
    facts = attempts(run_dir)[-1]["pretrained"]
    assert (facts["loaded"], facts["skipped"], facts["shape_mismatched"]) == (22, 1, 1)
    assert facts["first"]["shape_mismatched"] == [["head.1.bias", [6], [5]]]
    trained = weights(run_dir)
    for key, value in trained.items():
        assert torch.equal(value, source[key]) == (not key.startswith("head.1.")), key


def test_the_optimizer_is_torchs_fused_one_unless_the_config_names_an_implementation():
    from pimm.engine.optim import build_optimizer, optimizer_implementation

    params = list(torch.nn.Linear(3, 2).parameters())
    for cfg, expected in ((dict(type="AdamW", lr=1e-3), (True, None)),
                          (dict(type="SGD", lr=0.1, momentum=0.9), (True, None)),
                          (dict(type="AdamW", lr=1e-3, foreach=True), (None, True)),
                          (dict(type="Adam", lr=1e-3, fused=False), (False, None))):
        optimizer = build_optimizer(cfg, params)
        assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == expected, cfg
    cfg = dict(type="AdamW", lr=1e-3)
    fused = build_optimizer(cfg, params)
    assert cfg == dict(type="AdamW", lr=1e-3)  # the config is left as the user wrote it
    assert optimizer_implementation(fused) == "fused"
    # a checkpoint written before pimm chose the fused implementation brings torch's default back with its groups
    fused.load_state_dict(torch.optim.AdamW(params, lr=1e-3).state_dict())
    assert optimizer_implementation(fused) == "torch default"
    assert optimizer_implementation(build_optimizer(dict(type="SGD", lr=0.1, foreach=True), params)) == "foreach"


@pytest.mark.parametrize("nproc,strategy", [(1, "ddp"), (2, "ddp"), (2, "fsdp2")])
def test_frozen_parameters_do_not_change(tmp_path, tiny_data, nproc, strategy):
    source = model_state()
    path = tmp_path / "source.pth"
    torch.save(source, path)
    res, run_dir = launch(tmp_path, tiny_data, nproc, "max_steps=2", "freeze=['stem.*', 'blocks.0.norm.*']",
                          f"parallel.strategy={strategy}", name=f"freeze{nproc}{strategy}",
                          extra=["--train.weight", str(path)])
    assert res.returncode == 0, res.stderr
    for key, value in weights(run_dir).items():
        frozen = key.startswith(("stem.", "blocks.0.norm."))
        assert torch.equal(value, source[key]) == frozen, key
    assert attempts(run_dir)[-1]["frozen"] == {"tensors": 6, "elements": 4 * 16 + 16 + 16 * 16 + 16 + 32}


@pytest.mark.parametrize("nproc,strategy", [(1, "ddp"), (2, "fsdp2")])
def test_parameter_groups_train_and_resume(tmp_path, tiny_data, nproc, strategy):
    source = model_state()
    path = tmp_path / "source.pth"
    torch.save(source, path)
    groups = "param_groups=[{params: 'stem.*', lr_scale: 0.0}, {params: '*norm*|*bias', weight_decay: 0.5}]"
    common = ("max_steps=2", "log_every=1", groups, "optimizer.weight_decay=0.01", f"parallel.strategy={strategy}")
    weight = ["--train.weight", str(path)]
    res, run_dir = launch(tmp_path, tiny_data, nproc, *common, "debug.interrupt_at_step=1", name="groups",
                          extra=weight)
    assert res.returncode == 75, res.stderr
    recorded = attempts(run_dir)[-1]["optimizer_groups"]
    assert [(g["params"], g["tensors"], g["lr"], g["weight_decay"]) for g in recorded] == [
        ("default", 8, 3e-3, 0.01), ("stem.*", 4, 0.0, 0.01), ("*norm*|*bias", 12, 3e-3, 0.5)]

    res = pimm_in_process(launch_args(tmp_path, tiny_data, nproc, "param_groups=[]", name="groups", resume=True))
    refused(res, "param_groups:", "parameter groups")
    res, _ = launch(tmp_path, tiny_data, nproc, name="groups", resume=True)
    assert res.returncode == 0, res.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    resumed = weights(run_dir)
    for key, value in resumed.items():
        assert torch.equal(value, source[key]) == key.startswith("stem."), key  # lr_scale 0: never moved
    if strategy == "fsdp2":  # the grouped optimizer state comes back exactly: an uninterrupted run is identical
        res, reference = launch(tmp_path, tiny_data, nproc, *common, name="reference", extra=weight)
        assert res.returncode == 0, res.stderr
        assert losses(run_dir) == losses(reference) and len(losses(reference)) == 2
        assert all(torch.equal(value, weights(reference)[key]) for key, value in resumed.items())


def test_validate_only_takes_its_weights_from_train_weight_or_pretrained_path(tmp_path, tiny_data):
    path = tmp_path / "source.pth"
    torch.save(model_state(), path)
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, "validate_only=true", extra=["--dry-run"]))
    refused(res, "validate_only=true evaluates given weights", "--train.weight PATH or set pretrained.path")
    for given in (["--dry-run", "--train.weight", str(path)], ["--dry-run"]):
        overrides = ["validate_only=true"] + ([] if "--train.weight" in given else [f"pretrained.path={path}"])
        res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, *overrides, extra=given))
        assert res.returncode == 0, res.stderr
        assert "warm start from" in res.stdout and "loaded 24 of 24" in res.stdout
    assert not (tmp_path / "tests").exists()  # dry runs write nothing


@pytest.mark.parametrize("override,texts", [
    ("param_groups=[{params: 'blocks.*', lr: 0.1}]", ["param_groups[0]=", "'lr' is not an option"]),
    ("param_groups=[{params: 'blocks.*', lr_scale: -1}]", ["param_groups[0]=", "lr_scale=-1 must be"]),
    ("param_groups=[{params: 'backbone.*'}]", ["param_groups[0] (params='backbone.*') matches no trainable"]),
    ("freeze=['backbone.*']", ["freeze entry 'backbone.*' matches no parameter"]),
    ("pretrained.strcit=false", ["unknown config key 'pretrained.strcit'; did you mean 'pretrained.strict'"]),
])
def test_bad_finetune_entries_exit_2(tmp_path, tiny_data, override, texts):
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, override, name="bad", extra=["--dry-run"]))
    refused(res, *texts)
