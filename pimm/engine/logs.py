"""Per-rank log files, rank-0 console output, and the metrics writer (metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import json
import logging
import math
import sys
import uuid
from pathlib import Path

from pimm.json_io import dumps

FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(log_dir: Path, rank: int) -> logging.Logger:
    """Every rank logs everything to `log_dir/rank{rank}.log` and prints warnings and errors to
    stderr; rank 0 also prints its INFO lines (progress, validation) to stdout."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("pimm")
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    rank_filter = _RankFilter(rank)
    file_handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    file_handler.setFormatter(logging.Formatter(FORMAT))
    handlers: list[logging.Handler] = [file_handler]
    problems = logging.StreamHandler(sys.stderr)
    problems.setLevel(logging.WARNING)
    problems.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(message)s"))
    handlers.append(problems)
    if rank == 0:
        progress = logging.StreamHandler(sys.stdout)
        progress.setLevel(logging.INFO)
        progress.addFilter(lambda record: record.levelno < logging.WARNING)
        progress.setFormatter(logging.Formatter("%(message)s"))
        handlers.append(progress)
    for handler in handlers:
        handler.addFilter(rank_filter)
        logger.addHandler(handler)
    return logger


SCALAR_KEYS = {"train": ("loss", "lr", "events_per_s"),
               "val": ("loss", "miou", "macc", "allacc", "accuracy",  # SemanticSegmentation
                       "ari_all_labelled", "ari_predicted_things", "ami_all_labelled", "pq", "purity", "efficiency",
                       "detection_f1", "matched_iou", "pid_f1")}  # Panoptic
PER_CLASS_KEYS = ("iou", "precision", "recall", "f1")  # lists of one value per class in a val record


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def record_scalars(record: dict, class_names: list[str] | None = None) -> dict[str, float]:
    """The numbers of one metrics record by scalar name: `<kind>/<key>` (`train/loss`, `val/miou`)
    and one `val/<metric>/<class name>` per class and per-class metric (`val/iou/track`,
    `val/f1/shower`). Values that are not finite numbers (metrics.jsonl holds them as null: a
    class with no points, a diverged loss) are left out. Both scalar sinks name their curves with this."""
    kind = record["kind"]
    out = {f"{kind}/{key}": record[key] for key in SCALAR_KEYS.get(kind, ()) if _finite(record.get(key))}
    for metric in PER_CLASS_KEYS:
        for i, value in enumerate(record.get(metric) or ()):
            if _finite(value):
                name = class_names[i] if class_names and i < len(class_names) else str(i)
                out[f"{kind}/{metric}/{name}"] = value
    return out


