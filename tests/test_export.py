"""`pimm export`: a run's checkpoint -> model.safetensors + config.json, reloaded without the trainer to
identical logits, no local paths in config.json, warm starts from the export, and its errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import launch, launch_args, pimm_in_process
from safetensors.torch import load_file

from pimm.checkpoint.layout import CheckpointError
from pimm.checkpoint.weights import check_weights_fit
from pimm.cli import main
from pimm.data.collate import collate_events
from pimm.data.dataset import LArTPCDataset
from pimm.models import build_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_data) -> Path:
    """One epoch of the tiny config at 1 process: model/last (step 12), model/step_00000006, model_best.pth."""
    res, run_dir = launch(tmp_path_factory.mktemp("exp"), tiny_data, 1, "epochs=1", "checkpoint_every_n_steps=6",
                          name="src")
    assert res.returncode == 0, res.stderr
    return run_dir


def export(capsys, *args) -> tuple[int, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def logits(model: torch.nn.Module, events: list[dict]) -> torch.Tensor:
    batch = collate_events(events)
    with torch.no_grad():
        return model.eval()(batch["coord"], batch["feat"], batch["offset"])


@pytest.mark.parametrize(("checkpoint", "source", "step"), [
    ("last", "model/last/weights.pth", 12),
    ("best", "model/model_best.pth", 12),
    ("step_6", "model/step_00000006/weights.pth", 6),
])
def test_export_reloads_to_identical_logits(capsys, tmp_path, run_dir, tiny_data, checkpoint, source, step):
    out = tmp_path / "export"
    code, text = export(capsys, "--run-dir", run_dir, "--checkpoint", checkpoint, out)
    assert code == 0, text
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["type"] == "PointSegNet" and config["num_classes"] == 5
    assert config["class_names"] == ["shower", "track", "michel", "delta", "low_energy"]
    assert (config["checkpoint"], config["step"]) == (checkpoint, step)
    assert len(config["config_hash"]) == 64 and config["pimm_version"]

    # the documented way, no trainer: safetensors + build_model(config["model"])
    exported = build_model(config["model"])
    exported.load_state_dict(load_file(out / "model.safetensors"))
    bare = build_model(config["model"])
    bare.load_state_dict(torch.load(run_dir / source, weights_only=True))
    events = [LArTPCDataset(tiny_data["val"])[i] for i in range(3)]
    assert torch.equal(logits(exported, events), logits(bare, events))


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_config_json_has_no_local_paths(capsys, tmp_path, run_dir, tiny_data):
    out = tmp_path / "export"
    assert export(capsys, "--run-dir", run_dir, out)[0] == 0
    text = (out / "config.json").read_text()
    assert not [s for s in _strings(json.loads(text)) if os.path.isabs(s) or s.startswith("~")]
    for local in (str(tmp_path.parent), str(run_dir), tiny_data["train"].name, tiny_data["val"].name, ".h5"):
        assert local not in text


def test_train_weight_accepts_an_export(capsys, tmp_path, run_dir, tiny_data):
    out = tmp_path / "export"
    assert export(capsys, "--run-dir", run_dir, out)[0] == 0
    # evaluating the exported weights reproduces the source run's last validation exactly
    res, warm = launch(tmp_path, tiny_data, 1, "validate_only=true", name="warm", extra=["--train.weight", str(out)])
    assert res.returncode == 0, res.stderr
    val = [json.loads(line) for line in (warm / "metrics.jsonl").read_text().splitlines()]
    source = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pick = lambda recs: [(r["loss"], r["miou"]) for r in recs if r["kind"] == "val"][-1]  # noqa: E731
    assert pick(val) == pick(source)
    # other-model weights are refused before anything starts
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 1, "model.channels=8", name="other",
                                      extra=["--train.weight", str(out)]))
    assert res.returncode == 2 and "do not fit model" in res.stderr and "config.json" in res.stderr


def test_export_directory_errors_at_warm_start(tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        check_weights_fit(half, {"type": "PointSegNet"})
    (half / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        check_weights_fit(half, {"type": "PointSegNet"})


def test_export_errors(capsys, tmp_path, run_dir):
    code, text = export(capsys, "--run-dir", tmp_path / "nope", tmp_path / "a")
    assert code == 2 and "pimm: error: --run-dir" in text and "does not exist" in text and "nope" in text

    code, text = export(capsys, "--run-dir", run_dir, "--checkpoint", "step_3", tmp_path / "b")
    assert code == 2 and "no checkpoint 'step_3'" in text
    assert "available: last (step 12), step_6, best (model_best.pth)" in text
    code, text = export(capsys, "--run-dir", run_dir, "--checkpoint", "newest", tmp_path / "b")
    assert code == 2 and "'newest' is not last, best or step_N" in text
    assert not (tmp_path / "b").exists()

    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    code, text = export(capsys, "--run-dir", run_dir, full)
    assert code == 2 and f"{full} exists and is not empty; refusing" in text
    assert [p.name for p in full.iterdir()] == ["notes.txt"]

    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "model/last/.complete").unlink()
    code, text = export(capsys, "--run-dir", broken, tmp_path / "c")
    assert code == 2 and "model/last is incomplete" in text and "available: step_6" in text
    weights = broken / "model/step_00000006/weights.pth"
    weights.write_bytes(weights.read_bytes()[:100])
    code, text = export(capsys, "--run-dir", broken, "--checkpoint", "step_6", tmp_path / "c")
    assert code == 2 and "corrupt checkpoint file" in text and "choose another checkpoint" in text
    assert not (tmp_path / "c").exists()
