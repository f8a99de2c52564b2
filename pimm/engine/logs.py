"""Per-rank log files, rank-0 console output, and the metrics writer (metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

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


class TensorBoardScalars:
    """The numbers of each metrics record as TensorBoard scalars at the record's step, under
    `<kind>/<key>` (`train/loss`, `val/miou`, one `val/iou/<class name>` per class), in `log_dir`.

    A resumed attempt appends a new event file to the same directory, starting with a purge marker
    at the first step it redoes: readers then drop the earlier files' events at or after that step,
    so the curves continue without duplicated steps."""

    KEYS = {"train": ("loss", "lr", "events_per_s"), "val": ("loss", "miou", "accuracy")}

    def __init__(self, log_dir: Path, class_names: list[str] | None = None) -> None:
        self.log_dir = log_dir
        self.class_names = class_names
        self._writer = None

    def open(self, purge_step: int | None = None) -> None:
        """Start this attempt's event file; `purge_step`: hide earlier events at steps >= it."""
        from torch.utils.tensorboard import SummaryWriter

        self.close()
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        if self._writer is None:
            self.open()
        kind, step = record["kind"], record["step"]
        for key in self.KEYS.get(kind, ()):
            if key in record:
                self._writer.add_scalar(f"{kind}/{key}", record[key], step)
        for i, iou in enumerate(record.get("iou") or ()):
            name = self.class_names[i] if self.class_names and i < len(self.class_names) else str(i)
            self._writer.add_scalar(f"{kind}/iou/{name}", iou, step)
        self._writer.flush()  # like metrics.jsonl: a killed run keeps every record written so far

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MetricsWriter:
    """The one writer of metrics records (rank 0 only): one JSON object per line appended to
    metrics.jsonl, flushed per record, and the same numbers to an optional TensorBoard sink."""

    def __init__(self, path: Path | None, tensorboard: TensorBoardScalars | None = None) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8") if path is not None else None
        self._tensorboard = tensorboard

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def continue_after(self, step: int) -> None:
        """A resumed attempt redoes the steps after `step`: drop the earlier attempts' records of
        those steps, so the records read as one run (TensorBoard's event files cannot be rewritten:
        the new one starts with a purge marker at step + 1)."""
        if self.path is not None and self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        if self._tensorboard is not None:
            self._tensorboard.open(purge_step=step + 1)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
