"""`pimm predict --weights RUN|EXPORT --data PATH`: a model's per-point predictions on data without labels.

The checks, the held weights and the ranks are pimm.launch.predict's: this module reads the flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path("predictions.h5")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "predict", help="write a model's per-point predictions on data without labels",
        description="Predict every point's class of a pimm event file (with or without labels) or of PILArNet-M "
        "shards with the weights of a run (--checkpoint, default best, else last) or of a `pimm export` directory, "
        "on N processes (every event once). Writes one predictions file (the `pimm test --save-predictions` format, "
        "without labels) with the weights' sha256, the data's identity and the world size in its provenance.",
        usage="pimm predict --weights RUN|EXPORT_DIR --data PATH [options]",
    )
    p.add_argument("--weights", type=Path, required=True, metavar="RUN|EXPORT_DIR",
                   help="a run directory (config.py, model/) or a directory written by `pimm export`")
    p.add_argument("--data", type=Path, required=True, metavar="PATH",
                   help="a pimm event file (.h5), or PILArNet-M shards (one .h5 shard or a directory)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="FILE.h5",
                   help=f"the predictions file to write, never overwritten (default ./{DEFAULT_OUT})")
    p.add_argument("--split", default=None, metavar="S",
                   help="PILArNet-M directories: the split whose shards to read (default: the reader's, train)")
    p.add_argument("--checkpoint", default=None, metavar="best|last|step_N",
                   help="with a run directory: best (default; last when the run has no model_best.pth), last, step_N")
    p.add_argument("--resources.nproc-per-node", dest="nproc_per_node", default="1", metavar="N|auto",
                   help="processes: one per GPU, or N CPU processes with gloo (default 1)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=1, metavar="B",
                   help="events per process in one forward (default 1)")
    p.add_argument("--save-scores", action="store_true",
                   help="also every point's softmax scores (float16, one per class)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # deferred: the weight and data checks import torch and h5py, which `pimm --help` does without
    from pimm.launch.predict import PredictRequest, run_predict

    return run_predict(PredictRequest(args.weights, args.data, args.out, args.split, args.checkpoint,
                                      str(args.nproc_per_node), args.batch_size, args.save_scores))
