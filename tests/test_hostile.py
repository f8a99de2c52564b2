"""Faults and bad input through the public CLI, as a hostile user would try them: a run directory
whose config.py holds code, weights that do not fit the run's model, control characters that would
reach a batch script, unwritable outputs, damaged run directories, and the permissions of what pimm
writes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY, copy_exp, launch, pimm_in_process

from pimm.config import config_hash, dump_config, load_config, read_run_config
from pimm.errors import ConfigError
from pimm.models import build_model

CODE_MARKER = "pimm reads a run's config.py as data; it holds code"


def data_args(tiny_data) -> list[str]:
    return [f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"]


def one_line_error(res, *expected: str) -> str:
    """The single `pimm: error: ...` line of a refusal with exit status 2 that contains `expected`."""
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pimm: error: "), res.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def run_copy(tmp_path, interrupted) -> Path:
    """A copy of conftest's interrupted run (model/last at step 2), for one test to damage."""
    return copy_exp(interrupted, tmp_path) / "tests" / interrupted.name


# -- a run's config.py is data ------------------------------------------------------------------


def test_read_run_config_round_trips_what_dump_config_writes(tmp_path, interrupted):
    cfg = {"a": {"nan": math.nan, "inf": [math.inf, -math.inf, -3, 1e-5, (1, 2)], "keys": {1: "x", 2.5: None}},
           "text": "two\nlines 'quoted' \\", "flag": True}
    dump_config(cfg, tmp_path / "config.py")
    back = read_run_config(tmp_path / "config.py")
    assert config_hash(back) == config_hash(cfg)  # NaN != NaN: compare the canonical form
    assert math.isnan(back["a"]["nan"]) and back["a"]["inf"][:2] == [math.inf, -math.inf]
    assert back["a"]["inf"][4] == (1, 2) and back["a"]["keys"] == {1: "x", 2.5: None}
    # a real run's config.py reads the same as executing it would give
    assert read_run_config(interrupted / "config.py") == load_config(interrupted / "config.py")


@pytest.mark.parametrize(("text", "line", "problem"), [
    ("import os\n", 3, "not an assignment"),
    ("x = __import__('os').system('true')\n", 3, "the value of x is an expression"),
    ("x = float('nan') + 1\n", 3, "the value of x is an expression"),
    ("x = {1, 2}\n", 3, "is a set"),
    ("_x = 1\n", 3, "private name"),
    ("x = (\n", 3, "syntax error"),
])
def test_read_run_config_refuses_anything_but_literals(tmp_path, text, line, problem):
    path = tmp_path / "config.py"
    path.write_text("# resolved by pimm\nseed = 1\n" + text)
    with pytest.raises(ConfigError) as info:
        read_run_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line {line}: {CODE_MARKER}: ") and problem in message, message
    assert "\n" not in message


def test_a_run_config_with_code_appended_is_refused_and_never_run(tmp_path, tiny_data, run_copy):
    marker = tmp_path / "marker"
    lines = (run_copy / "config.py").read_text().count("\n")
    with (run_copy / "config.py").open("a") as f:
        f.write(f"import os; os.system('touch {marker}')\n")
    where = f"{run_copy}/config.py, line {lines + 1}: {CODE_MARKER}"
    one_line_error(pimm_in_process(["export", "--run-dir", run_copy, tmp_path / "export"]), where)
    one_line_error(pimm_in_process(["test", "--run-dir", run_copy, "--split", "val", "--out", tmp_path / "t"]), where)
    one_line_error(pimm_in_process(["predict", "--weights", run_copy, "--data", tiny_data["val"],
                                    "--out", tmp_path / "p.h5"]), where)
    one_line_error(pimm_in_process(["launch", "--train.resume", run_copy, "--dry-run"]), where)
    assert not marker.exists()
    assert not (tmp_path / "export").exists() and not (tmp_path / "t").exists()


# -- export ---------------------------------------------------------------------------------------


