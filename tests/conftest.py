"""Shared fixtures: free ports, small generated data sets, and a runner for the pimm CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

try:  # pytest-xdist: make test runs the suite in 2 worker processes; it also runs without
    from xdist.scheduler import LoadFileScheduling
except ImportError:
    LoadFileScheduling = None

REPO = Path(__file__).resolve().parents[1]


SLURM_HOWTO = "start the local two-node cluster with `bash scripts/slurm_local.sh up`"


def slurm_cluster_answers() -> bool:
    """Whether a Slurm cluster answers `sinfo`."""
    try:
        return shutil.which("sinfo") is not None and subprocess.run(
            ["sinfo", "-h"], capture_output=True, timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def require_slurm_cluster() -> None:
    """Skip the calling test when no Slurm cluster answers `sinfo`; fail instead when the run must
    have one (PIMM_REQUIRE_SLURM=1, which .ci/run sets, or CI)."""
    if slurm_cluster_answers():
        return
    if os.environ.get("PIMM_REQUIRE_SLURM") == "1" or os.environ.get("CI"):
        pytest.fail(f"no Slurm cluster answers `sinfo`, and this test run requires one (PIMM_REQUIRE_SLURM=1 or CI "
                    f"is set): {SLURM_HOWTO} before the tests", pytrace=False)
    pytest.skip(f"needs a Slurm cluster: {SLURM_HOWTO}")


SLURM_TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                  "BOOT_FAIL", "DEADLINE"}


def slurm_job_state(job: int) -> dict:
    """`scontrol show job JOB` as a dict (JobState, ExitCode, NodeList, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True, timeout=30,
                         check=False).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_for_slurm_jobs(jobs: list[int], timeout: float = 300) -> list[dict]:
    """The final states of `jobs` once every one has ended; cancels exactly these jobs (by id) and fails
    if they have not ended within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = [slurm_job_state(j) for j in jobs]
        if all(s.get("JobState") in SLURM_TERMINAL for s in states):
            return states
        time.sleep(0.25)
    subprocess.run(["scancel", *map(str, jobs)], check=False)
    raise AssertionError(f"Slurm jobs {jobs} did not end within {timeout} s: {[slurm_job_state(j) for j in jobs]}")


def _scope(nodeid: str) -> str:
    """What runs together on one pytest-xdist worker: the tests that use the Slurm cluster (tests/test_slurm.py
    and every test named *slurm*), one at a time, as the local two-node cluster runs one test's jobs at a
    time; every other test with the rest of its file, whose module fixtures are then made once."""
    path, _, name = nodeid.partition("::")
    return "slurm" if path.endswith("test_slurm.py") or "slurm" in name else path


if LoadFileScheduling is not None:
    class _FileOrSlurmScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (make test: `-n 2 --dist loadfile`), with the Slurm tests as one more file (_scope),
    handed out in collection order (pytest_collection_modifyitems puts the longest first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    config.option.loadscopereorder = False  # xdist's own order (most tests first) would leave a long file last
    return _FileOrSlurmScheduling(config, log)


# the scopes that take longest (pytest --durations, processes started per test), handed out first: a worker that
# takes a long file last would otherwise run alone at the end. The others follow in their collection order.
LONGEST_FIRST = ("slurm", "tests/test_resume.py", "tests/test_benchmarks_smoke.py", "tests/test_course.py",
                 "tests/test_finetune_weights.py", "tests/test_harden.py", "tests/test_pretraining.py",
                 "tests/test_house.py", "tests/test_ptv3m2.py", "tests/test_panoptic_task.py", "tests/test_fsdp2.py",
                 "tests/test_evaluate.py", "tests/test_wandb.py", "tests/test_pilarnet.py",
                 "tests/test_bench_memory.py", "tests/test_accumulation.py", "tests/test_show_instances.py",
                 "tests/test_checkpoint_safety.py", "tests/test_validate_scaling.py", "tests/test_eval_steps.py",
                 "tests/test_tensorboard.py", "tests/test_robust_run.py")


def pytest_collection_modifyitems(config, items):
    if config.getvalue("dist") == "loadfile":
        rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_scope(item.nodeid), len(rank)))  # stable: files keep their order


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- what several test files share: made once per test run, also under pytest-xdist --------------------

def _encode(value):
    """A shared fixture's result as JSON (see once)."""
    if isinstance(value, Path):
        return {"path": str(value)}
    if isinstance(value, subprocess.CompletedProcess):
        fields = {"args": value.args, "returncode": value.returncode, "stdout": value.stdout, "stderr": value.stderr}
        if hasattr(value, "run_dir"):
            fields["run_dir"] = str(value.run_dir)
        return {"process": fields}
    if isinstance(value, Checklist):
        return {"checklist": _encode(dataclasses.asdict(value))}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a shared fixture cannot return a {type(value).__name__}: add it to _encode and _decode")


