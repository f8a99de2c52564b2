"""What a user meets through the CLI when something is off: the Slurm tests without a cluster,
an unknown override key, a folder given as a config, and a resume of a run that already completed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, TINY, attempts, pimm_in_process, run_pimm


def test_slurm_tests_skip_without_a_cluster_and_fail_where_one_is_required(tmp_path):
    def run_one(**env) -> subprocess.CompletedProcess:
        # no sinfo on PATH: as on a machine without Slurm
        clean = {k: v for k, v in os.environ.items()
                 if k not in ("CI", "PIMM_REQUIRE_SLURM") and not k.startswith("PYTEST_XDIST")}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               "tests/test_slurm.py", "-k", "test_srun_pimm_launch_inside_an_allocation"],
                              cwd=REPO, env={**clean, "PATH": str(tmp_path), **env}, capture_output=True,
                              text=True, timeout=120, check=False)

    skipped = run_one()
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    assert "bash scripts/slurm_local.sh up" in skipped.stdout
    required = run_one(PIMM_REQUIRE_SLURM="1")
    assert required.returncode == 1 and "1 error" in required.stdout, required.stdout
    assert "no Slurm cluster answers `sinfo`" in required.stdout and "slurm_local.sh up" in required.stdout


def test_unknown_override_key_names_the_closest_keys(tiny_data):
    def refusal(*overrides: str) -> str:
        res = pimm_in_process(["launch", "--dry-run", "--train.config", TINY, "--", *overrides])
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        return res.stderr.strip()

    assert refusal("lr=0.1") == (
        "pimm: error: unknown config key 'lr'; did you mean 'optimizer.lr'? Overrides can only change keys "
        "that exist; add new keys in the config file.")
    assert "did you mean one of 'data.train.path', 'data.val.path', 'pretrained.path'?" in refusal("path=x.h5")
    assert refusal("zzz=1").startswith("pimm: error: unknown config key 'zzz'. Overrides can only")


def test_a_folder_given_as_config_lists_the_configs_in_it():
    res = pimm_in_process(["launch", "--dry-run", "--train.config", "configs/tests"])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "'configs/tests' is a directory, not a config file" in res.stderr
    assert "tests/tiny_semseg" in res.stderr and "For example: --train.config tests/tiny_" in res.stderr
    assert "not found" not in res.stderr


def _snapshot(run_dir: Path) -> dict[str, tuple]:
    """Every file and folder of the run: bytes and modification time (ns)."""
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*"))}


def test_resuming_a_completed_run_changes_nothing(tmp_path, tiny_data, tested_run):
    run_dir = tested_run.run_dir  # conftest's shared finished run: 4 steps of max_steps=4
    before = _snapshot(run_dir)
    finished = attempts(run_dir)[-1]["end_time"]

    again = run_pimm(["launch", "--train.resume", str(run_dir)], cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert f"{run_dir} already completed (step 4 of 4, finished {finished}); nothing to resume" in again.stdout
    assert f"pimm launch --train.config {TINY} --train.weight {run_dir}/model/last -- " in again.stdout
    assert f"data.train.path={tiny_data['train']}" in again.stdout  # the run's own overrides, to paste
    assert "max_steps=4" not in again.stdout and f"--train.resume {run_dir} -- max_steps=<N>" in again.stdout
    assert _snapshot(run_dir) == before

    # pimm submit queues nothing (and needs no sbatch to say so)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=str(tmp_path))
    submitted = subprocess.run([sys.executable, "-m", "pimm", "submit", "--site", "local-slurm", "--train.resume",
                                str(run_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                               check=False)
    assert submitted.returncode == 0, submitted.stderr
    assert "already completed (step 4 of 4" in submitted.stdout and "pimm submit --site local-slurm" in submitted.stdout
    # a job of a Slurm chain that starts after the run completed ends at once (status 3: the job ends with 0)
    job = subprocess.run([sys.executable, "-m", "pimm.launch.slurm_job", "begin", "--run-dir", str(run_dir),
                          "--submission", "later"], cwd=REPO, env={**env, "SLURM_JOB_ID": "7"},
                         capture_output=True, text=True, timeout=120, check=False)
    assert job.returncode == 3 and "has finished (step 4); nothing to do" in job.stdout, job.stdout + job.stderr
    assert _snapshot(run_dir) == before

    # more steps than it trained: there is something to resume
    more = run_pimm(["launch", "--train.resume", str(run_dir), "--dry-run", "--", "max_steps=5"], cwd=REPO)
    assert more.returncode == 0 and "already completed" not in more.stdout, more.stdout + more.stderr
    assert "config changes: max_steps: 4 -> 5" in more.stdout


def test_a_one_cycle_schedule_torch_cannot_step_is_refused_before_any_process(tmp_path, tiny_data):
    """48 train events in batches of 6 for 5 epochs: 40 steps; pct_start 0.025 makes the warm-up one step,
    a phase of no length that torch divides by at the first step."""
    res = pimm_in_process(["launch", "--train.config", TINY, "--paths.exp-root", str(tmp_path / "exp"), "--",
                           f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}",
                           "batch_size=6", "epochs=5", "scheduler={type: OneCycleLR, max_lr: 0.003, pct_start: 0.025}"])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "pct_start=0.025 over 40 steps gives a phase of no length" in res.stderr
    assert not (tmp_path / "exp").exists()
