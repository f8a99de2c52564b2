"""Evaluation: the one loop over an evaluation loader that validation during training, `pimm test`
and `pimm predict` share, and the rank side of the last two (`main`, which torchrun runs from
pimm.launch.evaluate as `python -m pimm.engine.eval_worker --eval-dir D`).

Every event is evaluated exactly once over the ranks (ShardedEvalSampler). Metrics come from an
int64 confusion matrix all-reduced over ranks, so they are the same at any world size; the loss
is a float64 sum. The evaluation directory D (pimm.engine.eval_dir) holds eval.json (split, the
held weights, flags) and config.py; rank 0 writes the results into it:

    test_metrics.json  every metric (pimm.tasks.metrics.metrics_from_confusion) and the spec
    test_metrics.csv   one row per class and one "overall" row
    confusion.json     integer counts, rows = truth, columns = prediction, with the class names
    confusion.png      the row-normalised confusion matrix, annotated
    provenance.json    weights sha256, data identity, world size, strategy, pimm version, time
    predictions.h5     with --save-predictions (pimm.data.predictions; scores with --save-scores)

`pimm predict` starts the same entry point with a spec whose "predict" is true: the plain model
over unlabelled events, every event once, and only the merged predictions file (no segment, no
loss, no metrics) written to the spec's "out".
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pimm import __version__
from pimm.checkpoint.weights import load_weight_file
from pimm.config import config_hash, read_run_config
from pimm.config.validate import model_classes
from pimm.data.collate import collate_events
from pimm.data.dataset import build_dataset
from pimm.data.event_file import validate_data
from pimm.data.predictions import PredictionWriter, instance_table_path, merge_predictions, write_instance_table
from pimm.data.sampler import ShardedEvalSampler
from pimm.distributed.batch import plan_batches
from pimm.distributed.env import DistEnv, all_reduce_max, barrier, destroy_distributed, init_distributed
from pimm.distributed.strategy import build_strategy
from pimm.engine.eval_dir import EVAL_SPEC, METRICS_FILE, PREDICTIONS_FILE, read_spec
from pimm.engine.failure import report_failure
from pimm.engine.logs import setup_logging
from pimm.engine.plot import plot_confusion
from pimm.files import write_atomic
from pimm.json_io import dumps
from pimm.models import DetectorOutput, build_model
from pimm.models.sparse_conv import apply_backends
from pimm.names import DETECTORS
from pimm.signals import die_with_parent, loader_workers_forked
from pimm.tasks import build_task

log = logging.getLogger("pimm")


def to_device(batch: dict, device: torch.device) -> dict:
    """The collated batch's tensors on `device` (asynchronous from pinned loader memory)."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def over_batches(loader, device: torch.device, step: Callable[[dict], None]) -> None:
    """The evaluation loop: every batch of `loader`, on `device`, handed to `step`. The loader's
    workers are started with stop signals blocked (pimm.signals.loader_workers_forked)."""
    with loader_workers_forked():
        batches = iter(loader)
    for batch in batches:
        step(to_device(batch, device))


@torch.no_grad()
def evaluate_events(module: torch.nn.Module, strategy, task, dataset, loader, sampler: ShardedEvalSampler,
                    device: torch.device, autocast_dtype: torch.dtype | None = None,
                    on_batch: Callable[[dict, object], None] | None = None, meter=None) -> dict:
    """Run `task.forward_loss` of the strategy's evaluation module over this rank's batches of
    `loader` (drawn by `sampler`) and return the task meter's metrics, reduced over all ranks (a
    collective: every rank calls it). With a lockstep strategy (FSDP2) a rank with fewer batches
    runs masked forwards until all ranks ran as many. `on_batch(batch, logits)` sees each counted
    batch (on `device`) and the model's prediction (per-point logits; a DetectorOutput for Panoptic).
    `meter`: the task's meter to fill (default: a new one), for a caller that reads more of it than the
    metrics. Leaves the module in eval mode."""
    model = strategy.eval_module(module)
    model.eval()
    meter = task.make_meter(device) if meter is None else meter

    def forward(batch: dict):
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            return task.forward_loss(model, batch)

    def step(batch: dict) -> None:
        output = forward(batch)
        meter.update(output, batch)
        if on_batch is not None:
            on_batch(batch, output.prediction)

    over_batches(loader, device, step)
    if strategy.lockstep_eval:
        # the sharded forward is a collective: a rank with fewer batches runs masked ones (not
        # counted) until every rank has run as many forwards as the busiest one
        most = all_reduce_max(torch.tensor([len(sampler)], device=device)).item()
        for _ in range(int(most) - len(sampler)):
            forward(to_device(collate_events([dataset[0]]), device))
    return meter.compute()


# ----------------------------------------------------------------------------- prediction parts


