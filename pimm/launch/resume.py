"""`--train.resume`: continue a run as it was launched.

The run's own resolved config (`<run>/config.py`) and launch facts (`<run>/launch.json`: processes
per node, nodes, restarts) are the defaults (its `debug.*` fault injection is not: that belongs to
one launch); `-- key=value` overrides and explicit --resources
flags apply on top. This module reads the run's records (load_saved_run) and decides (resume_run)
from what the pre-flight measured with the modules that own each fact (pimm.launch.preflight: the
config checked, the train set counted, the two models' parameters compared); it calls none of them
itself. A change that cannot work is refused here, before any process starts:
  - model parameters (names or shapes) that no longer match the checkpoint;
  - optimizer or scheduler settings (their saved state would silently win over the new values), or
    freeze and param_groups (they decide the optimizer's parameter groups);
  - a new length for a schedule whose length is fixed at the start (OneCycleLR, CosineAnnealingLR
    derive it from epochs x steps per epoch; the old length would end or distort the run).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from pimm.checkpoint.layout import newest_resumable
from pimm.config import config_hash, read_run_config
from pimm.errors import ConfigError, LaunchError, PimmError


@dataclass
class SavedRun:
    """What a run directory records: its resolved config, its launch facts, its attempts and its
    newest complete checkpoint."""

    run_dir: Path
    cfg: dict
    launch: dict  # launch.json of the latest launch ({} for runs older than launch.json)
    attempts: list[dict]  # provenance.json's, oldest first
    newest_step: int | None  # the step a resume goes on from (newest_step); None without a checkpoint

    @property
    def config_name(self) -> str:
        return self.launch.get("config") or f"{self.run_dir.parent.name}/{self.run_dir.name}"


def attempts(run_dir: Path) -> list[dict]:
    """The attempts provenance.json records (pimm.provenance), oldest first; [] when it cannot be read."""
    try:
        return json.loads((run_dir / "provenance.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def load_saved_run(run_dir: Path) -> SavedRun:
    """The run's records (reading no checkpoint's weights); LaunchError when `run_dir` is not a pimm run."""
    if not run_dir.is_dir():
        raise LaunchError(
            f"cannot resume: run directory {run_dir} does not exist (looked for {run_dir.absolute()}); "
            "give the run directory (--train.resume exp/<group>/<run>) or check --run.name and --paths.exp-root"
        )
    if not (run_dir / "config.py").is_file():
        raise LaunchError(
            f"cannot resume: {run_dir} has no config.py, so it is not a pimm run directory (or its first "
            "launch failed before it started); start a new run instead"
        )
    try:
        launch = json.loads((run_dir / "launch.json").read_text())
    except (OSError, ValueError):
        launch = {}
    cfg = read_run_config(run_dir / "config.py")
    if isinstance(cfg.get("debug"), dict):  # fault injection belongs to one launch, not to the run
        cfg["debug"] = {key: None for key in cfg["debug"]}
    return SavedRun(run_dir, cfg, launch, attempts(run_dir), newest_step(run_dir))


def newest_step(run_dir: Path) -> int | None:
    """The step a resume of the run goes on from (its newest complete checkpoint, or a newer finished write the
    resume renames first: layout.newest_resumable), None when it has none."""
    newest = newest_resumable(run_dir / "model")
    return newest.step if newest else None


@dataclass(frozen=True)
class TrainSet:
    """A config's train set as the pre-flight checked it (its identity: pimm.launch.plan.check_split),
    or the error that check raised: raised again only where a resume needs the count."""

    identity: dict | None = None
    error: Exception | None = None

    def events(self, cfg: dict) -> int:
        """The events a run of `cfg` trains on per epoch (data.train.max_len applied)."""
        if self.error is not None:
            raise self.error
        events, max_len = self.identity["num_events"], cfg["data"]["train"].get("max_len")
        return min(events, max_len) if max_len else events


@dataclass
class Resume:
    """What a resume compares, gathered in one place: the run as it was saved, the config it
    continues with (the saved one with the overrides, checked by the pre-flight), what changed, and
    whether the run already trained everything that config asks for."""

    saved: SavedRun
    cfg: dict
    changes: dict[str, tuple]
    completed: str | None  # when the run already trained all `cfg` asks for: what to tell, how to train longer


def resume_run(saved: SavedRun, cfg: dict, train_then: TrainSet, train_now: TrainSet,
               parameter_mismatch: str | None, verb: str = "pimm launch") -> Resume:
    """Continue `saved` with `cfg`, or refuse (ConfigError) a change that cannot continue it, from what
    the pre-flight hands over: the train set's events under the run's config (train_then) and under
    `cfg` (train_now), and how the two models' parameters differ (None: they match, or the model is
    unchanged). `verb` is the command the completed message suggests (pimm launch, or pimm submit --site S)."""
    changes = changed_keys(saved.cfg, cfg)
    if changes:
        _refuse_changes(saved, cfg, changes, train_then, train_now, parameter_mismatch)
    done = _completed(saved, cfg, train_now)
    return Resume(saved, cfg, changes, None if done is None else done.message(cfg, saved.config_name, verb))


@dataclass
class CompletedRun:
    """A run that already trained every step its config asks for."""

    run_dir: Path
    step: int  # of its newest complete checkpoint
    total_steps: int
    finished: str | None  # end time of the attempt that completed it
    first_overrides: list[str]  # the overrides of its first launch (debug.* left out)

    def message(self, cfg: dict, config_name: str, verb: str = "pimm launch") -> str:
        """What to tell a person who asked to resume it: nothing to do, and how to train longer."""
        run = self.run_dir
        kept = [o for o in self.first_overrides if o.partition("=")[0] not in ("epochs", "max_steps")]
        fresh = shlex.join([*verb.split(), "--train.config", config_name, "--train.weight", str(run / "model" / "last"),
                            "--", *kept])
        lines = [f"pimm: {run} already completed (step {self.step} of {self.total_steps}"
                 + (f", finished {self.finished}" if self.finished else "") + "); nothing to resume, nothing changed.",
                 "To train longer, start a new run from its weights (the optimizer and schedule start anew):",
                 f"  {fresh} epochs=<N>"]
        if _fixed_length_key(cfg) is None:  # the schedule does not end with the run: it can go on
            longer = "max_steps=<N>" if cfg.get("max_steps") else "epochs=<N>"
            lines += ["or continue this run itself, optimizer state included:",
                      f"  {verb} --train.resume {shlex.quote(str(run))} -- {longer}"]
        return "\n".join(lines)


def completed_run(run_dir: Path, cfg: dict) -> CompletedRun | None:
    """`run_dir`'s end when it already trained every step of `cfg`, the config its last attempt ran
    (a Slurm chain's job asks this of the run's config.py); None when it has something to train."""
    return _completed(SavedRun(run_dir, cfg, {}, attempts(run_dir), newest_step(run_dir)), cfg, None)


def _completed(saved: SavedRun, cfg: dict, train: TrainSet | None) -> CompletedRun | None:
    """The run's end when it already trained every step `cfg` (its config, with any overrides)
    asks for; None when a resume has something to train, or when that cannot be told. Decided from
    what the run directory records, reading no checkpoint: the last attempt in provenance.json ended
    "completed", and the newest complete checkpoint is at or past cfg's total steps (for the config
    that attempt ran, the step it finished at; for another, epochs x steps per epoch of `train`, or
    max_steps; without `train`, that cannot be told)."""
    last = saved.attempts[-1] if saved.attempts else {}
    if last.get("outcome") != "completed" or last.get("validate_only") or saved.newest_step is None:
        return None
    try:
        if last.get("config_hash") == config_hash(cfg) and last.get("final_step") is not None:
            total = int(last["final_step"])
        elif train is not None:
            total = _total_steps(cfg, train)
        else:
            return None
    except (PimmError, OSError, KeyError, TypeError, ValueError):
        return None  # the launch's own checks say what is wrong
    if saved.newest_step < total:
        return None
    overrides = ((saved.attempts[0].get("launch") or {}).get("overrides")) or []
    return CompletedRun(saved.run_dir, saved.newest_step, total, last.get("end_time"),
                        [o for o in overrides if not o.startswith("debug.")])


def _total_steps(cfg: dict, train: TrainSet) -> int:
    """Optimizer steps a run of `cfg` trains: every epoch, or max_steps when that is fewer (as the trainer counts)."""
    steps = _epochs_steps(cfg, train)
    return min(steps, int(cfg["max_steps"])) if cfg.get("max_steps") else steps


def _epochs_steps(cfg: dict, train: TrainSet) -> int:
    """epochs x steps per epoch of a run of `cfg` whose train set `train` counted."""
    return int(cfg["epochs"]) * (train.events(cfg) // int(cfg["batch_size"]))


def leaf_values(cfg: dict, prefix: str = "") -> dict:
    """dotted key -> value for every non-dict value of a nested config."""
    out: dict = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(leaf_values(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(saved: dict, cfg: dict) -> dict[str, tuple]:
    """dotted key -> (value in the run, value now) for every key that differs."""
    old, new = leaf_values(saved), leaf_values(cfg)
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def _refuse_changes(saved: SavedRun, cfg: dict, changes: dict[str, tuple], train_then: TrainSet,
                    train_now: TrainSet, parameter_mismatch: str | None) -> None:
    """Refuse (ConfigError) a resume whose config cannot continue the run."""
    restart_hint = (
        f"or start a new run from this one's weights: pimm launch --train.config {saved.config_name} "
        f"--train.weight {saved.run_dir / 'model' / 'last'} -- <key>=<value>"
    )
    for key, (old, new) in changes.items():
        if key.split(".")[0] in ("optimizer", "scheduler"):
            raise ConfigError(
                f"{key}: {old!r} in the run, {new!r} now: a resume restores the saved {key.split('.')[0]} state, "
                f"so this change would not take effect; resume without it, {restart_hint}"
            )
    if "task.best_metric" in changes and (changes["task.best_metric"][0] or "miou") != changes["task.best_metric"][1]:
        old, new = changes["task.best_metric"]
        raise ConfigError(
            f"task.best_metric: {old or 'miou'!r} in the run, {new!r} now: the run's best value so far is of "
            f"{old or 'miou'}, so model_best.pth could not be compared; resume without it, {restart_hint}"
        )
    for key in ("freeze", "param_groups"):
        if key in changes:
            old, new = changes[key]
            raise ConfigError(
                f"{key}: {old!r} in the run, {new!r} now: the saved optimizer state holds the run's parameter "
                f"groups ({key} decides them), so it would not load into the new ones; resume without it, "
                f"{restart_hint}"
            )
    model_keys = [k for k in changes if k.split(".")[0] == "model" or k == "data.num_classes"]
    if model_keys and parameter_mismatch:
        key = model_keys[0]
        old, new = changes[key]
        raise ConfigError(
            f"{key}: {old!r} in the run, {new!r} now: the model's parameters no longer match the "
            f"checkpoint ({parameter_mismatch}); resume without it, {restart_hint}"
        )
    _check_schedule_length(saved, cfg, changes, train_then, train_now, restart_hint)


def _fixed_length_key(cfg: dict) -> str | None:
    """The scheduler key whose length is fixed from epochs x steps per epoch when the run starts
    (OneCycleLR's total_steps, CosineAnnealingLR's T_max, left unset); None for any other schedule."""
    scheduler = cfg.get("scheduler")
    if not scheduler:
        return None
    from pimm.engine.optim import SCHEDULE_LENGTH_KEY  # deferred: imports torch; only runs with a schedule ask

    length_key = SCHEDULE_LENGTH_KEY.get(scheduler.get("type"))
    return length_key if length_key is not None and scheduler.get(length_key) is None else None


def _check_schedule_length(saved: SavedRun, cfg: dict, changes: dict, train_then: TrainSet, train_now: TrainSet,
                           restart_hint: str) -> None:
    length_inputs = [k for k in changes if k in ("epochs", "batch_size", "data.train.path", "data.train.max_len",
                                                 "data.train.split", "data.train.min_points",
                                                 "data.train.energy_threshold",
                                                 "data.train.remove_low_energy_scatters",
                                                 "data.train.skip_nonfinite")]
    length_key = _fixed_length_key(cfg)
    if not length_inputs or length_key is None:
        return  # the schedule's length does not depend on the run's length
    scheduler = cfg["scheduler"]
    before, after = _epochs_steps(saved.cfg, train_then), _epochs_steps(cfg, train_now)
    if before != after:
        key = length_inputs[0]
        old, new = changes[key]
        raise ConfigError(
            f"{key}: {old!r} in the run, {new!r} now: this changes the length of the run's {scheduler['type']} "
            f"schedule ({length_key} {before} -> {after} steps), which is fixed when the run starts; the saved "
            f"schedule would end or be distorted at the old length. Resume without it (max_steps can stop "
            f"earlier), {restart_hint}"
        )


def continue_command(run_dir: Path, nproc_per_node: int, nnodes: int, max_restarts: int) -> str:
    """The exact command that continues `run_dir` as it was launched."""
    argv = ["pimm", "launch", "--train.resume", str(run_dir), "--resources.nproc-per-node", str(nproc_per_node)]
    if nnodes != 1:
        argv += ["--resources.nnodes", str(nnodes)]
    if max_restarts:
        argv += ["--resources.max-restarts", str(max_restarts)]
    return shlex.join(argv)