def test_export_refuses_weights_that_do_not_fit_the_run_model(tmp_path, run_copy):
    model_cfg = read_run_config(run_copy / "config.py")["model"]
    other = build_model({**model_cfg, "channels": 8})  # the tiny run's model has 16
    torch.save(other.state_dict(), run_copy / "model" / "model_best.pth")
    out = tmp_path / "export"
    line = one_line_error(pimm_in_process(["export", "--run-dir", run_copy, "--checkpoint", "best", out]),
                          f"--checkpoint best: the weights {run_copy}/model/model_best.pth do not fit the model of",
                          "shape mismatches (", "[8", "in the file", "nothing exported")
    assert "missing" not in line  # same names, other shapes
    assert not out.exists()


def test_export_files_follow_the_umask(tmp_path, interrupted):
    for mask, expected in ((0o022, 0o644), (0o077, 0o600)):
        out = tmp_path / f"export-{mask:o}"
        with umask(mask):
            res = pimm_in_process(["export", "--run-dir", interrupted, out])
        assert res.returncode == 0, res.stderr
        assert {p.name: mode(p) for p in out.iterdir()} == {"model.safetensors": expected, "config.json": expected}


def test_a_run_directory_follows_the_umask(tmp_path, tiny_data):
    """`pimm submit --output` writes the run directory (config.py, launch.json) and the script, and queues nothing."""
    for mask, expected in ((0o022, 0o644), (0o077, 0o600)):
        exp = tmp_path / f"exp-{mask:o}"
        with umask(mask):
            res = pimm_in_process(["submit", "--site", "local-slurm", "--train.config", TINY, "--run.name", "u",
                                   "--run.no-timestamp", "--paths.exp-root", exp, "--output", tmp_path / f"{mask}.sh",
                                   "--", *data_args(tiny_data)], cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        run_dir = exp / "tests" / "u"
        assert mode(run_dir / "config.py") == expected and mode(run_dir / "launch.json") == expected


# -- pimm submit: nothing with a control character reaches a batch script -----------------------


INJECTED = "gpu\n#SBATCH --uid=0"


@pytest.mark.parametrize("flag", ["--resources.account", "--resources.partition", "--resources.qos",
                                  "--resources.constraint", "--run.name"])
def test_submit_refuses_a_flag_with_a_control_character(tmp_path, tiny_data, flag):
    res = pimm_in_process(["submit", "--site", "slurm", "--train.config", TINY, flag, INJECTED, "--dry-run",
                           "--paths.exp-root", tmp_path / "exp", "--", *data_args(tiny_data)], cwd=tmp_path)
    one_line_error(res, f"{flag} 'gpu\\n#SBATCH --uid=0' holds control character(s) \\n;", "one line")
    assert res.stdout == "" and not (tmp_path / "exp").exists()


def test_submit_refuses_a_site_profile_value_with_a_control_character(tmp_path, tiny_data):
    site = tmp_path / "mine.yaml"
    site.write_text('_base_: slurm\nqos: "normal\\ttouch /tmp/x"\n')
    res = pimm_in_process(["submit", "--site", site, "--train.config", TINY, "--dry-run",
                           "--paths.exp-root", tmp_path / "exp", "--", *data_args(tiny_data)], cwd=tmp_path)
    one_line_error(res, "site 'mine': qos 'normal\\ttouch /tmp/x' holds control character(s) \\t", f"(from {site})")
    assert res.stdout == ""


def test_submit_checks_every_value_where_the_script_is_rendered(tmp_path, tiny_data):
    # the working directory is no flag: the check where the script is rendered catches it
    workdir = tmp_path / "a\rb"
    workdir.mkdir()
    res = pimm_in_process(["submit", "--site", "slurm", "--train.config", TINY, "--dry-run",
                           "--paths.exp-root", tmp_path / "exp", "--", *data_args(tiny_data)], cwd=workdir)
    one_line_error(res, "the working directory", "holds control character(s) \\r")
    assert res.stdout == "" and not (tmp_path / "exp").exists()


def test_a_config_override_never_starts_a_line_of_the_script(tmp_path, tiny_data):
    names = '["shower\\n#SBATCH --uid=0", "track", "michel", "delta", "low_energy"]'
    res = pimm_in_process(["submit", "--site", "slurm", "--train.config", TINY, "--dry-run",
                           "--paths.exp-root", tmp_path / "exp", "--", *data_args(tiny_data), f"data.names={names}"],
                          cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--uid" not in res.stdout  # config values stay in config.py, written as Python literals


# -- one-line errors instead of tracebacks --------------------------------------------------------


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_test_and_predict_outputs_that_cannot_be_written(tmp_path, tiny_data, interrupted, where):
    (tmp_path / "file").write_text("in the way")
    base = tmp_path / "file" if where == "under-a-file" else Path("/proc")
    reason = f"{tmp_path / 'file'} is a file, not a directory" if where == "under-a-file" else "/proc"
    one_line_error(pimm_in_process(["test", "--run-dir", interrupted, "--split", "val", "--out", base / "t"]),
                   "--out", reason)
    one_line_error(pimm_in_process(["predict", "--weights", interrupted, "--data", tiny_data["val"],
                                    "--out", base / "p.h5"]), "--out", reason)
    assert not (interrupted / "eval").exists()


def test_show_out_under_a_file(tmp_path, tiny_data):
    (tmp_path / "file").write_text("in the way")
    res = pimm_in_process(["show", tiny_data["val"], "--event", "0", "--out", tmp_path / "file" / "e.png"])
    one_line_error(res, f"cannot write {tmp_path / 'file' / 'e.png'}", "choose a writable --out path")
    assert (tmp_path / "file").read_text() == "in the way"


def test_submit_with_a_binary_site_file(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_bytes(bytes(range(256)))
    one_line_error(pimm_in_process(["submit", "--site", site, "--train.config", TINY, "--dry-run"]),
                   f"site profile '{site}' is not a text file", "not UTF-8")


def test_a_long_run_name_is_refused_for_its_length(tmp_path):
    line = one_line_error(pimm_in_process(["launch", "--train.config", TINY, "--dry-run", "--run.name", "a" * 250,
                                           "--paths.exp-root", tmp_path / "exp"]),
                          "--run.name is 250 characters long", "at most 200")
    assert "letters, digits" not in line


def test_a_file_where_the_group_folder_should_be(tmp_path, tiny_data):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "tests").write_text("not a folder")
    res = pimm_in_process(["launch", "--train.config", TINY, "--paths.exp-root", exp, "--", *data_args(tiny_data)])
    line = one_line_error(res, f"{exp / 'tests'} is a file in the way of the run directory", "move or remove it")
    assert "already exists" not in line
    assert (exp / "tests").read_text() == "not a folder"


# -- a damaged run directory resumes ---------------------------------------------------------------


def test_resume_sets_aside_a_truncated_provenance_and_removes_planted_links(tmp_path, tiny_data, run_copy):
    provenance = run_copy / "provenance.json"
    truncated = provenance.read_bytes()[:200]
    provenance.write_bytes(truncated)
    model = run_copy / "model"
    targets = {}
    for name in (".tmp-step_00000009", ".trash-step_00000001"):
        target = tmp_path / f"target{name}"
        target.mkdir()
        (target / "keep.txt").write_text("someone else's")
        (model / name).symlink_to(target, target_is_directory=True)
        targets[name] = target

    res, _ = launch(run_copy.parents[1], tiny_data, 1, "max_steps=3", name=run_copy.name, resume=True)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "JSONDecodeError" not in res.stdout + res.stderr
    kept = [p for p in run_copy.iterdir() if p.name.startswith("provenance.json.corrupt-")]
    assert len(kept) == 1 and kept[0].read_bytes() == truncated  # set aside, never lost
    said = [line for line in res.stdout.splitlines() if "provenance.json is not JSON" in line]
    assert len(said) == 1 and kept[0].name in said[0], res.stdout
    record = json.loads(provenance.read_text())
    assert [a["outcome"] for a in record["attempts"]] == ["completed"]
    for name, target in targets.items():
        assert not os.path.lexists(model / name), name
        assert (target / "keep.txt").read_text() == "someone else's"
    assert sorted(p.name for p in model.iterdir() if p.name.startswith(".")) == []

