"""`pimm submit` and `srun pimm launch` on a real two-node Slurm cluster (scripts/slurm_local.sh,
started by .ci/run): world size 4 across two nodes, chains cut by a real `scancel --signal=USR1`
that resume to the same weights, a chain that ends when a job makes no progress, one that goes on
from a checkpoint written in full by a job killed before its rename, and the errors a user meets
before anything is queued."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    attempts,
    losses,
    require_slurm_cluster,
    run_pimm,
    steps,
    wait_for_slurm_jobs,
    weights,
)

SNAPSHOTS = Path(__file__).parent / "snapshots"
# 48 events / global batch 4 = 12 steps per epoch; 4 global loader workers = 1 per rank (workers on)
CHAIN_RUN = ("epochs=4", "num_worker=4", "log_event_ids=true")


@pytest.fixture(scope="module")
def slurm():
    """The local cluster must answer: without one the test skips, or fails where one is required
    (PIMM_REQUIRE_SLURM=1, set by .ci/run)."""
    require_slurm_cluster()


def data_args(tiny_data) -> list[str]:
    return [f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"]


def submit(tmp_path, tiny_data, *overrides, name="run", extra=()) -> tuple[subprocess.CompletedProcess, Path]:
    res = run_pimm(["submit", "--site", "local-slurm", "--train.config", TINY, "--run.name", name,
                    "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), *extra, "--",
                    *data_args(tiny_data), *overrides], cwd=tmp_path)
    return res, tmp_path / "exp" / "tests" / name


def job_ids(res) -> list[int]:
    match = re.search(r"queued Slurm job\(s\) ([\d ]+)", res.stdout)
    assert match, res.stdout + res.stderr
    return [int(x) for x in match.group(1).split()]


def slurm_log(run_dir: Path, job: int) -> str:
    path = run_dir / "slurm_logs" / f"slurm-{job}.out"
    return path.read_text() if path.exists() else ""


@contextlib.contextmanager
def cancelled_at_exit(jobs: list[int]):
    try:
        yield
    finally:
        subprocess.run(["scancel", *map(str, jobs)], check=False, capture_output=True)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory, tiny_data):
    """One `pimm submit` of the tiny config on 2 nodes x 2 processes, run to the end."""
    tmp = tmp_path_factory.mktemp("slurm-ref")
    res, run_dir = submit(tmp, tiny_data, *CHAIN_RUN, name="ref")
    assert res.returncode == 0, res.stderr
    jobs = job_ids(res)
    with cancelled_at_exit(jobs):
        (state,) = wait_for_slurm_jobs(jobs)
    return run_dir, jobs[0], state


def test_submit_runs_on_two_nodes_to_completion(uninterrupted):
    run_dir, job, state = uninterrupted
    log = slurm_log(run_dir, job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log
    assert state["NumNodes"] == "2" and state["NodeList"] == "n[1-2]"
    assert "world size 4 (2 per node)" in log and "pimm: training finished" in log
    assert "pimm: node 1: completed (exit status 0)" in log  # the second node's agent saw the same end
    assert "--rdzv-id" in log and f" {job}.0 " in log  # the rendezvous is the job's own
    assert (run_dir / "model/last/.complete").is_file()
    assert sorted(p.name for p in (run_dir.parent).iterdir()) == ["ref"]  # one run directory for both nodes
    (attempt,) = attempts(run_dir)
    assert attempt["outcome"] == "completed" and attempt["world_size"] == 4
    assert attempt["slurm"]["job_id"] == str(job)
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["scheduler"] == "slurm" and launch["site"] == "local-slurm" and launch["world_size"] == 4
    assert not (run_dir / ".nodes").exists() or not any((run_dir / ".nodes").iterdir())  # announcement withdrawn


def test_chain_cut_by_usr1_resumes_in_the_next_job_to_the_same_weights(slurm, tmp_path, tiny_data, uninterrupted):
    ref_dir, _, _ = uninterrupted
    res, run_dir = submit(tmp_path, tiny_data, *CHAIN_RUN, name="chain", extra=["--chain.jobs", "2"])
    assert res.returncode == 0, res.stderr
    first, second = jobs = job_ids(res)
    with cancelled_at_exit(jobs):
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.1)
        assert metrics.exists(), slurm_log(run_dir, first)
        # as Slurm does before the time limit: USR1 to every process of the job's steps
        subprocess.run(["scancel", "--signal=USR1", str(first)], check=True)
        states = wait_for_slurm_jobs(jobs)
    log1, log2 = slurm_log(run_dir, first), slurm_log(run_dir, second)
    assert states[0]["JobState"] == "FAILED" and states[0]["ExitCode"] == "75:0", log1
    assert f"job {second} resumes it" in log1
    assert states[1]["JobState"] == "COMPLETED" and states[1]["ExitCode"] == "0:0", log2
    cut = attempts(run_dir)[0]
    assert cut["outcome"] == "interrupted by SIGUSR1" and 0 < cut["checkpoint_step"] < 48
    resumed = attempts(run_dir)[-1]
    assert resumed["start_step"] == cut["checkpoint_step"] and resumed["outcome"] == "completed"
    assert f"resumes {run_dir} from step {cut['checkpoint_step']}" in log2
    # the cursor is exact: every step trained the same events as the uninterrupted run
    assert steps(run_dir) == steps(ref_dir)
    # and the numbers agree to float32 rounding. Not bit for bit at 4 ranks: DDP lays out its
    # gradient buckets anew after the first step of every process, and with more than two ranks
    # gloo's ring all-reduce sums each element in an order that depends on that layout (at 2
    # ranks a same-topology resume is bit-identical: tests/test_resume.py). Measured: 1.2e-7.
    ours, theirs = losses(run_dir), losses(ref_dir)
    assert ours.keys() == theirs.keys() and len(ours) == 48
    assert all(abs(ours[s] - theirs[s]) <= 1e-6 * abs(theirs[s]) for s in ours)
    for key, value in weights(run_dir).items():
        torch.testing.assert_close(value, weights(ref_dir)[key], rtol=0, atol=1e-6)


def test_a_chain_job_without_checkpoint_progress_ends_the_chain(slurm, tmp_path, tiny_data):
    # the loss turns non-finite at step 1: every job would fail before its first checkpoint
    res, run_dir = submit(tmp_path, tiny_data, "debug.nonfinite_loss_at_step=1", name="stuck",
                          extra=["--chain.jobs", "3"])
    assert res.returncode == 0, res.stderr
    jobs = job_ids(res)
    with cancelled_at_exit(jobs):
        states = wait_for_slurm_jobs(jobs)
    assert states[0]["JobState"] == "FAILED" and states[0]["ExitCode"] == "1:0", slurm_log(run_dir, jobs[0])
    log2 = slurm_log(run_dir, jobs[1])
    assert states[1]["ExitCode"] == "78:0", log2
    assert f"job {jobs[0]} made no checkpoint progress" in log2 and f"cancelled {jobs[2]}" in log2
    assert states[2]["JobState"] == "CANCELLED" and not slurm_log(run_dir, jobs[2])
    assert len(attempts(run_dir)) == 1  # the second job never started training


def test_a_job_killed_between_a_checkpoints_manifest_and_its_rename_is_progress(slurm, tmp_path, tiny_data):
    # rank 0 dies (SIGKILL) after writing step 12's `.complete`, before renaming .tmp-step_00000012 to `last`: the
    # first checkpoint of the run. The next job must count it (not end the chain for want of progress) and go on
    kill = "debug.kill_after_checkpoint_manifest_at_step=12"
    res, run_dir = submit(tmp_path, tiny_data, "epochs=2", "num_worker=4", kill, name="renamed",
                          extra=["--chain.jobs", "2"])
    assert res.returncode == 0, res.stderr
    first, second = jobs = job_ids(res)
    with cancelled_at_exit(jobs):
        states = wait_for_slurm_jobs(jobs)
    log1, log2 = slurm_log(run_dir, first), slurm_log(run_dir, second)
    assert states[0]["JobState"] == "FAILED", log1
    assert "the last complete checkpoint is step 12" in log1 and "the resume renames it last first" in log1, log1
    chain = json.loads((run_dir / "slurm" / "chain.json").read_text())
    (submission,) = chain["submissions"].values()
    assert [link.get("end_step") for link in submission["links"]] == [12, 24], chain
    assert states[1]["JobState"] == "COMPLETED" and states[1]["ExitCode"] == "0:0", log2
    assert f"resumes {run_dir} from step 12" in log2 and "no checkpoint progress" not in log2
    resumed = attempts(run_dir)[-1]
    assert resumed["start_step"] == 12 and resumed["outcome"] == "completed"
    assert resumed["resumed_from"] == str(run_dir / "model" / "last")
    assert not list((run_dir / "model").glob(".tmp-*"))


def test_srun_pimm_launch_inside_an_allocation(slurm, tmp_path, tiny_data):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = ["salloc", "-N", "2", "--ntasks-per-node=1", "--cpus-per-task=2", "--time=10",
            "srun", "--ntasks-per-node=1", sys.executable, "-m", "pimm", "launch", "--train.config", TINY,
            "--resources.nnodes", "2", "--resources.nproc-per-node", "2",
            "--paths.exp-root", str(tmp_path / "exp"), "--", *data_args(tiny_data), "epochs=1"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "exp" / "tests").iterdir()  # both nodes named the same run: <name>-<job>.<step>
    job = re.search(r"Granted job allocation (\d+)", done.stderr).group(1)
    assert run_dir.name == f"tiny_semseg-{job}.0"
    assert "world size: 4 (2 node(s) x 2 process(es)" in done.stdout
    assert "pimm: node 1: completed" in done.stderr
    assert attempts(run_dir)[-1]["outcome"] == "completed" and (run_dir / "model/last/.complete").is_file()


def test_launch_inside_a_one_node_step_with_two_nodes_is_refused(slurm, tmp_path, tiny_data):
    done = subprocess.run(["srun", "-N", "1", "--ntasks=1", sys.executable, "-m", "pimm", "launch", "--dry-run",
                           "--train.config", TINY, "--resources.nnodes", "2", "--", *data_args(tiny_data)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2
    assert "--resources.nnodes 2 but this Slurm step spans 1 node(s)" in done.stderr
    assert "Traceback" not in done.stderr


def test_resubmitting_a_run_with_queued_jobs_is_refused(slurm, tmp_path, tiny_data):
    res, run_dir = submit(tmp_path, tiny_data, name="twice", extra=["--resources.time", "5"])
    jobs = job_ids(res)
    with cancelled_at_exit(jobs):
        subprocess.run(["scontrol", "hold", str(jobs[0])], check=False, capture_output=True)
        again = run_pimm(["submit", "--site", "local-slurm", "--train.resume", str(run_dir)], cwd=tmp_path)
    assert again.returncode == 2
    assert f"still has Slurm jobs pending or running: {jobs[0]}" in again.stderr


# -- rendered scripts and errors: no cluster needed ---------------------------------------------

def _normalized(script: str, tmp_path: Path) -> str:
    script = script.replace(str(tmp_path), "<tmp>").replace(sys.executable, "<python>")
    script = script.replace(str(REPO / "pimm/launch/sites"), "<sites>")
    script = re.sub(r"\d{8}-\d{6}-[0-9a-f]{6}", "<submission>", script)
    return re.sub(r"pimm \d+\.\d+\.\d+", "pimm <version>", script)


@pytest.mark.parametrize("site,flags", [
    ("slurm", ["--resources.partition", "gpu", "--resources.nnodes", "2", "--resources.nproc-per-node", "4"]),
    ("nersc", ["--resources.account", "m1234_g", "--resources.nnodes", "2"]),
    ("apptainer", ["--resources.nnodes", "2", "--resources.nproc-per-node", "2"]),
])
def test_rendered_script_matches_its_snapshot(tmp_path, tiny_data, site, flags):
    res = run_pimm(["submit", "--site", site, *flags, "--train.config", TINY, "--run.name", "snap",
                    "--run.no-timestamp", "--paths.exp-root", str(tmp_path / "exp"), "--dry-run", "--",
                    *data_args(tiny_data), "batch_size=8", "batch_size_val=8"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    script = _normalized(res.stdout.split("\nsbatch commands:")[0], tmp_path) + "\n"
    snapshot = SNAPSHOTS / f"submit-{site}.sbatch"
    if os.environ.get("PIMM_UPDATE_SNAPSHOTS"):
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(script)
    assert script == snapshot.read_text()
    assert not (tmp_path / "exp").exists()  # a dry run creates nothing


@pytest.mark.parametrize("flags,env_path,expected", [
    (["--site", "nowhere"], None, "unknown site 'nowhere'"),
    (["--site", "nersc"], None, "site 'nersc' needs an account: pass --resources.account NAME"),
    (["--site", "slurm", "--resources.time", "1:2:3:4"], None, "1:2:3:4"),
    (["--site", "local-slurm", "--resources.nproc-per-node", "3"], None, "not divisible by the world size 6"),
    (["--site", "local-slurm"], "/nonexistent", "sbatch is not on PATH"),
    (["--site", "local", "--dry-run"], None, "does not use Slurm"),
    (["--site", "local-slurm", "--chain.jobs", "0"], None, "--chain.jobs must be >= 1"),
])
def test_submit_errors_are_clear_and_create_nothing(tmp_path, tiny_data, flags, env_path, expected):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if env_path:
        env["PATH"] = env_path
    proc = subprocess.run([sys.executable, "-m", "pimm", "submit", *flags, "--train.config", TINY,
                           "--paths.exp-root", str(tmp_path / "exp"), "--", *data_args(tiny_data)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "exp").exists()


def test_dry_run_works_without_sbatch(tmp_path, tiny_data):
    proc = subprocess.run([sys.executable, "-m", "pimm", "submit", "--site", "local-slurm", "--train.config", TINY,
                           "--dry-run", "--paths.exp-root", str(tmp_path / "exp"), "--", *data_args(tiny_data)],
                          cwd=tmp_path, env=dict(os.environ, PATH="/nonexistent"), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --ntasks-per-node=1" in proc.stdout and "dry run: nothing created" in proc.stdout


def test_output_writes_the_script_and_prepares_the_run(tmp_path, tiny_data):
    out = tmp_path / "job.sbatch"
    res = run_pimm(["submit", "--site", "local-slurm", "--train.config", TINY, "--run.name", "o", "--run.no-timestamp",
                    "--paths.exp-root", str(tmp_path / "exp"), "--output", str(out), "--",
                    *data_args(tiny_data)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "exp/tests/o"
    assert out.read_text().startswith("#!/bin/bash") and f"queue it with: sbatch {out}" in res.stdout
    assert (run_dir / "config.py").is_file() and (run_dir / "slurm_logs").is_dir()
    assert json.loads((run_dir / "launch.json").read_text())["site"] == "local-slurm"


def test_a_two_node_run_continues_on_one_machine_only_when_asked(uninterrupted):
    run_dir, _, _ = uninterrupted
    more = ["--", "epochs=5"]  # the run completed its 4 epochs: one more, so that there is something to continue
    res = run_pimm(["launch", "--train.resume", str(run_dir), "--dry-run", *more], cwd=run_dir.parents[2])
    assert res.returncode == 2 and "was launched on 2 nodes" in res.stderr and "--resources.nnodes 1" in res.stderr
    res = run_pimm(["launch", "--train.resume", str(run_dir), "--resources.nnodes", "1", "--dry-run", *more],
                   cwd=run_dir.parents[2])
    assert res.returncode == 0, res.stderr
    assert "world size: 2 (1 node(s) x 2 process(es)" in res.stdout


def test_validate_scaling_runs_as_a_slurm_job_and_leaves_its_report(slurm, passing_checklist):
    """conftest's passing_checklist, which ran as one job of the local cluster (its report's contents:
    tests/test_validate_scaling.py)."""
    job, state, out = passing_checklist.job, passing_checklist.job_state, passing_checklist.out
    assert job is not None, "the cluster answers, yet the checklist did not run as a Slurm job"
    log = (out / f"slurm-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log
    assert state["NumNodes"] == "1"  # the checklist's runs share one node
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "PASS" and all(c["status"] == "PASS" for c in report["checks"])
    assert "--signal" not in (out / "validate-scaling.sbatch").read_text()  # USR1 would end the checklist's driver