def _decode(value):
    if not isinstance(value, dict):
        return value
    (kind, body), = value.items()
    if kind == "path":
        return Path(body)
    if kind == "process":
        res = subprocess.CompletedProcess(body["args"], body["returncode"], body["stdout"], body["stderr"])
        if "run_dir" in body:
            res.run_dir = Path(body["run_dir"])
        return res
    if kind == "checklist":
        return Checklist(**_decode(body))
    if kind in ("list", "tuple"):
        items = [_decode(v) for v in body]
        return items if kind == "list" else tuple(items)
    return {_decode(k): _decode(v) for k, v in body}


def once(tmp_path_factory, name: str, make):
    """make(a new directory named `name`): what a session fixture shares, made once per test run. Under
    pytest-xdist each worker process has its own session fixtures: the first worker to ask makes the
    result under a file lock in the directory its workers share and leaves it there as JSON; the others
    wait for the lock and read it. Without xdist, make runs here as in any session fixture."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / "shared"  # this run's, common to its workers
    shared.mkdir(exist_ok=True)
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        saved = shared / f"{name}.json"
        if saved.exists():
            return _decode(json.loads(saved.read_text()))
        directory = shared / name
        shutil.rmtree(directory, ignore_errors=True)  # left by a worker whose make failed
        directory.mkdir()
        result = make(directory)
        saved.write_text(json.dumps(_encode(result)))
        return result


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """Small train/val event files, generated once per test run."""
    from pimm.data.synth import write_dataset

    return once(tmp_path_factory, "data", lambda root: {
        "train": write_dataset(root / "train.h5", 48, seed=11),
        "val": write_dataset(root / "val.h5", 12, seed=12),
    })


def run_pimm(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m pimm ARGS` in its own process group; kill the whole group if it hangs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pimm", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"pimm {' '.join(args)} timed out\nstdout:\n{out}\nstderr:\n{err}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of ours may outlive the test
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pimm_in_process(args: list, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`pimm ARGS` through pimm.cli.main in this process, in `cwd`, with its exit status and output as
    run_pimm returns them. For tests of what pimm checks and refuses before any process starts (a
    refused launch, --dry-run), where a new Python process would add only its start-up time; a test
    about processes keeps run_pimm."""
    from pimm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["pimm", *map(str, args)], code, out.getvalue(), err.getvalue())


# -- runs of the tiny config through `pimm launch` (shared by the resume and hardening tests) --

TINY = "tests/tiny_semseg"  # 48 train events / batch 4 = 12 steps per epoch


def launch_args(exp, tiny_data, nproc, *overrides, name="run", resume=False, extra=()) -> list[str]:
    """The `pimm` arguments of launch() (for pimm_in_process where a launch is refused before it starts)."""
    args = ["launch", "--train.config", TINY, "--resources.nproc-per-node", str(nproc), "--run.name", name,
            "--run.no-timestamp", "--paths.exp-root", str(exp), *extra]
    if resume:
        args.append("--train.resume")
    return [*args, "--", f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}",
            "log_event_ids=true", *overrides]


def launch(exp, tiny_data, nproc, *overrides, name="run", resume=False, extra=()):
    res = run_pimm(launch_args(exp, tiny_data, nproc, *overrides, name=name, resume=resume, extra=extra), cwd=REPO)
    return res, exp / "tests" / name


