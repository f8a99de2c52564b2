"""Per-rank log files, rank-0 console output, and the metrics.jsonl writer."""

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


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (rank 0 only), flushed per record."""

    def __init__(self, path: Path | None) -> None:
        self._file = open(path, "a", encoding="utf-8") if path is not None else None

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