class TensorBoardScalars:
    """The numbers of each metrics record as TensorBoard scalars at the record's step
    (`record_scalars`), in `log_dir`.

    A resumed attempt appends a new event file to the same directory, starting with a purge marker
    at the first step it redoes: readers then drop the earlier files' events at or after that step,
    so the curves continue without duplicated steps."""

    def __init__(self, log_dir: Path, class_names: list[str] | None = None) -> None:
        self.log_dir = log_dir
        self.class_names = class_names
        self._writer = None

    def open(self, first_step: int | None = None) -> None:
        """Start this attempt's event file; `first_step`: hide earlier events at steps >= it."""
        from torch.utils.tensorboard import SummaryWriter  # deferred: an optional package, for tensorboard.enabled

        self.close()
        self._writer = SummaryWriter(str(self.log_dir), purge_step=first_step)

    def write(self, record: dict) -> None:
        if self._writer is None:
            self.open()
        for name, value in record_scalars(record, self.class_names).items():
            self._writer.add_scalar(name, value, record["step"])
        self._writer.flush()  # like metrics.jsonl: a killed run keeps every record written so far

    def close(self, exit_code: int = 0) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbScalars:
    """The numbers of each metrics record logged to Weights & Biases in offline mode
    (`record_scalars`, at `step=` the record's optimizer step), under `run_dir/wandb/`.

    One W&B run per attempt, all in one W&B group (`wandb.group`, default the pimm run's name),
    named `<run>-attempt-<k>`: each attempt logs the steps it trains, from its checkpoint on, so
    after a kill the steps between the checkpoint and the kill are in two attempts (an exact
    resume gives them the same numbers). A resumed W&B run would have to log steps below the ones
    it already holds, which W&B does not allow. wandb-core writes its file every
    FLUSH_INTERVAL_S: a SIGKILLed rank loses at most that much of W&B's copy (metrics.jsonl keeps
    every record).

    wandb-core (W&B's service process) runs in a session of its own, so signals to the job's
    process group miss it; it ignores SIGUSR1 and exits with its parent. A SIGTERM sent to it
    directly (Slurm's scancel and time limit signal every process of a step) ends it: the sink
    then fails. A failure of W&B warns once and turns the sink off: it never stops training
    (metrics.jsonl keeps every record)."""

    FLUSH_INTERVAL_S = 2.0

    def __init__(self, run_dir: Path, options: dict, config: dict, class_names: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.options = options
        self.config = config
        self.class_names = class_names
        self._run = None
        self._failed = False

    def _fail(self, what: str, exc: BaseException) -> None:
        self._failed, self._run = True, None
        logging.getLogger("pimm").warning("W&B %s failed (%s: %s); W&B logging is off for this attempt, "
                                          "metrics.jsonl has every record", what, type(exc).__name__, exc)

    def open(self, first_step: int | None = None) -> None:
        """Start this attempt's W&B run (its first record is at `first_step` or later)."""
        if self._run is not None or self._failed:
            return
        try:
            import wandb  # deferred: an optional package, for wandb.enabled

            attempt = len(list((self.run_dir / "wandb").glob("offline-run-*"))) + 1
            self._run = wandb.init(
                mode="offline", dir=str(self.run_dir), id=uuid.uuid4().hex[:12],
                project=self.options.get("project") or "pimm", entity=self.options.get("entity"),
                group=self.options.get("group") or self.run_dir.name, name=f"{self.run_dir.name}-attempt-{attempt}",
                tags=self.options.get("tags"), job_type="train", config=self.config,
                settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False,
                                        x_disable_stats=not self.options.get("system_metrics", True),
                                        x_transaction_log_flush_interval=self.FLUSH_INTERVAL_S),
            )
        except Exception as exc:  # monitoring must not end a training run
            self._fail("init", exc)

    def write(self, record: dict) -> None:
        self.open()
        if self._run is None:
            return
        try:
            self._run.log(record_scalars(record, self.class_names), step=int(record["step"]))
        except Exception as exc:
            self._fail("log", exc)

    def close(self, exit_code: int = 0) -> None:
        if self._run is not None:
            try:
                self._run.finish(exit_code=exit_code)
            except Exception as exc:
                self._fail("finish", exc)
            self._run = None


class MetricsWriter:
    """The one writer of metrics records (rank 0 only): one JSON object per line appended to
    metrics.jsonl, flushed per record (a non-finite number as null: standard JSON), and the same
    numbers to optional scalar sinks (TensorBoardScalars, WandbScalars)."""

    def __init__(self, path: Path | None, sinks: list | None = None) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8") if path is not None else None
        self._sinks = list(sinks or ())

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(dumps(record) + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.write(record)

    def continue_after(self, step: int) -> None:
        """A resumed attempt redoes the steps after `step`: drop the earlier attempts' records of
        those steps, so the records read as one run (TensorBoard's event files cannot be rewritten:
        the new one starts with a purge marker at step + 1)."""
        if self.path is not None and self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            # in place, not renamed over: the append handle opened at the start writes on into this file
            self.path.write_text("".join(ln + "\n" for ln in keep))
        for sink in self._sinks:
            sink.open(first_step=step + 1)

    def close(self, exit_code: int = 0) -> None:
        """Close the file and the sinks; `exit_code` is the attempt's (75: interrupted, 1: failed)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close(exit_code)
        self._sinks = []
