"""The launch description: one object that `pimm launch` turns into a torchrun command and that
`pimm submit` renders into a Slurm script (pimm.launch.sbatch), whose node agents read it back
from the run directory (plan_from_run). It names the phases a launch runs: training (or the one
validation of validate_only), then the test of the best model on data.test (test_after_training),
which the node agent runs (pimm.launch.node, pimm.launch.evaluate)."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pimm.config import read_run_config
from pimm.config.validate import check_schedule_length
from pimm.data.event_file import validate_data
from pimm.distributed.batch import BatchPlan, plan_batches
from pimm.errors import LaunchError

TRAIN_PHASE, VALIDATE_PHASE, TEST_PHASE = "train", "validate", "test"


def phases_of(cfg: dict) -> tuple[str, ...]:
    """What a launch of `cfg` runs, in order: train (validate for validate_only), then test: `pimm test`
    of the best model on data.test, when the config has one and test_after_training (the default)."""
    if cfg.get("validate_only"):
        return (VALIDATE_PHASE,)
    if cfg["data"].get("test") and cfg.get("test_after_training", True):
        return (TRAIN_PHASE, TEST_PHASE)
    return (TRAIN_PHASE,)


@dataclass
class LaunchPlan:
    """Everything decided before any process starts."""

    config_name: str
    config_path: Path
    cfg: dict
    nnodes: int
    nproc_per_node: int
    device_type: str  # "cuda" or "cpu"
    run_dir: Path
    batches: BatchPlan
    rdzv_endpoint: str | None = None
    node_rank: int | None = None
    max_restarts: int = 0
    overrides: list[str] = field(default_factory=list)
    resume: bool = False
    weight: str | None = None
    rdzv_id: str | None = None  # default: the run directory's name
    phases: tuple[str, ...] = (TRAIN_PHASE,)
    data: dict[str, dict] = field(default_factory=dict)  # split -> the checked data's identity (prepare)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def torchrun_argv(self, python: str | None = None) -> list[str]:
        """The exact torchrun command: this interpreter (so the same environment) running
        `pimm.launch.torchrun`, which is torch.distributed.run with a one-line failure summary."""
        argv = [python or sys.executable, "-m", "pimm.launch.torchrun"]
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            argv.append("--standalone")  # c10d rendezvous on a free local port
        else:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", str(self.rdzv_endpoint)]
            argv += ["--rdzv-id", self.rdzv_id or self.run_dir.name]
            if self.node_rank is not None:
                argv += ["--node-rank", str(self.node_rank)]
        argv += ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node)]
        argv += ["--max-restarts", str(self.max_restarts)]
        argv += ["-m", "pimm.engine.worker", "--run-dir", str(self.run_dir)]
        if self.resume:
            argv.append("--resume")
        if self.weight:
            argv += ["--weight", str(self.weight)]
        return argv

    def describe(self, dry_run: bool = False) -> str:
        """What the launch will run, for people; dry_run: also the `pimm launch` line that runs it."""
        b = self.batches
        val_note = " (batch_size_val=None: one event per rank)" if self.cfg.get("batch_size_val") is None else ""
        lines = [
            "torchrun command:",
            "  " + shlex.join(self.torchrun_argv()),
            *(["to run this plan, paste this line (in this directory):",
               "  " + shlex.join(self.launch_argv())] if dry_run else []),
            f"world size: {self.world_size} ({self.nnodes} node(s) x {self.nproc_per_node} process(es), "
            f"{self.device_type}/{self.backend})",
            f"per rank: batch_size {b.events_per_rank} events (global {b.global_batch_size}) = {b.grad_accum_steps} "
            f"micro-batch(es) of {b.micro_batch_per_rank} (grad_accum_steps {b.grad_accum_steps}), "
            f"batch_size_val {b.val_events_per_rank} (global {b.global_batch_size_val}){val_note}, "
            f"batch_size_test {b.test_events_per_rank} (global {b.global_batch_size_test}), "
            f"num_worker {b.workers_per_rank} (global {b.global_workers})",
            f"run directory: {self.run_dir}",
        ]
        if TEST_PHASE in self.phases:
            lines.append(f"then: pimm test of model_best (last without one) on data.test into {self.run_dir / 'eval'}/ "
                         "(test_after_training)")
        return "\n".join(lines)

    def launch_argv(self) -> list[str]:
        """The `pimm launch` command line that makes this same plan again (in the same directory and
        environment): every choice spelled out, the run directory by its exact name."""
        argv = ["pimm", "launch"]
        if self.resume:
            argv += ["--train.resume", str(self.run_dir)]
        else:
            argv += ["--train.config", self.config_name, "--run.name", self.run_dir.name, "--run.no-timestamp",
                     "--paths.exp-root", str(self.run_dir.parent.parent)]
        argv += ["--resources.nproc-per-node", str(self.nproc_per_node), "--resources.nnodes", str(self.nnodes),
                 "--resources.max-restarts", str(self.max_restarts)]
        if self.rdzv_endpoint is not None:
            argv += ["--resources.rdzv-endpoint", self.rdzv_endpoint]
        if self.node_rank is not None:
            argv += ["--resources.node-rank", str(self.node_rank)]
        if self.weight:
            argv += ["--train.weight", self.weight]
        return argv + (["--", *self.overrides] if self.overrides else [])


def visible_gpus() -> int:
    """GPUs this process may use; without an NVIDIA driver, 0 without paying for a torch import."""
    if not Path("/proc/driver/nvidia").exists() and not os.environ.get("PIMM_PROBE_GPUS"):
        return 0
    import torch  # deferred: seconds to import; only on a machine with an NVIDIA driver

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(requested: str, gpus: int) -> int:
    """`auto` = all visible GPUs (1 without GPUs); a number is checked against the GPUs present."""
    if requested == "auto":
        return max(gpus, 1)
    try:
        nproc = int(requested)
    except ValueError:
        raise LaunchError(
            f"--resources.nproc-per-node must be a positive integer or 'auto', got {requested!r}"
        ) from None
    if nproc < 1:
        raise LaunchError(f"--resources.nproc-per-node must be >= 1, got {nproc}")
    if gpus and nproc > gpus:
        raise LaunchError(
            f"--resources.nproc-per-node {nproc} asks for more processes than the {gpus} visible GPU(s); "
            f"pimm runs one process per GPU. Use --resources.nproc-per-node {gpus} (or auto)."
        )
    return nproc


_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def check_run_name(name: str, what: str = "--run.name") -> str:
    """A run (or group) name is one path component: letters, digits, '.', '_', '+', '-', not
    starting with '.' (so never '.', '..' or a hidden folder) and at most 200 characters."""
    if len(name) > 200:  # with the timestamp, still under the file systems' 255-byte limit of a name
        raise LaunchError(f"{what} is {len(name)} characters long ({name[:40]!r}...); a run name has at most 200: "
                          "give a shorter --run.name")
    if not _SAFE_NAME.fullmatch(name):
        raise LaunchError(
            f"{what} {name!r:.120} is not allowed: a run name is one folder name of letters, digits and . _ + - "
            "(not starting with '.', no '/'), e.g. --run.name pilarnet-ptv3-lr3e-3; the run directory is always "
            "<--paths.exp-root>/<group>/<name>"
        )
    return name


def run_directory(
    exp_root: Path, config_name: str, run_name: str | None, timestamp: bool, job_tag: str | None = None
) -> Path:
    """exp/<group>/<run>: group from the config's folder, run from --run.name or the config's name,
    suffixed (unless timestamp is False) with the Slurm job step (job_tag: the same on every node)
    or else the time. Both are single safe folder names, so the run stays inside exp_root."""
    parts = Path(config_name).with_suffix("").parts
    group = parts[-2] if len(parts) > 1 and _SAFE_NAME.fullmatch(parts[-2]) else "default"
    if run_name is not None:
        name = check_run_name(run_name)
    else:
        name = check_run_name(parts[-1] if parts else "", "the config's name (the default run name)")
    if timestamp:
        name = f"{name}-{job_tag or time.strftime('%Y%m%d-%H%M%S')}"
    return exp_root / group / name


def make_plan(
    config_name: str,
    config_path: Path,
    cfg: dict,
    nproc_per_node: str,
    nnodes: int,
    run_dir: Path,
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
    max_restarts: int = 0,
    overrides: list[str] | None = None,
    resume: bool = False,
    weight: str | None = None,
    gpus: int | None = None,
    rdzv_id: str | None = None,
) -> LaunchPlan:
    """Check the resources against the machine and the config; raise before anything starts.
    gpus: the GPUs per node where the processes will run (None: the ones visible here)."""
    if nnodes < 1:
        raise LaunchError(f"--resources.nnodes must be >= 1, got {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError(
            f"--resources.nnodes {nnodes} needs --resources.rdzv-endpoint HOST:PORT (a host every node "
            "reaches), or use `pimm submit` to run under Slurm"
        )
    if resume and weight:
        raise LaunchError("--train.resume and --train.weight exclude each other: resume continues a run, "
                          "weight starts a new one from weights only")
    if max_restarts < 0:
        raise LaunchError(f"--resources.max-restarts must be >= 0, got {max_restarts}")
    gpus = visible_gpus() if gpus is None else gpus
    nproc = resolve_nproc(nproc_per_node, gpus)
    phases = phases_of(cfg)
    batches = plan_batches(cfg, nnodes * nproc)
    return LaunchPlan(
        config_name=config_name,
        config_path=config_path,
        cfg=cfg,
        nnodes=nnodes,
        nproc_per_node=nproc,
        device_type="cuda" if gpus else "cpu",
        run_dir=run_dir,
        batches=batches,
        rdzv_endpoint=rdzv_endpoint,
        node_rank=node_rank,
        max_restarts=max_restarts,
        overrides=list(overrides or []),
        resume=resume,
        weight=weight,
        rdzv_id=rdzv_id,
        phases=phases,
    )


def data_files(cfg: dict) -> dict[str, str]:
    """split -> data path as configured (a relative path is relative to the current directory)."""
    return {split: cfg["data"][split]["path"] for split in ("train", "val", "test") if cfg["data"].get(split)}


def check_split(cfg: dict, split: str) -> dict:
    """data.<split> is valid for its type (a pimm event file, or PILArNet-M shards) with labels in
    0..data.num_classes-1 or task.ignore_index; returns its identity (pimm.data.event_file.validate_data)."""
    return validate_data(cfg["data"][split], num_classes=cfg["data"]["num_classes"],
                         ignore_index=(cfg.get("task") or {}).get("ignore_index", -1))


def check_data(cfg: dict, global_batch: int, checked: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every data set passes check_split and the train set fills one global batch; returns split ->
    the data's identity. checked: split -> identity of a split the pre-flight already checked."""
    identities = {}
    for split in data_files(cfg):
        info = identities[split] = (checked or {}).get(split) or check_split(cfg, split)
        if split == "train":
            max_len = cfg["data"]["train"].get("max_len")
            events = min(info["num_events"], max_len) if max_len else info["num_events"]
            if events < global_batch:
                raise LaunchError(
                    f"data.train has {events} events, fewer than one global batch (batch_size={global_batch}); "
                    "use more events or a smaller batch_size"
                )
            # the schedule spans every epoch (max_steps only stops early): its length is known now
            check_schedule_length(cfg.get("scheduler"), events // global_batch * int(cfg["epochs"]))
    return identities


def plan_from_run(run_dir: Path, rdzv_endpoint: str, rdzv_id: str, resume: bool) -> LaunchPlan:
    """The plan a node agent runs: the run's own config.py and launch.json as the submitting host
    wrote them, checked again against the GPUs of this node; resume decided by node 0."""
    try:
        launch = json.loads((run_dir / "launch.json").read_text())
        cfg = read_run_config(run_dir / "config.py")
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{run_dir} is not a prepared run directory (config.py, launch.json): {exc}") from None
    return make_plan(
        launch["config"], Path(launch["config_path"]), cfg, str(launch["nproc_per_node"]), int(launch["nnodes"]),
        run_dir, rdzv_endpoint=rdzv_endpoint, max_restarts=int(launch.get("max_restarts", 0)),
        overrides=launch.get("overrides"), resume=resume, weight=None if resume else launch.get("weight"),
        rdzv_id=rdzv_id,
    )
