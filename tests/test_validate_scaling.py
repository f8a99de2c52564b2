"""`pimm validate-scaling`: the checklist passes on the tiny config at 1 and 2 ranks, a broken
setup fails the right check with a clear reason, and bad input is refused before any process."""

import json

import pytest
from conftest import REPO, TINY, run_pimm

from pimm.cli import main
from pimm.validate.scaling import CHECKS, fsdp2_shard_sizes


def _validate(tmp_path, tiny_data, *overrides, flags=()):
    out = tmp_path / "report"
    res = run_pimm(["validate-scaling", "--train.config", TINY, "--ranks", "1,2", "--out", str(out), *flags, "--",
                    f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", *overrides],
                   cwd=REPO, timeout=400)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return res, out, report


def _status(report: dict) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["checks"]}


def test_the_checklist_passes_at_1_and_2_ranks_directly_or_as_a_slurm_job(passing_checklist):
    """conftest's passing_checklist: run directly, or as the Slurm job that tests/test_slurm.py checks."""
    assert passing_checklist.exit_status == 0, passing_checklist.log
    out = passing_checklist.out
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "PASS"
    assert _status(report) == dict.fromkeys(CHECKS, "PASS")
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["1.5"]["numbers"]["max_relative_difference"]["2"] <= 1e-4
    assert checks["2.1"]["numbers"]["expected_total"] > 0
    assert checks["4.1"]["numbers"]["exit"] == 75 and checks["4.1"]["numbers"]["workers_per_rank"] > 0
    assert checks["4.2"]["numbers"]["max_weight_difference"] == 0  # bit-identical at 2 ranks
    assert checks["5.1"]["numbers"]["cursor"] in ("remapped", "epoch_restarted")
    assert [row["world_size"] for row in report["throughput"]] == [1, 2]
    assert report["throughput"][0]["efficiency"] == pytest.approx(1.0)
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "# pimm validate-scaling: PASS" in md and "| 5.1 | PASS |" in md and "scaling efficiency" in md
    assert {"train-r1.json", "train-r2.json", "interrupt-r2.json"} <= {p.name for p in (out / "provenance").iterdir()}
    cursors = [(p["run"], p["cursor"]) for p in report["provenance"]]
    assert ("interrupt-r2", "restored") in cursors
    hashes = {p["config_hash"] for p in report["provenance"] if not p["validate_only"]}
    assert len(hashes) == 1  # one config at every rank count


def test_a_nonfinite_loss_fails_the_finite_loss_check_naming_the_step(tmp_path, tiny_data):
    res, out, report = _validate(tmp_path, tiny_data, "debug.nonfinite_loss_at_step=2")
    assert res.returncode == 1, res.stdout + res.stderr
    status = _status(report)
    assert status["1.2"] == "FAIL" and status["1.1"] == "FAIL"
    reason = next(c["reason"] for c in report["checks"] if c["id"] == "1.2")
    assert "non-finite loss at step 2" in reason
    assert "check 1.2 failed" in res.stderr and "non-finite loss at step 2" in res.stderr
    assert {status[i] for i in ("3.1", "4.1", "4.2", "5.1")} == {"SKIP"}  # nothing more was launched
    assert not (out / "runs" / "tests" / "eval-r1").exists()


def test_replicas_that_differ_fail_the_parameters_identical_check(tmp_path, tiny_data):
    res, out, report = _validate(tmp_path, tiny_data, "debug.desync_rank_params=true")
    assert res.returncode == 1, res.stdout + res.stderr
    status = _status(report)
    assert status["2.2"] == "FAIL" and status["2.1"] == "PASS" and status["1.1"] == "PASS"
    reason = next(c["reason"] for c in report["checks"] if c["id"] == "2.2")
    assert "rank 1's parameters differ from rank 0's" in reason
    assert "check 2.2 failed" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--ranks", "0,2"], "--ranks must be comma-separated positive integers"),
    (["--ranks", "1,two"], "--ranks must be comma-separated positive integers"),
    (["--ranks", "2"], "--ranks needs at least two rank counts"),
    (["--ranks", "1,3"], "batch_size=4 is not divisible by the world size 3"),
    (["--steps", "2"], "--steps must be >= 4"),
    (["--train.config", "tests/no_such_config"], "config 'tests/no_such_config' not found"),
    (["--", "optimizer.lr=fast"], "optimizer.lr='fast' is not allowed"),
    (["--", "max_steps=3"], "override max_steps=... is not accepted by validate-scaling: use --steps"),
    (["--", "num_worker=1"], "leaves ranks without loader workers"),
    (["--", "debug.desync_rank_params=3"], "debug.desync_rank_params=3 is not allowed"),
    (["--strategy", "fsdp2", "--", "parallel.wrap_classes=[Blok]"], "parallel.wrap_classes names ['Blok']"),
    (["--", "data.train.path=/nonexistent.h5"], "/nonexistent.h5"),
])
def test_bad_input_is_refused_before_any_process(tmp_path, tiny_data, capsys, args, message):
    out = tmp_path / "report"
    cut = args.index("--") if "--" in args else len(args)
    flags, overrides = args[:cut], args[cut + 1:]
    config = [] if "--train.config" in flags else ["--train.config", TINY]
    data = [f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"]
    code = main(["validate-scaling", *config, "--out", str(out), *flags, "--", *data, *overrides])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("pimm: error: ") and message in err, err
    assert not out.exists()  # nothing started, nothing written


def test_an_out_folder_with_a_report_is_refused(tmp_path, tiny_data, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text("{}")
    code = main(["validate-scaling", "--train.config", TINY, "--out", str(out), "--",
                 f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "already holds a validation report" in err and "pick another --out" in err


def test_validate_only_needs_weights(tmp_path, tiny_data, capsys):
    code = main(["launch", "--train.config", TINY, "--paths.exp-root", str(tmp_path), "--",
                 f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", "validate_only=true"])
    assert code == 2
    assert "validate_only=true evaluates given weights" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_fsdp2_shard_sizes_split_dim_0_as_torch_chunk_does():
    # rows 5 over 2 ranks: 3 + 2; rows 1 over 2 ranks: 1 + 0 (the second rank's shard is empty)
    assert fsdp2_shard_sizes([(5, 3), (1,), ()], 2) == [3 * 3 + 1 + 1, 2 * 3]
    assert fsdp2_shard_sizes([(4, 2)], 3) == [4, 4, 0]
