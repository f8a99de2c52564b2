"""`pimm test --run-dir RUN`: evaluate a run's weights on its test (or val) split, on N processes.

The checks, the held weights, the evaluation directory and the ranks are pimm.launch.evaluate's:
this module reads the flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "test", help="evaluate a run's weights on its test split (metrics, confusion, predictions)",
        description="Evaluate a checkpoint of a run on data.test (or data.val) on N processes: every event once, "
        "the same metrics at any number of processes. Writes test_metrics.json/.csv, confusion.json/.png and "
        "provenance.json (and predictions.h5 with --save-predictions) into RUN/eval/<split>-<checkpoint>. "
        "Everything after a bare `--` is a key=value override of the run's config, e.g. "
        '`-- "data.test={type: LArTPCDataset, path: test.h5}"`.',
        usage="pimm test --run-dir RUN [options] [-- key=value ...]",
    )
    p.add_argument("--run-dir", dest="run_dir", type=Path, required=True, metavar="RUN",
                   help="the run directory (with config.py and model/)")
    p.add_argument("--checkpoint", default=None, metavar="best|last|step_N",
                   help="best (default; last when the run has no model/model_best.pth), last, or step_N")
    p.add_argument("--split", default="test", choices=("test", "val"), help="the data split (default test)")
    p.add_argument("--resources.nproc-per-node", dest="nproc_per_node", default="1", metavar="N|auto",
                   help="processes: one per GPU, or N CPU processes with gloo (default 1)")
    p.add_argument("--out", type=Path, metavar="DIR", help="where to write (default RUN/eval/<split>-<checkpoint>)")
    p.add_argument("--save-predictions", action="store_true",
                   help="also write OUT/predictions.h5: every point's predicted class, truth, coordinates")
    p.add_argument("--save-scores", action="store_true",
                   help="with --save-predictions: also every point's softmax scores (float16, one per class)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # deferred: the data and weight checks import h5py and torch, which `pimm --help` does without
    from pimm.launch.evaluate import prepare_test, run_test

    return run_test(prepare_test(args.run_dir, args.split, args.checkpoint, str(args.nproc_per_node), args.out,
                                 args.save_predictions, args.save_scores, args.overrides))
