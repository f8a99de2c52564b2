"""The launcher side of an evaluation: `pimm test`, the test after training (a phase of the
launch plan that the node agent runs when the training finished) and `pimm predict`.

Everything that can be checked is checked before a process starts. Then the weights are held
(pimm.checkpoint.choose.hold_weights: the weights, step and hash of one complete checkpoint, also
while a training rotates the run's checkpoints), the evaluation directory is written
(pimm.engine.eval_dir) and torchrun runs `python -m pimm.engine.eval_worker --eval-dir D` on it;
rank 0 writes the results there.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pimm import names
from pimm.checkpoint.choose import HeldWeights, default_checkpoint, hold_weights, recorded_weights
from pimm.checkpoint.weights import check_weights_fit
from pimm.config import apply_overrides, dump_config, parse_overrides, read_run_config
from pimm.config.validate import check_config
from pimm.data.event_file import validate_data
from pimm.distributed.batch import plan_batches
from pimm.distributed.strategy import check_strategy_fits
from pimm.engine.eval_dir import HELD_WEIGHTS, METRICS_FILE, finished, read_metrics, write_spec
from pimm.errors import EXIT_FAILED, PimmError
from pimm.files import os_error_reason
from pimm.json_io import metric_text
from pimm.launch.plan import resolve_nproc, visible_gpus
from pimm.launch.process import run_torchrun


def eval_torchrun_argv(eval_dir: Path, nproc: int) -> list[str]:
    """torchrun of `nproc` evaluation ranks on this machine over the evaluation directory."""
    return [sys.executable, "-m", "pimm.launch.torchrun", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", "0", "-m", "pimm.engine.eval_worker",
            "--eval-dir", str(eval_dir)]


@dataclass
class TestJob:
    """One `pimm test`, checked: the run's config with the evaluation's overrides, and where it goes."""

    run_dir: Path
    cfg: dict
    split: str
    checkpoint: str  # best, last or step_N
    out: Path
    nproc: int
    num_events: int
    save_predictions: bool = False
    save_scores: bool = False
    overrides: list[str] = field(default_factory=list)


def prepare_test(run_dir: Path, split: str = "test", checkpoint: str | None = None, nproc_per_node: str = "1",
                 out: Path | None = None, save_predictions: bool = False, save_scores: bool = False,
                 overrides: list[str] | tuple = ()) -> TestJob:
    """Check everything that can be checked before a process starts (PimmError otherwise)."""
    if not (run_dir / "config.py").is_file():
        raise PimmError(f"--run-dir {run_dir}: {'no config.py in it' if run_dir.is_dir() else 'does not exist'}; "
                        "give the directory of a pimm run (it holds config.py and model/)")
    cfg = apply_overrides(read_run_config(run_dir / "config.py"), parse_overrides(list(overrides)))
    cfg["validate_only"] = False
    check_config(cfg)
    if not cfg["data"].get(split):
        raise PimmError(f"the run's config has no data.{split} (it is {cfg['data'].get(split)!r}); give the data to "
                        f'evaluate: -- "data.{split}={{type: LArTPCDataset, path: FILE.h5}}"')
    nproc = resolve_nproc(str(nproc_per_node), visible_gpus())
    plan_batches({**cfg, "batch_size": nproc, "grad_accum_steps": 1, "batch_size_val": None}, nproc)
    if save_scores and not save_predictions:
        raise PimmError("--save-scores adds the scores to the predictions file: give --save-predictions too")
    if save_scores and cfg["model"]["type"] in names.DETECTORS:
        raise PimmError(SCORES_OF_A_DETECTOR)
    which = checkpoint or default_checkpoint(run_dir)
    recorded_weights(run_dir, which)  # names what is available when there is no such checkpoint
    out = out or run_dir / "eval" / f"{split}-{which}"
    if finished(out):
        raise PimmError(f"{out} already holds a finished evaluation (test_metrics.json); results are never "
                        "overwritten: give another directory with --out DIR")
    if (cfg.get("parallel") or {}).get("strategy") == "fsdp2" and nproc > 1:
        check_strategy_fits(cfg)
    data = validate_data(cfg["data"][split], num_classes=cfg["data"]["num_classes"],
                         ignore_index=(cfg.get("task") or {}).get("ignore_index", -1))
    return TestJob(run_dir, cfg, split, which, out, nproc, data["num_events"], bool(save_predictions),
                   bool(save_scores), list(overrides))


# a query detector scores instances, not classes per point
SCORES_OF_A_DETECTOR = ("--save-scores writes a semantic model's per-class scores; a detector's predictions file "
                        "holds each point's instance score already: leave --save-scores out")


def run_test(job: TestJob) -> int:
    """Hold the weights, write the evaluation directory, run the ranks, print the result; 0 when
    the results are written, 1 otherwise (each rank's error printed)."""
    out = job.out
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in ("errors", "logs"):  # of an earlier evaluation into this directory that did not finish
            shutil.rmtree(out / stale, ignore_errors=True)
        held = hold_checked(job.run_dir, job.checkpoint, out / HELD_WEIGHTS, job.cfg["model"])
    except (PimmError, OSError) as exc:
        if made:  # nothing of this evaluation is left behind
            shutil.rmtree(out, ignore_errors=True)
        raise _cannot_write(out, exc) if isinstance(exc, OSError) else exc from None
    spec = {
        "run_dir": str(job.run_dir.resolve()), "split": job.split, "checkpoint": job.checkpoint, "step": held.step,
        "weights": str(held.source.resolve()), "weights_sha256": held.sha256, "held_weights": str(held.path.resolve()),
        "save_predictions": job.save_predictions, "save_scores": job.save_scores, "nproc_per_node": job.nproc,
        "overrides": job.overrides, "num_events": job.num_events,
    }
    try:
        try:
            dump_config(job.cfg, out / "config.py")
            write_spec(out, spec)
        except OSError as exc:
            raise _cannot_write(out, exc) from None
        print(f"pimm test: {job.split} ({job.num_events} events) with {job.checkpoint} (step {held.step}, "
              f"{spec['weights']}) on {job.nproc} process(es) -> {out}", flush=True)
        returncode = run_eval_dir(out, job.nproc, "pimm test", out / METRICS_FILE)
    finally:
        held.path.unlink(missing_ok=True)  # the results record its step and sha256
    if returncode != 0:
        return EXIT_FAILED
    m = read_metrics(out)

    if "miou" in m:
        print(f"pimm test: mIoU {metric_text(m['miou'])} mAcc {metric_text(m['macc'])} allAcc "
              f"{metric_text(m['allacc'])} over {m['events']} events ({m['points']} points); results in {out}")
    elif "ari_all_labelled" not in m:  # SelfDistillation
        probe = f" probe mIoU {metric_text(m.get('probe_miou'))}" if "probe_miou" in m else ""
        print(f"pimm test: self-distillation loss {metric_text(m.get('loss'))}{probe} over {int(m['events'])} "
              f"events; results in {out}")
    else:  # Panoptic
        values = " ".join(f"{label} {metric_text(m.get(key), m.get(f'{key}_sem'))}" for label, key in (
            ("ARI", "ari_all_labelled"), ("PQ", "pq"), ("purity", "purity"), ("efficiency", "efficiency"),
            ("detection F1", "detection_f1")))
        print(f"pimm test: {values} over {int(m['events'])} events; results in {out}")
    return 0


def _cannot_write(out: Path, exc: OSError) -> PimmError:
    return PimmError(f"cannot write the evaluation to {out}: {os_error_reason(exc)}; give a writable --out DIR")


def hold_checked(run_dir: Path, which: str, into: Path, model_cfg: dict) -> HeldWeights:
    """hold_weights, then the held weights checked against the model (PimmError naming the run's file)."""
    held = hold_weights(run_dir, which, into)
    try:
        check_weights_fit(held.path, model_cfg)
    except PimmError as exc:
        held.path.unlink(missing_ok=True)
        raise PimmError(str(exc).replace(str(held.path), str(held.source))) from None
    return held


def run_eval_dir(eval_dir: Path, nproc: int, verb: str, result: Path, kept: bool = False) -> int:
    """torchrun of the evaluation ranks over a prepared directory; its exit status, or 1 when `result`
    (the file rank 0 writes last) is missing. A failure is said after `verb: `: each rank's error
    (errors/rank<R>.txt), and where the logs are (kept: the whole directory is kept for a look)."""
    returncode, _ = run_torchrun(eval_torchrun_argv(eval_dir, nproc), None)
    if returncode == 0 and result.is_file():
        return 0
    errors = sorted((eval_dir / "errors").glob("rank*.txt"))
    for path in errors:
        with contextlib.suppress(OSError):
            print(f"{verb}: {path.stem}: {path.read_text().strip()}", file=sys.stderr)
    if kept:
        print(f"{verb}: failed (torchrun exit status {returncode}); logs and parts kept in {eval_dir}", file=sys.stderr)
    elif not errors:
        print(f"{verb}: failed (torchrun exit status {returncode}); see {eval_dir / 'logs'}", file=sys.stderr)
    return returncode or EXIT_FAILED


# -- the test after training ---------------------------------------------------------------------


def test_after_training(run_dir: Path, nproc: int) -> int:
    """The last phase of a launch whose config has data.test (and test_after_training, the default):
    `pimm test` of model_best.pth (last without one) on the run's processes; its exit status.

    Its results go to RUN/eval/test-best. A run trained further later (`--train.resume RUN --
    epochs=N`) keeps that evaluation: the new one goes to RUN/eval/test-best-step_<N>, N the step of
    the weights tested; weights already tested (the same sha256) are not tested again."""
    which = default_checkpoint(run_dir)
    out, done = _test_out(run_dir, which)
    command = f"pimm test --run-dir {run_dir}" + ("" if out == run_dir / "eval" / f"test-{which}" else f" --out {out}")
    print(f"\npimm: testing the run on data.test (test_after_training=true): {command}", flush=True)
    if done:
        print(f"pimm test: these weights ({which}, step {read_metrics(out).get('step')}) were tested already; "
              f"results in {out}")
        return 0
    try:
        return run_test(prepare_test(run_dir, "test", which, str(nproc), out))
    except PimmError as exc:
        print(f"pimm test: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _test_out(run_dir: Path, which: str) -> tuple[Path, bool]:
    """(where the test after training writes, whether a finished evaluation there already tested the
    weights `which` names now)."""
    default = run_dir / "eval" / f"test-{which}"
    if not finished(default):
        return default, False
    try:
        _, step, sha256 = recorded_weights(run_dir, which)
    except PimmError:
        return default, False  # prepare_test says what is wrong
    by_step = default.with_name(f"{default.name}-step_{step}")
    for out in (default, by_step):
        if finished(out) and _same_weights(read_metrics(out), step, sha256):
            return out, True
    if not finished(by_step):
        return by_step, False
    return by_step.with_name(f"{by_step.name}-{time.strftime('%Y%m%d-%H%M%S')}"), False


def _same_weights(metrics: dict, step: int | None, sha256: str | None) -> bool:
    if sha256 is not None and metrics.get("weights_sha256") is not None:
        return metrics["weights_sha256"] == sha256
    return step is not None and metrics.get("step") == step