def prediction_sources(dataset) -> tuple[list[str], Callable[[int], tuple[int, int]]]:
    """The data files a dataset's events come from and, per dataset index, (source, index inside it)."""
    if hasattr(dataset, "shards"):  # PILArNetDataset: (shard, row) of every selected event
        return list(dataset.shards), lambda i: (int(dataset.event_shard[i]), int(dataset.event_row[i]))
    stored = getattr(dataset, "stored", None)
    return [str(dataset.path)], lambda i: (0, i if stored is None else int(stored[i]))


def point_index(dataset, index: int, count: int) -> np.ndarray:
    """The stored point index of each of event `index`'s `count` points, as the dataset gives them
    (a point cut, GridSample or RandomCrop drops points; transforms are deterministic per event)."""
    out = dataset.point_index(index, count)
    if len(out) != count:
        raise RuntimeError(f"event {index}: the dataset gives {len(out)} point indices for {count} points")
    return out


def prediction_writer(path: Path, dataset, classes: tuple[int, list[str]], split: str, save_scores: bool,
                      attrs: dict, has_labels: bool = True, model_cfg: dict | None = None, task=None):
    """(PredictionWriter of this rank's part, on_batch callback adding each batch's events to it);
    `classes`: (number, names) of the model's classes (pimm.config.validate.model_classes). Without
    labels (`pimm predict`) the file has no `segment`. Parts are written uncompressed: rank 0's merge
    reads them once and compresses the merged file. A query detector (`model_cfg` of a names.DETECTORS type,
    its output a DetectorOutput) writes per point its instance, class and score, and per event its
    instances (`instance_table`); with labels (`task`: its Panoptic task) also the true class and instance."""
    num_classes, names = classes
    sources, locate = prediction_sources(dataset)
    detector = (model_cfg or {}).get("type") in DETECTORS
    writer = PredictionWriter(path, num_classes=num_classes, class_names=names, split=split, sources=sources,
                              save_scores=save_scores and not detector, has_labels=has_labels, attrs=attrs,
                              compress=False, has_instances=detector)

    def add(batch: dict, prediction) -> None:
        if isinstance(prediction, DetectorOutput):
            return add_instances(batch, prediction)
        logits = prediction.float()
        pred = logits.argmax(1).cpu().numpy()
        scores = torch.softmax(logits, 1).half().cpu().numpy() if save_scores else None
        coord = batch["coord"].cpu().numpy()
        segment = batch["segment"].cpu().numpy() if has_labels else None
        ends = batch["offset"].cpu().tolist()
        for event_id, lo, hi in zip(batch["event_id"].tolist(), [0, *ends[:-1]], ends):
            source, source_index = locate(event_id)
            writer.add(event_id, source, source_index, pred[lo:hi], point_index(dataset, event_id, hi - lo),
                       coord[lo:hi], None if segment is None else segment[lo:hi],
                       None if scores is None else scores[lo:hi])

    # a point of no instance that is not stuff is written with the first stuff class (0 without any)
    unassigned_class = ((model_cfg or {}).get("stuff_classes") or [0])[0]

    def add_instances(batch: dict, output: DetectorOutput) -> None:
        coord = batch["coord"].cpu().numpy()
        truth = task.truth(batch) if has_labels else None
        ends = batch["offset"].cpu().tolist()
        for b, (event_id, lo, hi) in enumerate(zip(batch["event_id"].tolist(), [0, *ends[:-1]], ends)):
            found, final = output.instances[b], output.events[b].final
            instance = found.instance.cpu().numpy()
            point_class = found.point_class.cpu().numpy()
            table = {"instance": np.arange(len(found.query)), "class": found.instance_class.cpu().numpy(),
                     "score": found.instance_score.float().cpu().numpy(),
                     "size": np.bincount(instance[instance >= 0], minlength=len(found.query))}
            for side in ("momentum", "vertex"):
                value = getattr(final, side)
                if value is not None:
                    table[side] = value[found.query].float().cpu().numpy()
            source, source_index = locate(event_id)
            writer.add(event_id, source, source_index, np.where(point_class < 0, unassigned_class, point_class),
                       point_index(dataset, event_id, hi - lo), coord[lo:hi],
                       None if truth is None else truth[0][lo:hi].cpu().numpy(), None,
                       instance=instance, instance_score=found.score.float().cpu().numpy(),
                       true_instance=None if truth is None else truth[1][lo:hi].cpu().numpy(),
                       instance_table=table)

    return writer, add


# ----------------------------------------------------------------------------- result files


