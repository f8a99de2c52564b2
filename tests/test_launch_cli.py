"""`pimm launch` before any process starts: dry-run output and every bad-input error."""

from pathlib import Path

import pytest
from conftest import REPO, run_pimm

TINY = "tests/tiny_semseg"


def data_args(tiny_data):
    return [f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"]


def test_dry_run_prints_torchrun_command_and_split(tmp_path, tiny_data):
    res = run_pimm(
        ["launch", "--train.config", TINY, "--resources.nproc-per-node", "2", "--dry-run",
         "--paths.exp-root", str(tmp_path / "exp"), "--", "batch_size=8", "num_worker=4", *data_args(tiny_data)],
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "-m pimm.launch.torchrun --standalone --nnodes 1 --nproc-per-node 2" in out
    assert "-m pimm.engine.worker --run-dir" in out
    assert "world size: 2" in out and "cpu/gloo" in out
    assert "batch_size 4 events (global 8)" in out
    assert "num_worker 2 (global 4)" in out
    assert not (tmp_path / "exp").exists()  # a dry run creates nothing


def test_dry_run_resolves_name_with_and_without_timestamp(tmp_path, tiny_data):
    exp = tmp_path / "exp"
    res = run_pimm(["launch", "--train.config", TINY, "--dry-run", "--run.name", "abc", "--run.no-timestamp",
                    "--paths.exp-root", str(exp), "--", *data_args(tiny_data)], cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert f"run directory: {exp}/tests/abc\n" in res.stdout


def test_config_given_as_file_path(tmp_path, tiny_data):
    res = run_pimm(["launch", "--train.config", str(REPO / "configs/tests/tiny_semseg.py"), "--dry-run",
                    "--", *data_args(tiny_data)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("nproc,batch", [("2", 5), ("3", 8)])
def test_non_divisible_batch_stops_before_start(tmp_path, nproc, batch):
    for extra in (["--dry-run"], []):
        res = run_pimm(["launch", "--train.config", TINY, "--resources.nproc-per-node", nproc, *extra,
                        "--paths.exp-root", str(tmp_path), "--", f"batch_size={batch}"], cwd=REPO)
        assert res.returncode != 0
        assert f"batch_size={batch} is not divisible by the world size {nproc}" in res.stderr
        assert "Traceback" not in res.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--train.config", "tests/tiny_semsge"], "did you mean 'tests/tiny_semseg'"),
        (["--train.config", TINY, "--", "data.train.max_lne=3"], "did you mean 'data.train.max_len'"),
        (["--train.config", TINY, "--", "epochs"], "not key=value"),
        (["--train.config", TINY, "--", "--epochs=3"], "flags go before the -- separator"),
        (["--train.config", TINY, "--resources.nproc-per-node", "zero"], "positive integer or 'auto'"),
        (["--train.config", TINY, "--resources.nnodes", "2"], "rdzv-endpoint"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, args, expected):
    res = run_pimm(["launch", "--dry-run", *args], cwd=REPO)
    assert res.returncode == 2
    assert expected in res.stderr
    assert "Traceback" not in res.stderr


def test_config_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("seed = 1\nepochs = (\n")
    res = run_pimm(["launch", "--train.config", str(bad), "--dry-run"], cwd=tmp_path)
    assert res.returncode == 2
    assert str(bad) in res.stderr and "line 2" in res.stderr
    assert "Traceback" not in res.stderr


def test_missing_and_corrupt_data_files(tmp_path, tiny_data):
    corrupt = tmp_path / "corrupt.h5"
    corrupt.write_bytes(Path(tiny_data["train"]).read_bytes()[:2000])
    for path in (tmp_path / "nope.h5", corrupt):
        res = run_pimm(["launch", "--train.config", TINY, "--paths.exp-root", str(tmp_path / "exp"),
                        "--", f"data.train.path={path}", f"data.val.path={tiny_data['val']}"], cwd=REPO)
        assert res.returncode == 2
        assert str(path) in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "exp").exists()


def test_ls_lists_configs():
    res = run_pimm(["ls"], cwd=REPO)
    assert res.returncode == 0
    assert "demo/semseg" in res.stdout and "tests/tiny_semseg" in res.stdout and "_base_" not in res.stdout


def test_help_describes_every_flag():
    res = run_pimm(["launch", "--help"], cwd=REPO)
    for flag in ("--train.config", "--resources.nproc-per-node", "--resources.nnodes", "--run.name",
                 "--run.no-timestamp", "--paths.exp-root", "--dry-run", "--resources.max-restarts"):
        assert flag in res.stdout
    assert run_pimm(["--help"], cwd=REPO).returncode == 0


def test_data_synth_and_describe(tmp_path):
    out = tmp_path / "ev.h5"
    res = run_pimm(["data", "synth", "--out", str(out), "--events", "5", "--seed", "3"], cwd=tmp_path)
    assert res.returncode == 0 and "wrote 5 events" in res.stdout
    res = run_pimm(["data", "describe", str(out)], cwd=tmp_path)
    assert res.returncode == 0 and '"num_events": 5' in res.stdout
    res = run_pimm(["data", "synth", "--out", str(out), "--events", "0"], cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    res = run_pimm(["data", "describe", str(tmp_path / "missing.h5")], cwd=tmp_path)
    assert res.returncode == 2 and "pimm data synth" in res.stderr
