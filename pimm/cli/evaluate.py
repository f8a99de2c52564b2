"""`pimm test --run-dir RUN`: evaluate a run's weights on its test (or val) split, on N processes.

The launcher checks everything it can before a process starts (config, the split's data, the
weights), writes OUT/eval.json and OUT/config.py, then runs torchrun with
`python -m pimm.engine.evaluation --eval-dir OUT` (pimm.engine.evaluation writes the results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pimm.errors import PimmError


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


def _split_config(cfg: dict, split: str) -> None:
    """PimmError when data.<split> is not set, naming the override that sets it."""
    if not cfg["data"].get(split):
        raise PimmError(f"the run's config has no data.{split} (it is {cfg['data'].get(split)!r}); give the data to "
                        f'evaluate: -- "data.{split}={{type: LArTPCDataset, path: FILE.h5}}"')


def prepare(args: argparse.Namespace) -> tuple[dict, dict, Path]:
    """Check everything before a process starts -> (config, eval spec, output directory)."""
    from pimm.checkpoint.choose import choose_weights
    from pimm.checkpoint.layout import sha256_file
    from pimm.config import apply_overrides, load_config, parse_overrides
    from pimm.config.validate import check_config
    from pimm.data.event_file import validate_data
    from pimm.distributed.batch import plan_batches
    from pimm.launch.plan import resolve_nproc, visible_gpus

    run_dir: Path = args.run_dir
    if not (run_dir / "config.py").is_file():
        raise PimmError(f"--run-dir {run_dir}: {'no config.py in it' if run_dir.is_dir() else 'does not exist'}; "
                        "give the directory of a pimm run (it holds config.py and model/)")
    cfg = apply_overrides(load_config(run_dir / "config.py"), parse_overrides(args.overrides))
    cfg["validate_only"] = False
    check_config(cfg)
    _split_config(cfg, args.split)
    nproc = resolve_nproc(str(args.nproc_per_node), visible_gpus())
    plan_batches({**cfg, "batch_size": nproc, "grad_accum_steps": 1, "batch_size_val": None}, nproc)
    if args.save_scores and not args.save_predictions:
        raise PimmError("--save-scores adds the scores to the predictions file: give --save-predictions too")
    which = args.checkpoint
    if which is None:
        which = "best" if (run_dir / "model" / "model_best.pth").is_file() else "last"
    weights, step = choose_weights(run_dir, which)
    out = args.out or run_dir / "eval" / f"{args.split}-{which}"
    if (out / "test_metrics.json").exists():
        raise PimmError(f"{out} already holds a finished evaluation (test_metrics.json); results are never "
                        "overwritten: give another directory with --out DIR")
    if (cfg.get("parallel") or {}).get("strategy") == "fsdp2" and nproc > 1:
        from pimm.distributed.strategy import check_strategy_fits

        check_strategy_fits(cfg)
    from pimm.checkpoint.weights import check_weights_fit

    check_weights_fit(weights, cfg["model"])
    data = validate_data(cfg["data"][args.split], num_classes=cfg["data"]["num_classes"],
                         ignore_index=(cfg.get("task") or {}).get("ignore_index", -1))
    spec = {
        "run_dir": str(run_dir.resolve()), "split": args.split, "checkpoint": which, "step": step,
        "weights": str(Path(weights).resolve()), "weights_sha256": sha256_file(weights),
        "save_predictions": bool(args.save_predictions), "save_scores": bool(args.save_scores),
        "nproc_per_node": nproc, "overrides": list(args.overrides), "num_events": data["num_events"],
    }
    return cfg, spec, out


def torchrun_argv(out: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "pimm.launch.torchrun", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", "0", "-m", "pimm.engine.evaluation",
            "--eval-dir", str(out)]


def run(args: argparse.Namespace) -> int:
    import shutil

    from pimm.config import dump_config
    from pimm.engine.evaluation import EVAL_SPEC, METRICS_FILE, write_atomic
    from pimm.json_io import dumps
    from pimm.launch.node import run_torchrun

    cfg, spec, out = prepare(args)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("errors", "logs"):  # of an earlier evaluation into this directory that did not finish
        shutil.rmtree(out / stale, ignore_errors=True)
    dump_config(cfg, out / "config.py")
    write_atomic(out / EVAL_SPEC, dumps(spec, indent=2) + "\n")
    print(f"pimm test: {spec['split']} ({spec['num_events']} events) with {spec['checkpoint']} (step {spec['step']}, "
          f"{spec['weights']}) on {spec['nproc_per_node']} process(es) -> {out}", flush=True)
    returncode, _ = run_torchrun(torchrun_argv(out, spec["nproc_per_node"]), None)
    if returncode != 0 or not (out / METRICS_FILE).is_file():
        errors = sorted((out / "errors").glob("rank*.txt"))
        for path in errors:
            print(f"pimm test: {path.stem}: {path.read_text().strip()}", file=sys.stderr)
        if not errors:
            print(f"pimm test: failed (torchrun exit status {returncode}); see {out / 'logs'}", file=sys.stderr)
        return 1
    m = json.loads((out / METRICS_FILE).read_text())

    def num(v) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    print(f"pimm test: mIoU {num(m['miou'])} mAcc {num(m['macc'])} allAcc {num(m['allacc'])} over {m['events']} "
          f"events ({m['points']} points); results in {out}")
    return 0


def test_after_training(run_dir: Path, nproc: int) -> int:
    """The end of a finished run whose config has data.test (and test_after_training, the default):
    `pimm test` of model_best.pth (last without one) on the run's processes; its exit status."""
    print(f"\npimm: testing the run on data.test (test_after_training=true): pimm test --run-dir {run_dir}", flush=True)
    args = argparse.Namespace(run_dir=run_dir, checkpoint=None, split="test", nproc_per_node=str(nproc), out=None,
                              save_predictions=False, save_scores=False, overrides=[])
    try:
        return run(args)
    except PimmError as exc:
        print(f"pimm test: error: {exc}", file=sys.stderr)
        return 1
