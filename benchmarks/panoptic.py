"""Particles found by the query detector against DBSCAN on semantic classes, on generated PILArNet-M-layout
events, both models trained here within a CPU budget and scored with pimm's panoptic metrics.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/panoptic.py [--seconds 240 | --steps N] [--events 200]
        [--test-events 50] [--points-per-event 4000] [--eps 1.9,4,8,12] [--timing-pairs N] [--out FILE]

Events: `pimm data synth --layout pilarnet --revision v2` (1 to 3 interactions and the rain per image), training
and held-out events from two seeds, read as the configs' data say (PILArNetDataset(instances=True), pid classes,
"none" as stuff). Two models on the same PT-v3m2 encoder (configs/bench/panoptic_detector.py and
panoptic_semseg.py, the semantic model with the published semantic recipes' loss, cross-entropy plus Lovasz-softmax
at 1/20) train in one process through pimm's own pieces (build_model, build_task, task.forward_loss, the config's
AdamW, collate_events) until each has spent --seconds of CPU time (all threads) in its own steps, or with --steps
until each has taken that many steps. The configs' OneCycleLR (the published recipes' shape) runs over that budget:
at each step the learning rate is the schedule's at the fraction of the budget spent, since the number of steps a
CPU budget buys is not known in advance. Their steps alternate on the same batches, in ABBA order, so the step-time
ratio sees the same events and the same machine.

The two budgets answer different questions. CPU seconds are fair between the models (the detector's step costs
more, so it takes fewer), and a CPU second buys different work on different machines. A number of steps gives the
same training on any machine (the rows repeat where the arithmetic does), and favours the model whose step costs
more.

Rows of the table, every one scored by PanopticAccumulator on the held-out events with the task's truth
(particles as instances, their majority class, stuff left out):
- the detector (its post-processed instances, the config's thresholds) with the published post-processing;
- with the config's connect_radius (pimm's own, configs/bench/panoptic_detector.py sets it), the same detector's
  outputs with its connected pieces after the published post-processing (pimm.models.query_detector);
- with the config's connect_collinear too (pimm's own, set there), the same pieces with the touching collinear ones
  of one class joined (the detector as the config builds it);
- DBSCAN (scikit-learn) on the voxels of each non-stuff class the semantic model predicts, each cluster one
  instance of that class;
- DBSCAN on the true classes.
Below the table, each detector row's per-event differences from DBSCAN on predicted semantics on the same events,
mean ± standard error (pimm.panoptic_metrics.paired_differences): whether a difference is more than the held-out
events' spread. Each DBSCAN row uses the radius of --eps that gives it the best ARI (all labelled) on --select-events
training events, never the held-out ones. Also printed: the instances per held-out event of each row and the true
particles per event (purity and efficiency are means over instances: many small instances raise purity; printed
below the table also weighted by points, purity_pooled and efficiency_pooled), and the share of the held-out
particles that some query's mask (sigmoid > the config's mask_threshold, over the labelled points)
covers at IoU >= the task's threshold, what the best post-processing could keep; the mean training step of the
detector against the semantic model's (same backbone, same batches) and the share of the detector's step spent in
the Hungarian assignment (pimm.tasks.panoptic_loss.assign_queries, scipy's linear_sum_assignment, timed by wrapping it).

With --timing-pairs N only the step times are measured (N pairs after the warm-up, nothing trained to the budget,
nothing scored): for model sizes too slow to train here, e.g. the published particle detector and a semantic
model on its encoder (--detector-config bench/panoptic_detector_published --semantic-config
bench/panoptic_semseg_published).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sklearn.cluster import DBSCAN

from pimm.config import load_config, resolve_config_path
from pimm.config.paths import config_roots
from pimm.data.collate import collate_events
from pimm.data.dataset import PILArNetDataset
from pimm.data.synth import write_pilarnet
from pimm.engine.optim import build_optimizer
from pimm.errors import PimmError
from pimm.models import build_model
from pimm.panoptic_metrics import PanopticAccumulator, paired_differences
from pimm.tasks import Panoptic, SemanticSegmentation, Task, build_task, panoptic_loss
from pimm.tasks.panoptic import event_arrays

COLUMNS = ("ari_all_labelled", "ari_predicted_things", "purity", "efficiency", "pq", "detection_f1")
HEADERS = ("ARI (all labelled)", "ARI (predicted things)", "purity", "efficiency", "PQ", "detection F1")
WARMUP_PAIRS = 2  # the first alternating steps (allocator and caches warming up) are left out of the timings


def dbscan_instances(coord: np.ndarray, point_class: np.ndarray, stuff_classes: tuple[int, ...], eps: float,
                     min_samples: int) -> np.ndarray:
    """Per-point instance ids (-1: stuff, no class or noise): DBSCAN on the points of each non-stuff class."""
    instance = np.full(len(coord), -1, np.int64)
    next_id = 0
    for cls in np.unique(point_class):
        if cls < 0 or cls in stuff_classes:
            continue
        rows = np.flatnonzero(point_class == cls)
        labels = DBSCAN(eps=eps, min_samples=min_samples).fit_predict(coord[rows])
        found = labels >= 0
        instance[rows[found]] = labels[found] + next_id
        next_id += int(labels.max()) + 1 if found.any() else 0
    return instance


class MatchTimer:
    """Wraps pimm.tasks.panoptic_loss.assign_queries, the Hungarian assignment (which the detector loss calls
    through its module), and adds up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._match = panoptic_loss.assign_queries

    def __enter__(self) -> MatchTimer:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._match(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        panoptic_loss.assign_queries = timed
        return self

    def __exit__(self, *exc) -> None:
        panoptic_loss.assign_queries = self._match


def one_cycle_factor(fraction: float, pct_start: float, div_factor: float, final_div_factor: float) -> float:
    """torch's OneCycleLR (cosine, two phases) at `fraction` of the run, as a multiple of max_lr."""
    initial = 1.0 / div_factor
    if fraction < pct_start:
        start, end, progress = initial, 1.0, fraction / pct_start
    else:
        start, end, progress = 1.0, initial / final_div_factor, (fraction - pct_start) / (1.0 - pct_start)
    return end + (start - end) / 2 * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclass(frozen=True)
class Budget:
    """How long each model trains: CPU seconds (all threads) of its own steps, or a number of its steps."""

    seconds: float = math.inf
    steps: int | None = None

    def fraction(self, trainee: Trainee) -> float:
        """The share of the budget `trainee` has spent (>= 1: done); 0 for an unbounded budget."""
        if self.steps is not None:
            return len(trainee.step_seconds) / self.steps
        return trainee.spent / self.seconds if math.isfinite(self.seconds) else 0.0

    def describe(self) -> str:
        return f"{self.steps} training steps" if self.steps is not None else \
            f"{self.seconds:g} CPU seconds of training steps"


@dataclass
class Trainee:
    """One model in training: its config, task, optimizer, and the wall-clock and CPU seconds of each step."""

    name: str
    cfg: dict
    model: torch.nn.Module
    task: Task
    optimizer: torch.optim.Optimizer
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)
    match_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def spent(self) -> float:
        """CPU seconds (all threads) of this process in this model's steps: what the budget counts, the same
        amount of work however busy the shared machine is."""
        return sum(self.step_cpu_seconds)

    def set_lr(self, fraction: float) -> None:
        """The config's scheduler at `fraction` of the CPU budget spent: a OneCycleLR whose run is the budget
        (the number of steps a budget buys is not known in advance), or None for a constant rate."""
        scheduler = self.cfg.get("scheduler")
        if scheduler is None:
            return
        options = {k: v for k, v in scheduler.items() if k != "type"}
        factor = one_cycle_factor(fraction, options.get("pct_start", 0.3), options.get("div_factor", 25.0),
                                  options.get("final_div_factor", 1e4))
        for group in self.optimizer.param_groups:
            group["lr"] = float(options.get("max_lr", self.cfg["optimizer"]["lr"])) * factor

    def step(self, batch: dict, timer: MatchTimer) -> None:
        """One optimizer step on `batch`, timed (forward, loss, backward, clipping, update)."""
        self.model.train()
        matched_before = timer.seconds
        start, cpu_start = time.perf_counter(), time.process_time()
        output = self.task.forward_loss(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        if self.cfg.get("clip_grad"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["clip_grad"])
        self.optimizer.step()
        self.step_seconds.append(time.perf_counter() - start)
        self.step_cpu_seconds.append(time.process_time() - cpu_start)
        self.match_seconds.append(timer.seconds - matched_before)
        self.losses.append(float(output.loss.detach()))


def build_trainee(name: str, config: str) -> Trainee:
    cfg = load_config(resolve_config_path(config, config_roots()))
    torch.manual_seed(int(cfg["seed"]))
    model = build_model(cfg["model"])
    return Trainee(name, cfg, model, build_task(cfg), build_optimizer(cfg["optimizer"], model.parameters()))


def check_same_setup(detector: Trainee, semantic: Trainee) -> None:
    """The comparison needs one backbone, one set of classes and a Panoptic detector task."""
    if not isinstance(detector.task, Panoptic):
        raise SystemExit(f"--detector-config has task type {type(detector.task).__name__}; it must be Panoptic")
    if not isinstance(semantic.task, SemanticSegmentation):
        raise SystemExit(f"--semantic-config has task type {type(semantic.task).__name__}; it must be "
                         "SemanticSegmentation (a model with one class logit per point)")
    for trainee in (detector, semantic):
        scheduler = trainee.cfg.get("scheduler")
        if scheduler is not None and scheduler.get("type") != "OneCycleLR":
            raise SystemExit(f"the {trainee.name} config's scheduler is {scheduler.get('type')!r}: the benchmark "
                             "follows a OneCycleLR over its CPU budget, or none (scheduler = None)")
    if detector.cfg["model"]["backbone"] != semantic.cfg["model"]["backbone"]:
        raise SystemExit("the detector's and the semantic model's backbones differ:\n"
                         f"  {detector.cfg['model']['backbone']}\n  {semantic.cfg['model']['backbone']}\n"
                         "give both configs the same model.backbone")
    for key in ("grid_size", "grid_origin"):
        if detector.cfg["model"].get(key) != semantic.cfg["model"].get(key):
            raise SystemExit(f"model.{key} differs: {detector.cfg['model'].get(key)} (detector) and "
                             f"{semantic.cfg['model'].get(key)} (semantic); both models must see the same voxels")
    for key in ("num_classes", "names"):
        if detector.cfg["data"].get(key) != semantic.cfg["data"].get(key):
            raise SystemExit(f"data.{key} differs: {detector.cfg['data'].get(key)} (detector) and "
                             f"{semantic.cfg['data'].get(key)} (semantic); give both configs the same classes")
    if detector.cfg["data"]["train"].get("label") != semantic.cfg["data"]["train"].get("label"):
        raise SystemExit("data.train.label differs between the configs; both models must learn the same classes")


def read_events(cfg: dict, path: Path, split: str) -> PILArNetDataset:
    """The config's training dataset options (label, energy threshold, ...) on the generated `split`."""
    options = {k: v for k, v in cfg["data"]["train"].items() if k not in ("type", "path", "split")}
    return PILArNetDataset(path, split=split, **{**options, "instances": True})


def training_batches(events: PILArNetDataset, batch_size: int, seed: int) -> Iterator[dict]:
    """Collated batches of `batch_size` events, a fresh shuffle every pass over the events."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(events))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collate_events([events[int(i)] for i in order[start:start + batch_size]])


def train(detector: Trainee, semantic: Trainee, events: PILArNetDataset, budget: Budget, seed: int,
          max_pairs: int | None = None) -> None:
    """One step of each model on every batch, in ABBA order (a drift in the machine's speed favours neither),
    until each has spent its `budget` (or after `max_pairs` batches)."""
    batches = training_batches(events, int(detector.cfg["batch_size"]), seed)
    with MatchTimer() as timer:
        pairs = 0
        while min(budget.fraction(t) for t in (detector, semantic)) < 1 and (max_pairs is None or pairs < max_pairs):
            batch = next(batches)
            for trainee in (detector, semantic) if pairs % 2 == 0 else (semantic, detector):
                if budget.fraction(trainee) < 1:
                    trainee.set_lr(budget.fraction(trainee))
                    trainee.step(batch, timer)
            pairs += 1


def step_timing(detector: Trainee, semantic: Trainee) -> dict[str, float]:
    """Mean step times of the batches both models trained on (warm-up left out), their ratios and the share of
    the detector's step spent in the Hungarian assignment."""
    pairs = min(len(detector.step_seconds), len(semantic.step_seconds))
    kept = slice(WARMUP_PAIRS if pairs > WARMUP_PAIRS else 0, pairs)
    det, sem = detector.step_seconds[kept], semantic.step_seconds[kept]
    det_cpu, sem_cpu = detector.step_cpu_seconds[kept], semantic.step_cpu_seconds[kept]
    return {"pairs": len(det), "detector_step_s": statistics.fmean(det), "semantic_step_s": statistics.fmean(sem),
            "ratio": statistics.fmean(det) / statistics.fmean(sem),
            "ratio_of_medians": statistics.median(det) / statistics.median(sem),
            "ratio_cpu": sum(det_cpu) / sum(sem_cpu),
            "matching_share": sum(detector.match_seconds[kept]) / sum(det)}


@dataclass
class HeldOutEvent:
    """One event with the task's truth and the semantic model's predicted class per point."""

    event_id: int
    batch: dict  # the event collated alone
    coord: np.ndarray
    true_instance: np.ndarray
    true_class: np.ndarray
    predicted_class: np.ndarray


@torch.no_grad()
def semantic_predictions(task: Panoptic, semantic: Trainee, events: PILArNetDataset,
                         count: int) -> Iterator[HeldOutEvent]:
    """The first `count` events, each with its truth (particles as instances, stuff left out, as the detector's
    task sees them) and the semantic model's predicted classes."""
    semantic.model.eval()
    for index in range(min(count, len(events))):
        batch = collate_events([events[index]])
        point_class, instance = task.truth(batch)
        logits = semantic.model(batch["coord"], batch["feat"], batch["offset"], event_id=batch["event_id"])
        yield HeldOutEvent(int(batch["event_id"][0]), batch, batch["coord"].numpy(), instance.numpy(),
                           point_class.numpy(), logits.argmax(1).numpy())


def new_meter(task: Panoptic) -> PanopticAccumulator:
    return PanopticAccumulator(task.num_classes, task.stuff_classes, task.iou_threshold, task.class_names)


def score_dbscan(meter: PanopticAccumulator, event: HeldOutEvent, point_class: np.ndarray,
                 stuff_classes: tuple[int, ...], eps: float, min_samples: int) -> int:
    """Scores DBSCAN's instances of one event; returns how many it made."""
    found = dbscan_instances(event.coord, point_class, stuff_classes, eps, min_samples)
    meter.update(event.event_id, event.true_instance, found, event.true_class, point_class)
    return int(found.max()) + 1


def choose_radii(task: Panoptic, semantic: Trainee, events: PILArNetDataset, count: int, radii: list[float],
                 min_samples: int) -> dict[str, dict[str, float]]:
    """ARI (all labelled) of DBSCAN at every radius on the first `count` training events, on the true and on
    the predicted classes -> {"true"|"predicted": {str(eps): ari}}."""
    meters = {side: {eps: new_meter(task) for eps in radii} for side in ("true", "predicted")}
    for event in semantic_predictions(task, semantic, events, count):
        for side, point_class in (("true", event.true_class), ("predicted", event.predicted_class)):
            for eps, meter in meters[side].items():
                score_dbscan(meter, event, point_class, task.stuff_classes, eps, min_samples)
    return {side: {str(eps): meter.result()["ari_all_labelled"] for eps, meter in by_eps.items()}
            for side, by_eps in meters.items()}


def best_radius(ari_by_eps: dict[str, float]) -> float:
    return float(max(ari_by_eps, key=lambda eps: np.nan_to_num(ari_by_eps[eps], nan=-1.0)))


def mask_recall(mask_logits: torch.Tensor, true_instance: np.ndarray, mask_threshold: float,
                iou_threshold: float) -> tuple[int, int]:
    """One event's (true instances with some query mask at IoU >= iou_threshold, true instances): what the best
    post-processing could keep. Masks (sigmoid > mask_threshold) count the labelled points only."""
    instance = torch.as_tensor(true_instance)
    labelled = instance >= 0
    masks = (mask_logits.float().sigmoid() > mask_threshold) & labelled
    particles = torch.unique(instance[labelled]).tolist()
    found = 0
    for t in particles:
        truth = instance == t
        overlap = (masks & truth).sum(1)
        iou = overlap / (masks | truth).sum(1).clamp(min=1)
        found += int(iou.max() >= iou_threshold)
    return found, len(particles)


@torch.no_grad()
def evaluate(detector: Trainee, semantic: Trainee, events: PILArNetDataset, eps: dict[str, float],
             min_samples: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """The table's rows on the held-out events, and what each found: instances per event (the detector's after
    post-processing; "particles": the true ones), the share of true particles some query's mask covers at
    IoU >= the task's threshold, and each detector row's per-event differences from DBSCAN on predicted semantics
    (panoptic_metrics.paired_differences)."""
    task = detector.task
    detector.model.eval()
    connect = detector.model.connect
    # the config's connected pieces; with connect_collinear also without joining, to show what joining adds
    variants = {}
    if connect is not None:
        variants = ({"connected": connect} if connect["collinear"] is None
                    else {"connected": dict(connect, collinear=None), "joined": connect})
    rows = {"detector": new_meter(task), **{name: new_meter(task) for name in variants},
            "predicted": new_meter(task), "true": new_meter(task)}
    instances = dict.fromkeys(("particles", *rows), 0)
    covered = 0
    for event in semantic_predictions(task, semantic, events, len(events)):
        batch = event.batch
        output = detector.model(batch["coord"], batch["feat"], batch["offset"], event_id=batch["event_id"])
        # the model's own instances (its forward post-processed them as the config says), and the other rows'
        outputs = {name: output if pieces is connect else dataclasses.replace(
            output, instances=detector.model.instances(output, batch["coord"], connect=pieces))
            for name, pieces in {"detector": False, **variants}.items()}
        for name, scored in outputs.items():
            (event_id, found), = event_arrays(task, batch, scored)  # as pimm test scores the detector
            rows[name].update(event_id, **found)
            instances[name] += int(found["pred_instance"].max()) + 1
        hits, count = mask_recall(output.events[0].final.mask_logits, event.true_instance,
                                  detector.model.postprocess["mask_threshold"], task.iou_threshold)
        covered, instances["particles"] = covered + hits, instances["particles"] + count
        instances["predicted"] += score_dbscan(rows["predicted"], event, event.predicted_class, task.stuff_classes,
                                               eps["predicted"], min_samples)
        instances["true"] += score_dbscan(rows["true"], event, event.true_class, task.stuff_classes, eps["true"],
                                          min_samples)
    found = {"instances_per_event": {name: count / len(events) for name, count in instances.items()},
             "mask_recall": covered / max(instances["particles"], 1),
             "differences": {name: paired_differences(rows[name], rows["predicted"])
                             for name in ("detector", *variants)}}
    return {name: meter.result() for name, meter in rows.items()}, found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float,
                   help="training budget per model: CPU seconds (all threads) of its own steps (default 240)")
    p.add_argument("--steps", type=int,
                   help="training budget per model: this many steps instead of --seconds (the same training on any "
                        "machine; the module docstring says what each budget favours)")
    p.add_argument("--events", type=int, default=200, help="generated training events (default 200)")
    p.add_argument("--test-events", type=int, default=50, help="generated held-out events (default 50)")
    p.add_argument("--select-events", type=int, default=50,
                   help="training events on which each DBSCAN row picks its radius (default 50)")
    p.add_argument("--points-per-event", type=int, default=4000, help="about this many voxels per event (default 4000)")
    p.add_argument("--eps", default="1.9,4,8,12",
                   help="DBSCAN radii in voxels to choose from, comma-separated (default 1.9,4,8,12)")
    p.add_argument("--min-samples", type=int, default=1, help="DBSCAN min_samples (default 1)")
    p.add_argument("--detector-config", default="bench/panoptic_detector", help="(default bench/panoptic_detector)")
    p.add_argument("--semantic-config", default="bench/panoptic_semseg", help="(default bench/panoptic_semseg)")
    p.add_argument("--seed", type=int, default=7, help="generator seed of the training events; held-out: seed + 1")
    p.add_argument("--timing-pairs", type=int,
                   help="only time the steps: this many alternating pairs after the warm-up, no training to the "
                        "budget and no scoring (for configs too large to train here, e.g. bench/"
                        "panoptic_detector_published and bench/panoptic_semseg_published)")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("seconds", "steps", "events", "test_events", "select_events", "points_per_event", "min_samples",
                 "timing_pairs"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.seconds is not None and args.steps is not None:
        p.error(f"--seconds {args.seconds:g} and --steps {args.steps} are two budgets: give one of them")
    if args.steps is None and args.seconds is None:
        args.seconds = 240.0
    try:
        args.radii = [float(e) for e in args.eps.split(",")]
    except ValueError:
        p.error(f"--eps {args.eps!r} is not a comma-separated list of numbers; e.g. --eps 4,8,12")
    if not all(0 < e < math.inf for e in args.radii):
        p.error(f"--eps {args.eps!r}: every DBSCAN radius must be a positive number of voxels")
    return args


def print_timing(timing: dict[str, float]) -> None:
    print(f"\ntraining step, mean of {timing['pairs']} alternating steps on the same batches: detector "
          f"{1000 * timing['detector_step_s']:.0f} ms, semantic {1000 * timing['semantic_step_s']:.0f} ms, ratio "
          f"{timing['ratio']:.2f}x (goal <= 1.3x; of medians {timing['ratio_of_medians']:.2f}x, of CPU time "
          f"{timing['ratio_cpu']:.2f}x); Hungarian assignment "
          f"{100 * timing['matching_share']:.1f}% of the detector's step")


def time_steps(detector: Trainee, semantic: Trainee, events: PILArNetDataset, args: argparse.Namespace) -> None:
    """--timing-pairs: the step-time ratio alone."""
    train(detector, semantic, events, Budget(), args.seed, max_pairs=WARMUP_PAIRS + args.timing_pairs)
    timing = step_timing(detector, semantic)
    points = np.mean([len(events[i]["coord"]) for i in range(len(events))])
    print(f"{args.detector_config} against {args.semantic_config}, batches of {detector.cfg['batch_size']} "
          f"generated events of {points:.0f} voxels on average")
    print_timing(timing)
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "voxels_per_event": points,
                                        "timing": timing}, default=float) + "\n")