def metrics_csv(result: dict, names: list[str]) -> str:
    """One row per class (iou, accuracy = recall, precision, recall, f1, points) and one overall row."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["class", "iou", "accuracy", "precision", "recall", "f1", "points"])

    def cell(v) -> str:
        return "" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v:.6g}"

    for i, name in enumerate(names):
        w.writerow([name, *(cell(result[k][i]) for k in ("iou", "class_accuracy", "precision", "recall", "f1")),
                    result["class_points"][i]])
    w.writerow(["overall", cell(result["miou"]), cell(result["macc"]), "", "", "", result["points"]])
    w.writerow(["allacc", "", cell(result["allacc"]), "", "", "", result["points"]])
    return out.getvalue()


def per_event_csv(rows: dict[str, np.ndarray]) -> str:
    """One row per event: event_id, then every per-event metric (empty where undefined)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(list(rows))
    for values in zip(*rows.values()):
        w.writerow([int(values[0]), *("" if not np.isfinite(v) else f"{v:.6g}" for v in values[1:])])
    return out.getvalue()


def write_results(out: Path, result: dict, spec: dict, names: list[str], provenance: dict, meter=None) -> None:
    """Rank 0: the metric, confusion and provenance files of one evaluation (test_metrics.json last:
    its presence marks a finished evaluation). Semantic segmentation: test_metrics.csv per class and the
    point confusion; Panoptic (a meter with per-event rows): test_metrics_per_event.csv and the pid
    confusion of matched instances; SelfDistillation: the loss, and with a probe its voxel confusion."""
    per_event = meter.per_event() if hasattr(meter, "per_event") else None
    if "confusion" in result:  # self-distillation without a probe has none
        confusion = {"class_names": names, "rows": "truth", "columns": "prediction", "counts": result["confusion"]}
        if per_event is not None:
            confusion["counts_of"] = "instances matched at the IoU threshold, by their classes"
        write_atomic(out / "confusion.json", dumps(confusion, indent=2) + "\n")
        plot_confusion(np.asarray(result["confusion"], np.int64), names, out / "confusion.png",
                       title=f"{spec['split']}: {spec['checkpoint']} (step {spec.get('step')})")
    if per_event is not None:
        write_atomic(out / "test_metrics_per_event.csv", per_event_csv(per_event))
    elif "iou" in result:
        write_atomic(out / "test_metrics.csv", metrics_csv(result, names))
    write_atomic(out / "provenance.json", dumps(provenance, indent=2) + "\n")
    record = {**result, "class_names": names, "split": spec["split"], "checkpoint": spec["checkpoint"],
              "step": spec.get("step"), "weights": spec["weights"], "weights_sha256": spec["weights_sha256"]}
    write_atomic(out / METRICS_FILE, dumps(record, indent=2) + "\n")


# ----------------------------------------------------------------------------- the rank's main


def _loader(dataset, events_per_batch: int, env: DistEnv, workers: int):
    """(this rank's share of every event once, in batches of `events_per_batch`: sampler, loader)."""
    sampler = ShardedEvalSampler(len(dataset), events_per_batch, env.world_size, env.rank)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                         collate_fn=collate_events, pin_memory=env.device.type == "cuda")
    return sampler, loader


def _merged(out: Path, env: DistEnv, writer: PredictionWriter | None, run: Callable[[], object]):
    """run() with this rank's predictions part written by `writer` (closed, or aborted on an error);
    after every rank is done, rank 0 merges the parts into `out`. Returns what run() returned."""
    try:
        result = run()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
    barrier()
    if writer is not None and env.is_main:
        merge_predictions([writer.path.with_name(f"predictions.rank{r}.h5") for r in range(env.world_size)], out)
        if writer.has_instances:
            write_instance_table(out, instance_table_path(out))
    return result


