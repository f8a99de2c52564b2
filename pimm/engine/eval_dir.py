"""The evaluation directory: what the launcher of `pimm test` / `pimm predict` writes into it
(pimm.launch.evaluate) and what the ranks (pimm.engine.evaluation) read and write there.

    eval.json          the spec: split, weights (the held file and where it came from), flags
    config.py          the run's resolved config with the evaluation's overrides (`pimm test`)
    .weights.pth       the weights held for the ranks (pimm.checkpoint.choose.hold_weights); removed after
    test_metrics.json  written last by rank 0: its presence marks a finished evaluation
    test_metrics.csv, confusion.json, confusion.png, provenance.json, predictions.h5, logs/, errors/

`pimm predict` uses a hidden directory of this layout beside its output file.
"""

from __future__ import annotations

import json
from pathlib import Path

from pimm.files import write_atomic
from pimm.json_io import dumps

EVAL_SPEC = "eval.json"
METRICS_FILE = "test_metrics.json"
PREDICTIONS_FILE = "predictions.h5"
HELD_WEIGHTS = ".weights.pth"


def finished(eval_dir: Path) -> bool:
    """An evaluation finished in `eval_dir` (its results are never overwritten)."""
    return (eval_dir / METRICS_FILE).exists()


def read_metrics(eval_dir: Path) -> dict:
    return json.loads((eval_dir / METRICS_FILE).read_text())


def write_spec(eval_dir: Path, spec: dict) -> None:
    write_atomic(eval_dir / EVAL_SPEC, dumps(spec, indent=2) + "\n")


def read_spec(eval_dir: Path) -> dict:
    return json.loads((eval_dir / EVAL_SPEC).read_text())
