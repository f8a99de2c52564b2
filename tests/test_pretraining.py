"""Self-distillation (Sonata-v1m1 + SelfDistillation) whose results do not depend on how many processes ran it:
1 rank, 2 ranks with loader workers, 1 rank x 2 accumulation steps and FSDP2 train the same model; the teacher
and every schedule resume exactly, also at another world size; the export loads into a fine-tuning model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_bitwise_equal, copy_exp, losses, run_pimm, steps, weights

from pimm.config import load_config
from pimm.config.validate import check_config
from pimm.data.synth import write_pilarnet
from pimm.errors import ConfigError
from pimm.models.sonata import model_options
from pimm.tasks.self_distillation import cosine_schedule, step_values

CONFIG = "tests/tiny_pretrain"
STEPS = 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretrain") / "pilarnet"
    write_pilarnet(root, 16, seed=3, split="train")
    write_pilarnet(root, 4, seed=4, split="val")
    return root


def _launch(exp: Path, shards: Path, name: str, nproc: int, *overrides: str, resume: Path | None = None):
    if resume is not None:
        args = ["launch", "--train.resume", str(resume), "--resources.nproc-per-node", str(nproc)]
    else:
        args = ["launch", "--train.config", CONFIG, "--resources.nproc-per-node", str(nproc), "--run.name", name,
                "--run.no-timestamp", "--paths.exp-root", str(exp), "--", f"data.train.path={shards}",
                f"data.val.path={shards}", f"max_steps={STEPS}", "log_event_ids=true", *overrides]
    return run_pimm(args, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def pretrain_runs(shards, tmp_path_factory) -> dict[str, Path]:
    exp = tmp_path_factory.mktemp("pretrain_runs")
    runs = {}
    # the 1-rank reference accumulates 2 micro-batches: the strongest case, its Sinkhorn spans both
    for name, nproc, extra, status in (("two", 2, ["num_worker=2"], 0), ("one", 1, ["grad_accum_steps=2"], 0),
                                       ("fsdp", 2, ["parallel.strategy=fsdp2"], 0),
                                       ("cut", 2, ["num_worker=2", "debug.interrupt_at_step=2"], 75)):
        res = _launch(exp, shards, name, nproc, *extra)
        assert res.returncode == status, res.stdout + res.stderr
        runs[name] = exp / "tests" / name
    return runs


def test_one_rank_with_accumulation_two_ranks_and_fsdp2_train_the_same_model(pretrain_runs):
    """Same global batch: the same views, masks and Sinkhorn targets (normalised over the whole step, across
    ranks and micro-batches: 1 rank x 2 micro-batches against 2 ranks), so the same losses and weights within
    float rounding (Adam's normalised steps magnify rounding in near-zero gradients: 1e-4 after 4 steps at lr
    2e-3), teacher included."""
    one = weights(pretrain_runs["one"])
    assert any(k.startswith("teacher.") for k in one) and any(k.startswith("student.") for k in one)
    for name in ("two", "fsdp"):
        assert losses(pretrain_runs[name]) == pytest.approx(losses(pretrain_runs["one"]), rel=1e-5), name
        other = weights(pretrain_runs[name])
        assert one.keys() == other.keys()
        for key, value in one.items():
            torch.testing.assert_close(other[key], value, rtol=0, atol=1e-4, msg=f"{name}: {key}")


def test_the_online_probe_is_validated_and_logged(pretrain_runs):
    """pimm's linear probe on the teacher's detached features: its mIoU on the validation events is logged
    and the same at 1 and 2 ranks (its confusion is summed over ranks; the weights agree to rounding)."""
    def last_val(run: Path) -> dict:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if r["kind"] == "val"][-1]

    one, two = last_val(pretrain_runs["one"]), last_val(pretrain_runs["two"])
    assert 0.0 <= one["probe_miou"] <= 1.0 and len(one["probe_iou"]) == 5
    assert one["probe_miou"] == pytest.approx(two["probe_miou"], abs=1e-3) and one["events"] == two["events"] == 4
    assert "probe mIoU" in (pretrain_runs["one"] / "logs" / "rank0.log").read_text()


def test_the_teacher_moves_by_ema_and_never_by_gradient(pretrain_runs):
    """After training the teacher is neither the student nor its initial copy: it moved by EMA only."""
    final = weights(pretrain_runs["one"])
    moved = [k for k in final if k.startswith("student.") and not torch.equal(final[k], final["teacher." + k[8:]])]
    assert moved, "the teacher should differ from the student after training"


def test_a_resume_is_bitwise_at_the_same_world_size(pretrain_runs, tmp_path):
    exp = copy_exp(pretrain_runs["cut"], tmp_path)
    res = _launch(exp, Path(), "cut", 2, resume=exp / "tests" / "cut")
    assert res.returncode == 0, res.stdout + res.stderr
    resumed = exp / "tests" / "cut"
    assert losses(resumed) == losses(pretrain_runs["two"])
    assert_bitwise_equal(weights(resumed), weights(pretrain_runs["two"]))  # teacher and student


def test_a_resume_at_another_world_size_consumes_the_same_events_and_schedules(pretrain_runs, tmp_path):
    exp = copy_exp(pretrain_runs["cut"], tmp_path)
    res = _launch(exp, Path(), "cut", 1, resume=exp / "tests" / "cut")
    assert res.returncode == 0, res.stdout + res.stderr
    resumed = exp / "tests" / "cut"
    assert "world size 1" in (resumed / "logs" / "rank0.log").read_text()
    reference = pretrain_runs["two"]
    assert {s: sorted(ids) for s, ids in steps(resumed).items()} == \
        {s: sorted(ids) for s, ids in steps(reference).items()}
    assert losses(resumed) == pytest.approx(losses(reference), rel=1e-5)
    final, expected = weights(resumed), weights(reference)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-4, msg=key)


def test_the_export_loads_into_a_fine_tuning_model_with_the_sonata_key_map(pretrain_runs, tmp_path):
    from pimm.checkpoint.weights import check_pretrained_fits

    out = tmp_path / "export"
    res = run_pimm(["export", "--run-dir", str(pretrain_runs["one"]), "--layout", "published", str(out)], cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    payload = torch.load(out / "model.pth", weights_only=True)["state_dict"]
    encoder = [k for k in payload if k.startswith("module.student.backbone.")]
    assert encoder and any(k.startswith("module.teacher.") for k in payload)
    cfg = load_config(REPO / "configs" / f"{CONFIG}.py")
    backbone = {k: v for k, v in cfg["model"]["backbone"].items() if k != "drop_path"}
    finetune = {"type": "DefaultSegmentorV2", "num_classes": 5, "backbone_out_channels": 80, "backbone": backbone}
    match = check_pretrained_fits(out / "model.pth", finetune, {"key_map": "sonata", "strict": False})
    assert f"loaded {len(encoder)} of" in match.summary()


def test_every_schedule_is_a_function_of_the_global_step():
    options = model_options(load_config(REPO / "configs" / f"{CONFIG}.py")["model"])
    total = 100
    first, warm, last = (step_values(options, s, total) for s in (0, 5, 99))
    assert first["teacher_temp"] == options["teacher_temp_start"] and last["teacher_temp"] == pytest.approx(
        options["teacher_temp_base"])
    assert warm["mask_ratio"] == pytest.approx(options["mask_ratio_base"])  # warm-up: int(100 * 0.05) = 5 steps
    assert first["momentum"] == options["momentum_base"]
    assert last["momentum"] == cosine_schedule(99, total, options["momentum_base"], options["momentum_final"])
    assert step_values(options, 42, total) == step_values(options, 42, total)


@pytest.mark.parametrize("change, message", [
    ({"head_in_channels": 48}, "model.head_in_channels=48 but the up-cast features are 64 wide"),
    ({"up_cast_level": 3}, "model.up_cast_level=3 is not allowed"),
    ({"num_global_view": 1}, "model.roll_mask_loss_weight > 0 needs two global views"),
    ({"backbone": {"mask_token": False}}, "enc_mode=True and model.backbone.mask_token=True"),
])
def test_a_pretraining_config_the_run_cannot_train_is_refused(change, message):
    cfg = load_config(REPO / "configs" / f"{CONFIG}.py")
    for key, value in change.items():
        cfg["model"][key] = {**cfg["model"][key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_config(cfg)
    cfg = load_config(REPO / "configs" / f"{CONFIG}.py")
    cfg["task"] = {"type": "SemanticSegmentation"}
    with pytest.raises(ConfigError, match="trained by self-distillation"):
        check_config(cfg)
    assert json.dumps(cfg["model"]["type"]) == '"Sonata-v1m1"'


def test_pimm_test_of_a_pretraining_run_gives_its_validation_again(pretrain_runs, tmp_path):
    """Evaluation cuts views with step 0's draws and every schedule at its end, each event on its own: the
    validation loss is comparable across steps, and `pimm test` (here at 2 ranks) repeats it; predicting
    classes with a self-distillation run is refused in one line."""
    run = pretrain_runs["one"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "val"][-1]
    res = run_pimm(["test", "--run-dir", str(run), "--split", "val", "--checkpoint", "last", "--out",
                    str(tmp_path / "t"), "--resources.nproc-per-node", "2"], cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pimm test: self-distillation loss" in res.stdout
    tested = json.loads((tmp_path / "t" / "test_metrics.json").read_text())
    assert tested["loss"] == pytest.approx(last["loss"], rel=1e-6) and tested["probe_miou"] == last["probe_miou"]
    assert (tmp_path / "t" / "confusion.png").exists()
    res = run_pimm(["predict", "--weights", str(run), "--data", str(tmp_path), "--out", str(tmp_path / "p.h5")],
                   cwd=REPO)
    assert res.returncode == 2 and "self-distillation run" in res.stderr, res.stderr


def test_the_weight_decay_schedule_is_the_published_one_of_the_global_step():
    from pimm.engine.optim import WeightDecaySchedule

    decayed, plain = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [decayed], "weight_decay": 0.04},
                                   {"params": [plain], "weight_decay": 0.0}])
    schedule = WeightDecaySchedule({"final": 0.2, "ratio": 1.0}, optimizer, 100)
    seen = []
    for step in (1, 51, 100, 101):
        schedule.apply(optimizer, step)
        seen.append(optimizer.param_groups[0]["weight_decay"])
        assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert seen[0] == pytest.approx(0.04) and seen[1] == pytest.approx(0.12, abs=1e-3)
    assert seen[2] == pytest.approx(0.2, abs=1e-4) and seen[3] == 0.2
    optimizer.param_groups[0]["weight_decay"] = 7.0  # a checkpoint's value: the schedule starts from the config's
    schedule.apply(optimizer, 1)
    assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.04)