def _evaluate(eval_dir: Path, spec: dict, env: DistEnv) -> None:
    """The rank side of `pimm test`: the task's loss and metrics of the held weights."""
    cfg = read_run_config(eval_dir / "config.py")
    split = spec["split"]
    data_cfg = {**cfg["data"][split], "augment": False}  # evaluation sees the events as stored
    dataset = build_dataset(data_cfg, seed=int(cfg["seed"]))
    # only the test batch matters here: a training batch that does not divide this world size is no error
    plan = plan_batches({**cfg, "batch_size": env.world_size, "grad_accum_steps": 1, "batch_size_val": None},
                        env.world_size)
    sampler, loader = _loader(dataset, plan.test_events_per_rank, env, plan.workers_per_rank)
    torch.manual_seed(int(cfg["seed"]))
    model = build_model(cfg["model"])
    apply_backends(model, cfg, env.device)
    task = build_task(cfg)
    strategy = build_strategy(cfg, env)
    module = strategy.wrap(model, env)
    strategy.load_full_model_state(module, load_weight_file(spec["held_weights"]))
    log.info("evaluating %s (%d events, %d per rank and batch) with %s (step %s) on %d rank(s), strategy %s",
             split, len(dataset), plan.test_events_per_rank, spec["weights"], spec.get("step"), env.world_size,
             strategy.name)
    amp = cfg.get("amp") or {}
    autocast = getattr(torch, amp.get("dtype", "bfloat16")) if amp.get("enabled") and env.device.type == "cuda" \
        else None

    writer, on_batch = None, None
    facts = {"weights_sha256": spec["weights_sha256"], "config_hash": config_hash(cfg), "world_size": env.world_size,
             "pimm_version": __version__}
    if spec.get("save_predictions"):
        writer, on_batch = prediction_writer(eval_dir / f"predictions.rank{env.rank}.h5", dataset, model_classes(cfg),
                                             split, bool(spec.get("save_scores")), {**facts, "rank": env.rank},
                                             model_cfg=cfg["model"], task=task)
    started = time.perf_counter()
    meter = task.make_meter(env.device)
    result = _merged(eval_dir / PREDICTIONS_FILE, env, writer, lambda: evaluate_events(
        module, strategy, task, dataset, loader, sampler, env.device, autocast, on_batch, meter))
    if not env.is_main:
        return
    seconds = time.perf_counter() - started
    names = list(task.class_names)
    data = validate_data(cfg["data"][split], num_classes=cfg["data"]["num_classes"],
                         ignore_index=(cfg.get("task") or {}).get("ignore_index", -1))
    provenance = {
        **facts, "weights": spec["weights"], "checkpoint": spec["checkpoint"], "step": spec.get("step"),
        "split": split, "data": {k: data.get(k) for k in ("path", "size_bytes", "num_events", "content_hash")},
        "strategy": strategy.name, "device_type": env.device.type, "seconds": seconds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_results(eval_dir, result, spec, names, provenance, meter)
    log.info("%s: %s in %.1f s", split, task.summary(result), seconds)


def _predict(eval_dir: Path, spec: dict, env: DistEnv) -> None:
    """The rank side of `pimm predict`: the plain model (no DDP or FSDP2 wrapper: inference needs no
    gradient sync) over this rank's share of the events, every event once; rank 0 merges the
    parts into spec["out"]. No labels, loss or metrics."""
    dataset = build_dataset({**spec["data"], "augment": False, "labels": False}, seed=0)
    workers = 2 if env.device.type == "cuda" else 0  # CPU ranks share the cores with the model
    _, loader = _loader(dataset, int(spec["batch_size"]), env, workers)
    model = build_model(spec["model"])
    apply_backends(model, spec, env.device)
    model.load_state_dict(load_weight_file(spec["held_weights"]))
    model.to(env.device).eval()
    log.info("predicting %d events (%d per rank and batch) with %s on %d rank(s)", len(dataset), spec["batch_size"],
             spec["weights"], env.world_size)
    facts = {"weights_sha256": spec["weights_sha256"], "weights": spec["weights"], "checkpoint": spec["checkpoint"],
             "step": spec["step"], "data": spec["data_identity"], "world_size": env.world_size,
             "pimm_version": __version__}
    writer, on_batch = prediction_writer(eval_dir / f"predictions.rank{env.rank}.h5", dataset,
                                         (spec["num_classes"], spec["class_names"]), spec["split"],
                                         bool(spec["save_scores"]), {**facts, "rank": env.rank}, has_labels=False,
                                         model_cfg=spec["model"])

    @torch.no_grad()
    def predict() -> None:
        over_batches(loader, env.device, lambda batch: on_batch(
            batch, model(batch["coord"], batch["feat"], batch["offset"], event_id=batch["event_id"])))

    started = time.perf_counter()
    _merged(Path(spec["out"]), env, writer, predict)
    if env.is_main:
        log.info("predicted %d events in %.1f s -> %s", len(dataset), time.perf_counter() - started, spec["out"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pimm.engine.eval_worker")
    parser.add_argument("--eval-dir", type=Path, required=True)
    eval_dir: Path = parser.parse_args(argv).eval_dir
    if not (eval_dir / EVAL_SPEC).is_file():
        print(f"pimm.engine.eval_worker: error: {eval_dir / EVAL_SPEC} does not exist; start evaluations with "
              "`pimm test` (or `pimm predict`)", file=sys.stderr)
        return 2
    die_with_parent()  # no rank outlives torchrun
    rank = int(os.environ.get("RANK", 0))
    logging.raiseExceptions = False
    setup_logging(eval_dir / "logs", rank)
    try:
        env = init_distributed()
        spec = read_spec(eval_dir)
        (_predict if spec.get("predict") else _evaluate)(eval_dir, spec, env)
        destroy_distributed()
        return 0
    except BaseException as exc:
        return report_failure(exc, eval_dir, rank, log)