def fmt(value: float) -> str:
    return f"{value:.3f}" if np.isfinite(value) else "n/a"


def fmt_difference(difference: dict[str, float], name: str) -> str:
    """A mean per-event difference and its standard error, e.g. +0.091 ± 0.020."""
    mean, sem = difference[name], difference[f"{name}_sem"]
    return f"{mean:+.3f} ± {sem:.3f}" if np.isfinite(mean) and np.isfinite(sem) else fmt(mean)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        detector = build_trainee("detector", args.detector_config)
        semantic = build_trainee("semantic", args.semantic_config)
    except PimmError as exc:  # a config that is not there, or that pimm refuses
        raise SystemExit(f"benchmarks/panoptic.py: {exc}") from None
    check_same_setup(detector, semantic)
    with tempfile.TemporaryDirectory(prefix="pimm-bench-panoptic-") as tmp:
        write_pilarnet(tmp, args.events, seed=args.seed, revision="v2", split="train",
                       points_per_event=args.points_per_event)
        write_pilarnet(tmp, args.test_events, seed=args.seed + 1, revision="v2", split="test",
                       points_per_event=args.points_per_event)
        train_events = read_events(detector.cfg, Path(tmp), "train")
        test_events = read_events(detector.cfg, Path(tmp), "test")
        if len(train_events) < int(detector.cfg["batch_size"]):
            raise SystemExit(f"{len(train_events)} training events are fewer than one batch "
                             f"({detector.cfg['batch_size']}); raise --events")
        if args.timing_pairs:
            return time_steps(detector, semantic, train_events, args)
        start = time.perf_counter()
        budget = Budget(steps=args.steps) if args.steps is not None else Budget(seconds=args.seconds)
        train(detector, semantic, train_events, budget, args.seed)
        train_wall = time.perf_counter() - start
        sweep = choose_radii(detector.task, semantic, train_events, args.select_events, args.radii, args.min_samples)
        eps = {side: best_radius(ari) for side, ari in sweep.items()}
        rows, found = evaluate(detector, semantic, test_events, eps, args.min_samples)
        points = np.mean([len(test_events[i]["coord"]) for i in range(len(test_events))])

    timing = step_timing(detector, semantic)
    training = {t.name: {"steps": len(t.step_seconds), "events": len(t.step_seconds) * int(t.cfg["batch_size"]),
                         "cpu_seconds": t.spent, "wall_seconds": sum(t.step_seconds), "first_loss": t.losses[0],
                         "last_loss": statistics.fmean(t.losses[-5:]),
                         "lr": t.cfg["optimizer"]["lr"], "scheduler": t.cfg.get("scheduler")}
                for t in (detector, semantic)}
    connect = detector.model.connect
    labels = {"detector": f"detector ({detector.cfg['model']['type']}), published post-processing",
              **({"connected": f"detector, + connected pieces (radius {connect['radius']:g}, "
                               f">= {connect['min_points']} points)"} if connect else {}),
              **({"joined": f"detector, + connected pieces, collinear ones joined "
                            f"(cosine above {connect['collinear']:g})"}
                 if connect and connect["collinear"] is not None else {}),
              "predicted": f"DBSCAN eps {eps['predicted']:g}, predicted semantics",
              "true": f"DBSCAN eps {eps['true']:g}, true semantics"}

    print(f"{len(train_events)} training and {len(test_events)} held-out generated events, {points:.0f} voxels each "
          f"on average; {budget.describe()} per model ({train_wall:.0f} s wall)")
    for t in (detector, semantic):
        row = training[t.name]
        schedule = " (OneCycleLR over the budget)" if row["scheduler"] else ""
        print(f"{t.name}: {row['steps']} steps of {t.cfg['batch_size']} events, lr {row['lr']:g}{schedule}, loss "
              f"{row['first_loss']:.3f} -> {row['last_loss']:.3f}")
    print(f"DBSCAN radius by ARI (all labelled) on {min(args.select_events, len(train_events))} training events: "
          + "; ".join(f"{side} semantics {eps[side]:g} ({sweep[side][str(eps[side])]:.3f})" for side in eps))
    per_event = found["instances_per_event"]
    print(f"instances per held-out event: {per_event['particles']:.1f} true particles; "
          + "; ".join(f"{labels[name]} {count:.1f}" for name, count in per_event.items() if name != "particles"))
    print(f"detector: {100 * found['mask_recall']:.0f}% of the held-out particles have a query mask at IoU >= "
          f"{detector.task.iou_threshold:g} (what the best post-processing could keep)\n")
    print("| method | " + " | ".join(HEADERS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for name, result in rows.items():
        print(f"| {labels[name]} | " + " | ".join(fmt(result[c]) for c in COLUMNS) + " |")
    print(f"\nper-event differences from {labels['predicted']} on the same held-out events, mean ± standard error "
          "(several standard errors: more than the events' spread)\n")
    print("| difference | " + " | ".join(HEADERS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for name, difference in found["differences"].items():
        print(f"| {labels[name]} minus DBSCAN | " + " | ".join(fmt_difference(difference, c) for c in COLUMNS) + " |")
    print("\npurity / efficiency weighted by points (purity_pooled, efficiency_pooled): "
          + "; ".join(f"{labels[name]} {fmt(result['purity_pooled'])} / {fmt(result['efficiency_pooled'])}"
                      for name, result in rows.items()))
    print_timing(timing)
    if args.out:
        args.out.write_text(json.dumps({
            "settings": vars(args) | {"out": str(args.out)}, "voxels_per_event": points, "training": training,
            "dbscan_radius_selection": sweep, "eps": eps, "rows": {labels[k]: v for k, v in rows.items()},
            "instances_per_event": {"true particles" if k == "particles" else labels[k]: v
                                    for k, v in found["instances_per_event"].items()},
            "detector_mask_recall": found["mask_recall"],
            "differences_from_dbscan_predicted": {labels[k]: v for k, v in found["differences"].items()},
            "timing": timing}, default=float) + "\n")


if __name__ == "__main__":
    sys.exit(main())
