"""Ranks forked from pimm's torchrun (pimm.launch.forked_rank): what a forked rank starts with, and the
same training as ranks started as new interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, assert_bitwise_equal, attempts, launch, launch_args, losses, pimm_in_process, steps, weights

from pimm.launch.forked_rank import forked_module
from pimm.launch.torchrun import RANK_ENTRIES

# A parent as pimm's torchrun is when it forks: torch loaded with OMP_NUM_THREADS unset (as many OpenMP
# threads as cores), Python handlers on the stop signals. Two ranks: one reports what it started with
# and exits 7; one sleeps until the parent signals its process group.
FORK_TWO_RANKS = r"""
import json, os, signal, subprocess, sys, time, types
import torch
from pimm.launch import forked_rank

out = sys.argv[1]
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, lambda *_: None)

def report(argv):
    facts = {"argv": argv, "sys_argv": sys.argv, "own_session": os.getsid(0) == os.getpid(),
             "rank": os.environ.get("RANK"), "parent_only": os.environ.get("PARENT_ONLY"),
             "forked": os.environ.get("PIMM_FORKED_RANK"), "threads": torch.get_num_threads(),
             "name": open("/proc/self/comm").read().strip(),
             "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
             "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
             "sigint_keyboard": signal.getsignal(signal.SIGINT) is signal.default_int_handler}
    print("to the rank's stdout")
    with open(os.path.join(out, "facts.json"), "w") as f:
        json.dump(facts, f)
    return 7

def sleep(argv):
    time.sleep(60)
    return 0

command = (sys.executable, "-u", "-m", "pimm.engine.worker", "--run-dir", "RUN")
env = {"RANK": "1", "OMP_NUM_THREADS": "1"}
with open(os.path.join(out, "stdout.txt"), "w") as stdout:
    first = forked_rank.start(types.SimpleNamespace(main=report), command, env, stdout, None)
    code = first.wait(timeout=60)
second = forked_rank.start(types.SimpleNamespace(main=sleep), command, env, None, None)
try:
    second.wait(timeout=0.2)
    waited = "ended"
except subprocess.TimeoutExpired:
    waited = "timed out"
os.killpg(second.pid, signal.SIGTERM)
# at once: the child leads its group when start returns, and the signal waits for the child's own handlers
# (torchrun's, here one that ignores it, are never run in the child)
third = forked_rank.start(types.SimpleNamespace(main=sleep), command, env, None, None)
os.killpg(third.pid, signal.SIGTERM)
print(json.dumps({"code": code, "poll": first.poll(), "waited": waited, "stopped": second.wait(timeout=30),
                  "stopped_at_once": third.wait(timeout=30), "parent_threads": torch.get_num_threads()}))
"""


def test_a_forked_rank_starts_as_torchrun_starts_a_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PARENT_ONLY"] = "torchrun's own"
    res = subprocess.run([sys.executable, "-c", FORK_TWO_RANKS, str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    parent = json.loads(res.stdout.splitlines()[-1])
    assert parent["code"] == parent["poll"] == 7
    assert parent["waited"] == "timed out" and parent["stopped"] == -15  # SIGTERM's default: the rank ends
    assert parent["stopped_at_once"] == -15
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["argv"] == ["--run-dir", "RUN"] and facts["sys_argv"][1:] == ["--run-dir", "RUN"]
    assert facts["own_session"] and facts["rank"] == "1" and facts["forked"] == "1"
    assert facts["name"] == "pimm-rank-1"
    assert facts["parent_only"] is None  # the rank's environment is the one torchrun gave it, nothing more
    assert facts["sigterm_default"] and facts["sigusr1_default"] and facts["sigint_keyboard"]
    assert facts["threads"] == 1  # OMP_NUM_THREADS=1 of the rank's environment, not the parent's
    if (os.cpu_count() or 1) > 1:
        assert parent["parent_threads"] > 1  # so the line above tells the two apart
    assert (tmp_path / "stdout.txt").read_text() == "to the rank's stdout\n"


def test_only_pimms_ranks_are_forked():
    python, ranks = sys.executable, RANK_ENTRIES
    assert set(ranks) == {"pimm.engine.worker", "pimm.engine.eval_worker"}
    assert forked_module((python, "-u", "-m", "pimm.engine.worker", "--run-dir", "R"), ranks) == "pimm.engine.worker"
    evaluation = (python, "-m", "pimm.engine.eval_worker", "--eval-dir", "D")
    assert forked_module(evaluation, ranks) == "pimm.engine.eval_worker"
    assert forked_module((python, "-u", "examples/course/7_mnist_ddp_pt_multinode.py"), ranks) is None  # a script
    assert forked_module((python, "-u", "-m", "mypackage.train"), ranks) is None
    assert forked_module(("numactl", "--cpunodebind=0", python, "-u", "-m", "pimm.engine.worker"), ranks) is None
    assert forked_module(("/usr/bin/other-python", "-u", "-m", "pimm.engine.worker"), ranks) is None


def test_ranks_started_as_new_interpreters_train_to_the_same_bits(tmp_path, tiny_data, reference, monkeypatch):
    """conftest's reference (2 ranks, 24 steps, ranks forked) against the same launch with
    PIMM_RANK_START=exec: the same events at every step, the same losses and weights to the bit."""
    monkeypatch.setenv("PIMM_RANK_START", "exec")
    res, run_dir = launch(tmp_path, tiny_data, 2, name="exec")
    assert res.returncode == 0, res.stderr
    forked, started = attempts(reference)[-1], attempts(run_dir)[-1]
    assert (forked["rank_start"], started["rank_start"]) == ("fork", "exec")
    assert forked["torch_threads"] == started["torch_threads"] == 1
    assert steps(run_dir) == steps(reference) and losses(run_dir) == losses(reference)
    assert_bitwise_equal(weights(run_dir), weights(reference))


def test_a_rank_start_that_is_neither_fork_nor_exec_is_refused_before_anything_starts(tmp_path, tiny_data,
                                                                                     monkeypatch):
    monkeypatch.setenv("PIMM_RANK_START", "spawn")
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 2, name="never"))
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "PIMM_RANK_START='spawn' is not a way to start ranks" in line and "fork" in line and "exec" in line
    assert not (tmp_path / "tests").exists()  # no run directory, no process