def steps(run_dir: Path) -> dict[int, list[int]]:
    """step -> the global batch's event ids (ranks concatenated in rank order)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in (run_dir / "logs").glob("event_ids_rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {})[rec["rank"]] = rec["event_ids"]
    return {s: [i for r in sorted(ranks) for i in ranks[r]] for s, ranks in sorted(by_step.items())}


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model/last/weights.pth", weights_only=True)


def attempts(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "provenance.json").read_text())["attempts"]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_data):
    """An uninterrupted 2-rank run of 2 epochs (24 steps)."""
    def make(exp: Path) -> Path:
        res, run_dir = launch(exp, tiny_data, 2, name="ref")
        assert res.returncode == 0, res.stderr
        return run_dir

    return once(tmp_path_factory, "reference", make)


@pytest.fixture(scope="session")
def tested_run(tmp_path_factory, tiny_data) -> subprocess.CompletedProcess:
    """A finished 4-step 1-rank run whose config has data.test (the tiny val file, set through a YAML
    override), so its launch ended with `pimm test` of the best model (RUN/eval/test-best). Shared by
    tests/test_evaluate.py, tests/test_predict.py and tests/test_robust_cli.py, which read it and write
    their outputs elsewhere. The result's `run_dir` is the run directory; its stdout, the launch's."""
    def make(exp: Path) -> subprocess.CompletedProcess:
        res, run_dir = launch(exp, tiny_data, 1, "max_steps=4",
                              f"data.test={{type: LArTPCDataset, path: {tiny_data['val']}}}", name="evalrun")
        assert res.returncode == 0, res.stderr
        res.run_dir = run_dir
        return res

    return once(tmp_path_factory, "tested", make)


@pytest.fixture(scope="session")
def evaluations(tested_run, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """`pimm test` of tested_run's best model on its data.test: at 1 rank (saving predictions), at 2 ranks
    under DDP (saving predictions and scores) and at 2 ranks under FSDP2: name -> (result, --out folder).
    Read by tests/test_evaluate.py and tests/test_predict.py."""
    def make(root: Path) -> dict:
        done = {}
        for name, nproc, args, overrides in (("one", 1, ("--save-predictions",), ()),
                                             ("ddp", 2, ("--save-predictions", "--save-scores"), ()),
                                             ("fsdp2", 2, (), ("parallel.strategy=fsdp2",))):
            out = root / name
            done[name] = run_pimm(["test", "--run-dir", str(tested_run.run_dir), "--resources.nproc-per-node",
                                   str(nproc), "--out", str(out), *args, *(["--", *overrides] if overrides else [])],
                                  cwd=REPO), out
        return done

    return once(tmp_path_factory, "evaluations", make)


# One pair of runs, at 1 and at 2 ranks, of the same initial weights (lr=0: every step sees them) with
# point transforms on the training set and a CrossEntropy + Lovasz loss: shared by the tests that the
# 2-rank run takes the same training losses (tests/test_losses.py, tests/test_transforms.py) and the
# same validation metrics (tests/test_training.py) as the 1-rank run.
LR0_TRANSFORMS = ("data.train.transforms=[{type: RandomRotate, axis: x}, {type: RandomFlip}, "
                  "{type: Jitter, sigma: 0.1}, {type: RandomScale, scale: [0.9, 1.1]}, {type: GridSample, "
                  "grid_size: 2.0}, {type: NormalizeCoord}, {type: LogEnergy}, {type: RandomCrop, max_points: 300}]")
LR0_OVERRIDES = ("optimizer.lr=0", "max_steps=3", "epochs=1", "batch_size_val=2", "data.train.augment=false",
                 LR0_TRANSFORMS, "task.loss=[{type: CrossEntropy, weight: 1.0}, {type: Lovasz, weight: 0.5}]")


@pytest.fixture(scope="session")
def lr0_launches(tmp_path_factory, tiny_data) -> dict[int, tuple[subprocess.CompletedProcess, Path]]:
    """nproc (1, 2) -> (the launch's result, run directory) of LR0_OVERRIDES. Their configs also have a
    data.test (the tiny val file) with test_after_training=false, which tests/test_evaluate.py checks:
    the finished launches ran no `pimm test`."""
    def make(exp: Path) -> dict:
        done = {}
        for nproc in (1, 2):
            res, run_dir = launch(exp, tiny_data, nproc, *LR0_OVERRIDES, "test_after_training=false",
                                  f"data.test={{type: LArTPCDataset, path: {tiny_data['val']}}}", name=f"n{nproc}")
            assert res.returncode == 0, res.stderr[-3000:]
            done[nproc] = res, run_dir
        return done

    return once(tmp_path_factory, "lr0", make)


@pytest.fixture(scope="session")
def lr0_runs(lr0_launches) -> dict[int, Path]:
    """nproc (1, 2) -> run directory of LR0_OVERRIDES."""
    return {nproc: run_dir for nproc, (_, run_dir) in lr0_launches.items()}


@pytest.fixture(scope="session")
def interrupted(tmp_path_factory, tiny_data) -> Path:
    """A 1-rank run stopped at step 2 (status 75) with one complete checkpoint. Shared: a test that
    resumes or damages it works on its own copy (copy_exp)."""
    def make(exp: Path) -> Path:
        res, run_dir = launch(exp, tiny_data, 1, "debug.interrupt_at_step=2")
        assert res.returncode == 75, res.stderr
        return run_dir

    return once(tmp_path_factory, "interrupted", make)


@pytest.fixture(scope="session")
def killed_in_checkpoint(tmp_path_factory, tiny_data) -> tuple[Path, list[str]]:
    """A 1-rank run logging to TensorBoard and W&B (offline; each where installed), killed while it wrote
    its step-8 checkpoint (checkpoint_every_n_steps=4: steps after 4 were logged, then redone from step 4),
    then resumed to its end. Returns (run directory, names of the TensorBoard event files the killed
    attempt left). Shared by the TensorBoard and W&B tests, which read the logs and change nothing."""
    import importlib.util

    loggers = [f"{name}.enabled=true" for name in ("tensorboard", "wandb") if importlib.util.find_spec(name)]
    if any(x.startswith("wandb") for x in loggers):
        loggers.append("wandb.system_metrics=false")

    def make(exp: Path) -> tuple[Path, list[str]]:
        res, run_dir = launch(exp, tiny_data, 1, *loggers, "checkpoint_every_n_steps=4",
                              "debug.kill_during_checkpoint_at_step=8")
        assert res.returncode != 0
        board = run_dir / "tensorboard"
        killed_files = sorted(p.name for p in board.iterdir()) if board.is_dir() else []
        res, run_dir = launch(exp, tiny_data, 1, "checkpoint_every_n_steps=4", resume=True)
        assert res.returncode == 0, res.stderr
        return run_dir, killed_files

    return once(tmp_path_factory, "killed", make)


@pytest.fixture(scope="session")
def interrupted_at_7(tmp_path_factory, tiny_data) -> Path:
    """A 2-rank run of the tiny config stopped at step 7 (status 75), logging to TensorBoard where it is
    installed (which changes nothing of the training). Shared by tests/test_tensorboard.py and
    tests/test_fsdp2.py: each resumes its own copy (copy_exp)."""
    import importlib.util

    board = ["tensorboard.enabled=true"] if importlib.util.find_spec("tensorboard") else []

    def make(exp: Path) -> Path:
        res, run_dir = launch(exp, tiny_data, 2, *board, "debug.interrupt_at_step=7")
        assert res.returncode == 75, res.stderr
        return run_dir

    return once(tmp_path_factory, "at7", make)


@dataclasses.dataclass
class Checklist:
    """One `pimm validate-scaling` of the tiny config at 1 and 2 ranks (passing_checklist)."""

    exit_status: int  # the checklist's own: the direct run's, or the Slurm job's
    log: str  # its output: the direct run's stdout and stderr, or the job's log
    out: Path  # the --out folder (report.json, report.md, provenance/, ...)
    job: int | None = None  # the Slurm job that ran it, if one did
    job_state: dict | None = None  # that job's final `scontrol show job`


@pytest.fixture(scope="session")
def passing_checklist(tmp_path_factory, tiny_data) -> Checklist:
    """The scaling checklist of the tiny config at 1 and 2 ranks, run once for tests/test_validate_scaling.py
    (its report) and tests/test_slurm.py (the job): where a Slurm cluster answers, as one job of the local
    cluster (`--site local-slurm`, whose batch script runs this same `pimm validate-scaling` without
    --site), otherwise directly."""
    def make(tmp: Path) -> Checklist:
        out = tmp / "validate"
        args = ["validate-scaling", "--train.config", TINY, "--ranks", "1,2", "--out", str(out), "--",
                f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}"]
        if not slurm_cluster_answers():
            res = run_pimm(args, cwd=REPO, timeout=400)
            return Checklist(res.returncode, res.stdout + res.stderr, out)
        res = run_pimm([*args[:1], "--site", "local-slurm", *args[1:]], cwd=tmp)
        assert res.returncode == 0, res.stdout + res.stderr
        job = int(re.search(r"queued Slurm job (\d+)", res.stdout).group(1))
        try:
            (state,) = wait_for_slurm_jobs([job], timeout=400)
        finally:
            subprocess.run(["scancel", str(job)], check=False, capture_output=True, timeout=30)  # this job only
        log = out / f"slurm-{job}.out"
        return Checklist(int(state["ExitCode"].split(":")[0]), log.read_text() if log.exists() else "(no job log)",
                         out, job, state)

    return once(tmp_path_factory, "checklist", make)


def copy_exp(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of a shared run's exp root under tmp_path/exp, for one test to resume or damage; the
    shared run stays as it is. The run is at copy/tests/<run_dir.name>."""
    exp = tmp_path / "exp"
    shutil.copytree(run_dir.parents[1], exp)
    return exp


@pytest.fixture(scope="session")
def reference_1rank(tmp_path_factory, tiny_data):
    """The same uninterrupted run as `reference` (2 epochs, 24 steps) on 1 process: the same events at
    every step, float sums in another order."""
    def make(exp: Path) -> Path:
        res, run_dir = launch(exp, tiny_data, 1, name="ref1")
        assert res.returncode == 0, res.stderr
        return run_dir

    return once(tmp_path_factory, "reference_1rank", make)


def start_launch(exp, tiny_data, nproc, *overrides, name="run", extra=()) -> subprocess.Popen:
    """`pimm launch` of the tiny config in the background, in a session of its own (like a batch job)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "pimm", "launch", "--train.config", TINY, "--resources.nproc-per-node", str(nproc),
            "--run.name", name, "--run.no-timestamp", "--paths.exp-root", str(exp), *extra, "--",
            f"data.train.path={tiny_data['train']}", f"data.val.path={tiny_data['val']}", *overrides]
    return subprocess.Popen(args, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, state letter) of every process, from /proc/PID/stat."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), fields[0])
    return table


_SESSIONS: dict[int, set[int]] = {}  # launcher pid -> the session ids of its processes seen so far


def processes_of(proc: subprocess.Popen) -> list[int]:
    """Every live process of the launch `proc` (started in a session of its own, as start_launch does):
    the launcher's session (launcher, torchrun) and every session its descendants opened (torch starts
    each rank in one of its own; loader workers share their rank's; wandb-core opens its own). Found by
    process, parent and session ids, never by command lines or run names, so the processes of another
    test session on the same machine are never touched. The sessions are remembered across calls: a
    rank whose launcher was killed is found as long as one call saw it."""
    sessions = _SESSIONS.setdefault(proc.pid, {proc.pid})
    sessions.discard(os.getsid(0))  # never the test session's own
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    while True:
        members = [pid for pid, (_, sid, _) in table.items() if sid in sessions]
        # the launcher's own pid only while it is ours: once reaped, the number may be another's
        stack, seen = [*([proc.pid] if proc.poll() is None else []), *members], set()
        while stack:
            pid = stack.pop()
            if pid not in seen:
                seen.add(pid)
                stack.extend(children.get(pid, ()))
        grown = {table[pid][1] for pid in seen if pid in table} - sessions - {os.getsid(0)}
        if not grown:
            break
        sessions |= grown
    return sorted(pid for pid, (_, sid, state) in table.items()
                  if sid in sessions and state not in "ZX" and pid != os.getpid())


def wait_until(predicate, timeout: float = 120, every: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def wait_for_run(proc: subprocess.Popen, predicate, timeout: float = 120) -> None:
    """Wait until `predicate()` holds while the launch runs; fail with its output if it ended first."""
    if not wait_until(lambda: predicate() or proc.poll() is not None, timeout):
        raise AssertionError(f"timed out after {timeout} s waiting for the run")
    if not predicate():
        out, err = proc.communicate()
        raise AssertionError(f"the launch ended (status {proc.returncode}) before it got there:\n{err[-3000:]}")


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def signal_all(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids` (as Slurm signals every process of a step); gone ones are skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_run(proc: subprocess.Popen) -> None:
    """Test cleanup: SIGKILL every process of the launch `proc` (processes_of) and its process group."""
    pids = processes_of(proc)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    signal_all(pids, signal.SIGKILL)
    proc.wait()
