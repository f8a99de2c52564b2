"""`pimm validate-scaling`: the seed page's checklist before a long job, run as real launches.

Every run is `pimm launch` of the same config with the same global batch and seed, plus
`max_steps=K log_every=1 log_event_ids=true parallel.strategy=S` and loader workers on every
rank (pimm.validate.runs). The checks, in stages:

  1  a run at every rank count R: every run exits 0 (1.1); every logged loss is finite (1.2);
     one complete checkpoint (1.3); the same global batches at every step (1.4); per-step
     losses within LOSS_RTOL of the first rank count's (1.5)
  2  from the same runs' provenance: the model's parameter count on every rank, and under
     FSDP2 each rank's shard (2.1); bit-identical parameters on every rank of a replicated run (2.2)
  3  the first rank count's final weights evaluated (validate_only=true) at every R: the same
     events, mIoU within EVAL_MIOU_ATOL, loss within EVAL_LOSS_RTOL (3.1)
  4  a run at the largest R sent SIGUSR1 on its whole process group, as Slurm signals a job,
     exits 75 with a complete checkpoint (4.1); resumed on the same topology it reproduces the
     stage-1 run: event ids, losses, final weights (4.2)
  5  a copy of that checkpoint resumed at the smallest R: the cursor is remapped with nothing
     replayed or skipped, or, where it cannot be mapped, the replay warning is logged and in
     provenance (5.1)

Stages 1 and 2 always run (2 reads the runs of 1); stages 3 to 5 run only when every check
before them passed, since they compare against those runs: a broken setup fails in seconds.
"""

from __future__ import annotations

import math
import shutil
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pimm import __version__
from pimm.checkpoint.layout import LAST, CheckpointError, verify
from pimm.launch.resume import attempts
from pimm.validate.report import write_report
from pimm.validate.runs import (
    Launcher,
    Run,
    final_weights,
    max_relative_difference,
    records,
    step_event_ids,
    train_losses,
)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# float32 sums over events and over ranks' gradients are added in another order at each world size
LOSS_RTOL = 1e-4
EVAL_MIOU_ATOL = 1e-6  # the confusion matrix holds integer counts, all-reduced exactly
EVAL_LOSS_RTOL = 1e-5  # per-event losses summed across ranks in another order
# > 2 ranks: DDP rebuilds its gradient buckets after each process's first step, and gloo's ring
# all-reduce over more than two ranks then adds in another order than the uninterrupted run did
WEIGHTS_ATOL_MANY_RANKS = 1e-6
# on CUDA the scatter-adds of the loss and the model use atomics, whose order varies from run to
# run: a resumed run matches within the cross-rank tolerance, not bit for bit
CUDA_RESUME_LOSS_RTOL, CUDA_RESUME_WEIGHTS_ATOL = LOSS_RTOL, 1e-4
# the signal goes out once step 1 is logged and the ranks agree to stop a step or two later: at step 3,
# or at the last step of a 4-step run when it arrives late (then the run stops there, exit 75 too); a
# signal that comes after the ranks' last agreement leaves a completed run (exit 0), which 4.1 reports
INTERRUPT_AT_STEP = 1
MIN_STEPS = 4
# keys every run sets itself -> the flag that sets them (None: not the user's to set)
CONTROLLED = {"max_steps": "--steps", "log_every": None, "log_event_ids": None, "parallel.strategy": "--strategy",
              "parallel": "--strategy", "validate_only": None}


def run_overrides(overrides: list[str], keys: list[str], ranks: list[int], steps: int, strategy: str) -> list[str]:
    """The overrides of every run: the user's (`keys` are theirs), then the checklist's."""
    checklist = [f"max_steps={steps}", "log_every=1", "log_event_ids=true", f"parallel.strategy={strategy}"]
    if "num_worker" not in keys:  # loader workers on every rank: check 4 signals them too
        checklist.append(f"num_worker={2 * max(ranks)}")
    return [*overrides, *checklist]

CHECKS = {  # id -> (stage, what it checks)
    "1.1": (1, "every run exited 0"),
    "1.2": (1, "every logged train loss is finite"),
    "1.3": (1, "one complete checkpoint written"),
    "1.4": (1, "the same global batches (event ids) at every step and rank count"),
    "1.5": (1, f"per-step losses agree across rank counts (within {LOSS_RTOL:g} relative)"),
    "2.1": (2, "the expected parameter count on every rank (and the FSDP2 shard sizes)"),
    "2.2": (2, "identical parameters on every rank (replicated strategies)"),
    "3.1": (3, "evaluating the same weights gives the same metrics at every rank count"),
    "4.1": (4, "a signal to every process of the job: exit 75 with a complete checkpoint"),
    "4.2": (4, "resumed on the same topology, it reproduces the uninterrupted run"),
    "5.1": (5, "resumed at another rank count: cursor remapped, or the replay warning recorded"),
}


@dataclass
class Check:
    id: str
    status: str
    measured: str  # the numbers, for people
    reason: str = ""  # why it failed or was skipped
    numbers: dict = field(default_factory=dict)

    @property
    def title(self) -> str:
        return CHECKS[self.id][1]


def _check(check_id: str, problems: list[str], measured: str, numbers: dict) -> Check:
    return Check(check_id, FAIL if problems else PASS, measured, "; ".join(problems), numbers)


@dataclass
class Spec:
    """One validation, checked before anything starts (by `pimm validate-scaling`)."""

    config: str
    cfg: dict  # resolved with every run's overrides
    ranks: list[int]
    expected_steps: int  # the optimizer steps a run takes: min(--steps, epochs x steps per epoch)
    strategy: str
    out: Path
    overrides: list[str]  # the user's
    run_overrides: list[str]  # what every run gets: the user's, then the checklist's
    timeout_s: float
    global_batch_size: int


# -- the stages ------------------------------------------------------------------------------


def validate_scaling(spec: Spec, echo: Callable[[str], None] = print) -> dict:
    """Run every stage (see the module docstring), write the report into spec.out; returns it."""
    spec.out.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(spec.config, spec.out, spec.timeout_s, echo)
    started = time.time()
    runs: dict[str, Run] = {}
    checks: list[Check] = []
    stages = ((1, _stage_train), (2, _stage_parameters), (3, _stage_evaluation), (4, _stage_interrupt),
              (5, _stage_other_topology))
    for stage, run_stage in stages:
        failed = [c.id for c in checks if c.status == FAIL]
        if stage >= 3 and failed:
            why = f"not run: check(s) {', '.join(failed)} failed, and this stage compares against those runs"
            checks += [Check(i, SKIP, "", why) for i, (s, _) in CHECKS.items() if s == stage]
            continue
        checks += run_stage(spec, launcher, runs)
    report = _report(spec, checks, runs, time.time() - started)
    write_report(spec.out, report, runs, LOSS_RTOL)
    return report


def _stage_train(spec: Spec, launcher: Launcher, runs: dict[str, Run]) -> list[Check]:
    train = {r: launcher.train(f"train-r{r}", r, spec.run_overrides) for r in spec.ranks}
    runs.update({run.name: run for run in train.values()})
    return [_runs_completed(train), _finite_loss(train), _complete_checkpoint(train, spec.expected_steps),
            _same_batches(train), _loss_agreement(train)]


def _runs_completed(train: dict[int, Run]) -> Check:
    problems = [f"at {r} rank(s) exit {run.returncode}: {run.error()}" for r, run in train.items() if run.returncode]
    measured = ", ".join(f"{r} rank(s): exit {run.returncode} in {run.seconds:.1f} s" for r, run in train.items())
    return _check("1.1", problems, measured, {"exit": {r: run.returncode for r, run in train.items()},
                                              "seconds": {r: round(run.seconds, 2) for r, run in train.items()}})


def _finite_loss(train: dict[int, Run]) -> Check:
    problems, parts, numbers = [], [], {}
    for r, run in train.items():
        losses = train_losses(run.run_dir)
        bad = [(step, value) for step, value in losses.items() if not math.isfinite(value)]
        problems += [f"at {r} rank(s): loss {value} logged at step {step}" for step, value in bad]
        error = (attempts(run.run_dir) or [{}])[-1].get("error") or ""
        if "non-finite" in error:
            problems.append(f"at {r} rank(s): {error.split(' Training stopped')[0]}")
        elif not losses:
            problems.append(f"at {r} rank(s): no train loss was logged ({run.error()})")
        if losses:
            steps = sorted(losses)
            parts.append(f"{r} rank(s): {len(steps)} steps, loss {losses[steps[0]]:.4f} -> {losses[steps[-1]]:.4f}")
        numbers[r] = {"steps_logged": len(losses), "non_finite_steps": [s for s, _ in bad]}
    return _check("1.2", problems, "; ".join(parts), numbers)


def _complete_checkpoint(train: dict[int, Run], expected_steps: int) -> Check:
    problems, numbers = [], {}
    for r, run in train.items():
        ckpt = run.run_dir / "model" / LAST
        if not ckpt.exists():
            problems.append(f"at {r} rank(s): no checkpoint was written ({ckpt} does not exist)")
            continue
        try:
            numbers[r] = step = int(verify(ckpt)["step"])
        except CheckpointError as exc:
            problems.append(f"at {r} rank(s): {exc}")
            continue
        if step != expected_steps:
            problems.append(f"at {r} rank(s): the last complete checkpoint is of step {step}, not {expected_steps}")
    measured = ", ".join(f"{r} rank(s): model/last complete (manifest verified) at step {s}"
                         for r, s in numbers.items())
    return _check("1.3", problems, measured, {"step": numbers, "expected_step": expected_steps})


def _same_batches(train: dict[int, Run]) -> Check:
    (first, ref_run), *others = train.items()
    ref = step_event_ids(ref_run.run_dir)
    problems = [] if ref else [f"at {first} rank(s): no event ids were logged"]
    for r, run in others:
        differing = _differing_steps(step_event_ids(run.run_dir), ref)
        if differing:
            problems.append(f"at {r} rank(s) the event ids differ from {first} rank(s) at step(s) {differing[:5]}")
    events = len(next(iter(ref.values()))) if ref else 0
    measured = f"{len(ref)} steps x {events} events, compared at {', '.join(map(str, train))} rank(s)"
    return _check("1.4", problems, measured, {"steps": len(ref), "events_per_step": events})


def _differing_steps(ids: dict[int, list[int]], ref: dict[int, list[int]]) -> list[int]:
    return [s for s in sorted(ids.keys() | ref.keys()) if ids.get(s) != ref.get(s)]


def _loss_agreement(train: dict[int, Run]) -> Check:
    (first, ref_run), *others = train.items()
    ref = train_losses(ref_run.run_dir)
    problems, worst = [], {}
    for r, run in others:
        losses = train_losses(run.run_dir)
        missing = sorted(ref.keys() ^ losses.keys())
        worst[r] = max_relative_difference(losses, ref) if not missing else math.inf
        if missing:
            problems.append(f"step(s) {missing[:5]} logged at only one of {first} and {r} rank(s)")
        elif not worst[r] <= LOSS_RTOL:
            step = max(ref, key=lambda s: max_relative_difference({s: losses[s]}, {s: ref[s]}))
            problems.append(f"at {r} rank(s) the loss differs from {first} rank(s)' by {worst[r]:.3g} relative "
                            f"(> {LOSS_RTOL:g}), most at step {step}: {losses[step]:.7g} vs {ref[step]:.7g}")
    measured = ", ".join(f"{r} vs {first} rank(s): max relative difference {w:.2e}" for r, w in worst.items())
    return _check("1.5", problems, measured + f" over {len(ref)} steps (tolerance {LOSS_RTOL:g}: float32 "
                  "summation order differs with the world size)", {"max_relative_difference": worst})


def _stage_parameters(spec: Spec, launcher: Launcher, runs: dict[str, Run]) -> list[Check]:
    facts = {}
    for r in spec.ranks:
        run = runs[f"train-r{r}"]
        recorded = (attempts(run.run_dir) or [{}])[-1].get("parameters")
        if run.returncode == 0 and recorded:
            facts[r] = recorded
    return [_parameter_count(spec, facts), _parameters_identical(spec, facts)]


def model_parameter_shapes(model_cfg: dict) -> list[tuple[int, ...]]:
    """The shape of every parameter of the configured model (built on the meta device)."""
    import torch  # deferred: seconds to import; refusing bad input (exit 2) does without

    from pimm.models import build_model  # deferred: as above

    with torch.device("meta"):
        return [tuple(p.shape) for p in build_model(model_cfg).parameters()]


def fsdp2_shard_sizes(shapes: list[tuple[int, ...]], world_size: int) -> list[int]:
    """Elements each rank holds when every parameter is split along dim 0 as torch.chunk splits
    it (FSDP2's Shard(0): chunks of ceil(rows / world size) rows, the last ranks' shorter or empty)."""
    sizes = [0] * world_size
    for shape in shapes:
        rows, per_row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        chunk = -(-rows // world_size)
        for rank in range(world_size):
            sizes[rank] += max(0, min(chunk, rows - rank * chunk)) * per_row
    return sizes


def _sharded(spec: Spec, world_size: int) -> bool:
    return spec.strategy == "fsdp2" and world_size > 1


def _parameter_count(spec: Spec, facts: dict[int, dict]) -> Check:
    if not facts:
        return Check("2.1", SKIP, "", "no run finished and recorded its parameters (see 1.1)")
    shapes = model_parameter_shapes(spec.cfg["model"])
    expected = sum(math.prod(s) for s in shapes)
    problems, parts, numbers = [], [], {"expected_total": expected}
    for r, f in facts.items():
        if f["total"] != expected:
            problems.append(f"at {r} rank(s) the model has {f['total']} parameters, the config's {expected}")
        if _sharded(spec, r):
            shards = fsdp2_shard_sizes(shapes, r)
            deviation = max(abs(n - expected / r) for n in f["local"])
            rounding = sum(math.prod(s[1:]) for s in shapes)  # at most one dim-0 row per parameter
            if sum(f["local"]) != expected or f["local"] != shards:
                problems.append(f"at {r} ranks (fsdp2) the ranks hold {f['local']} (sum {sum(f['local'])}); "
                                f"dim-0 shards of the model are {shards} (sum {expected})")
            parts.append(f"{r} ranks (fsdp2 shards): {f['local']} = expected {shards}, sum {sum(f['local'])}; "
                         f"max |local - total/{r}| {deviation:.1f} <= one row per parameter ({rounding})")
            numbers[r] = {"local": f["local"], "expected_shards": shards, "max_deviation_from_even": deviation}
        else:
            wrong = [(rank, n) for rank, n in enumerate(f["local"]) if n != f["total"]]
            problems += [f"at {r} rank(s) rank {rank} holds {n} of {f['total']} parameters" for rank, n in wrong]
            parts.append(f"{r} rank(s): every rank holds {f['local'][0]}" if not wrong else f"{r}: {f['local']}")
            numbers[r] = {"local": f["local"]}
    return _check("2.1", problems, f"model total {expected} (from the config); " + "; ".join(parts), numbers)


def _parameters_identical(spec: Spec, facts: dict[int, dict]) -> Check:
    replicated = {r: f for r, f in facts.items() if not _sharded(spec, r) and r > 1}
    if not replicated:
        why = ("under fsdp2 every rank holds different shards by design (their sizes are check 2.1)"
               if spec.strategy == "fsdp2" else "no multi-rank run finished (see 1.1)")
        return Check("2.2", SKIP, "", why)
    problems, parts = [], []
    for r, f in replicated.items():
        s0, ss0 = f["checksum"][0]
        for rank, (s, ss) in enumerate(f["checksum"][1:], start=1):
            if (s, ss) != (s0, ss0):
                problems.append(f"at {r} ranks rank {rank}'s parameters differ from rank 0's: sum {s:.10g} vs "
                                f"{s0:.10g}, sum of squares {ss:.10g} vs {ss0:.10g}")
        parts.append(f"{r} ranks: float64 sum {s0:.12g}, sum of squares {ss0:.12g}"
                     + (" on every rank (bit-identical: DDP keeps replicas identical)" if not problems else ""))
    return _check("2.2", problems, "; ".join(parts), {r: f["checksum"] for r, f in replicated.items()})


def _stage_evaluation(spec: Spec, launcher: Launcher, runs: dict[str, Run]) -> list[Check]:
    source = runs[f"train-r{spec.ranks[0]}"].run_dir / "model" / "last" / "weights.pth"
    evals = {r: launcher.train(f"eval-r{r}", r, [*spec.run_overrides, "validate_only=true"], weight=source)
             for r in spec.ranks}
    runs.update({run.name: run for run in evals.values()})
    problems, results, checksums = [], {}, {}
    for r, run in evals.items():
        val = records(run.run_dir, "val")
        if run.returncode or len(val) != 1:
            problems.append(f"at {r} rank(s): exit {run.returncode}, {len(val)} validation record(s): {run.error()}")
            continue
        results[r] = {k: val[0][k] for k in ("events", "miou", "loss", "accuracy")}
        if records(run.run_dir, "train") or (run.run_dir / "model" / "last").exists():
            problems.append(f"at {r} rank(s): validate_only trained or wrote a checkpoint")
        params = (attempts(run.run_dir) or [{}])[-1].get("parameters") or {}
        if not _sharded(spec, r):
            checksums[r] = params.get("checksum")
    if results:
        first, ref = next(iter(results.items()))
        for r, m in results.items():
            if m["events"] != ref["events"]:
                problems.append(f"at {r} rank(s) {m['events']} events were evaluated, at {first} {ref['events']}")
            if not abs(m["miou"] - ref["miou"]) <= EVAL_MIOU_ATOL:
                problems.append(f"at {r} rank(s) mIoU {m['miou']:.9f}, at {first} {ref['miou']:.9f} "
                                f"(tolerance {EVAL_MIOU_ATOL:g})")
            if not abs(m["loss"] - ref["loss"]) <= EVAL_LOSS_RTOL * abs(ref["loss"]):
                problems.append(f"at {r} rank(s) loss {m['loss']:.9f}, at {first} {ref['loss']:.9f} "
                                f"(tolerance {EVAL_LOSS_RTOL:g} relative)")
    sums = {tuple(c) for cs in checksums.values() if cs for c in cs}
    if len(sums) > 1:
        problems.append(f"the evaluated weights differ between ranks or rank counts (checksums {sorted(sums)})")
    measured = "; ".join(f"{r} rank(s): {m['events']} events, mIoU {m['miou']:.6f}, loss {m['loss']:.6f}, "
                         f"accuracy {m['accuracy']:.6f}" for r, m in results.items())
    measured += (f" (weights of {source.parent.parent.parent.name}/model/last; tolerances: mIoU {EVAL_MIOU_ATOL:g} "
                 f"absolute, the confusion matrix is all-reduced exactly; loss {EVAL_LOSS_RTOL:g} relative)")
    compared = [r for r, cs in checksums.items() if cs]
    if len(sums) == 1 and sum(len(checksums[r]) for r in compared) > 1:
        measured += f"; the same weights on every rank at {', '.join(map(str, compared))} rank(s) (checksum)"
    return [_check("3.1", problems, measured, {"metrics": results, "weights": str(source)})]


def _stage_interrupt(spec: Spec, launcher: Launcher, runs: dict[str, Run]) -> list[Check]:
    world = max(spec.ranks)
    run = launcher.interrupt(f"interrupt-r{world}", world, spec.run_overrides, INTERRUPT_AT_STEP, signal.SIGUSR1)
    runs[run.name] = run
    first = (attempts(run.run_dir) or [{}])[0]
    numbers = {"world_size": world, "signal_at_step": run.signal_step, "exit": run.returncode,
               "workers_per_rank": first.get("workers_per_rank")}
    problems = []
    if run.signal_step is None:
        problems.append(f"the run ended (exit {run.returncode}) before it logged step {INTERRUPT_AT_STEP}: "
                        + ("raise --steps" if run.returncode == 0 else run.error()))
    elif run.returncode == 0:
        problems.append(f"the run finished all {spec.expected_steps} steps before the signal (sent at step "
                        f"{run.signal_step}) took effect: raise --steps")
    elif run.returncode != 75:
        problems.append(f"exit {run.returncode}, not 75 (stopped with a checkpoint): {run.error()}")
    else:
        try:
            numbers["checkpoint_step"] = int(verify(run.run_dir / "model" / "last")["step"])
        except CheckpointError as exc:
            problems.append(str(exc))
        if first.get("outcome") != "interrupted by SIGUSR1":
            problems.append(f"provenance outcome {first.get('outcome')!r}, not 'interrupted by SIGUSR1'")
    measured = (f"SIGUSR1 to the whole process group of a {world}-rank job at step {run.signal_step} "
                f"({numbers['workers_per_rank']} loader worker(s) per rank): exit {run.returncode}")
    if "checkpoint_step" in numbers:
        measured += f", complete checkpoint (manifest verified) at step {numbers['checkpoint_step']}"
    interrupted = _check("4.1", problems, measured, numbers)
    if problems:
        return [interrupted, Check("4.2", SKIP, "", "nothing to resume: 4.1 failed")]
    shutil.copytree(run.run_dir, launcher.run_dir(_other_topology_name(spec)), symlinks=True)  # for stage 5
    resumed = launcher.resume(f"resume-r{world}", run.run_dir, world)
    runs[resumed.name] = resumed
    return [interrupted, _resume_same_topology(resumed, runs[f"train-r{world}"], numbers["checkpoint_step"])]


def _other_topology_name(spec: Spec) -> str:
    return f"remap-r{max(spec.ranks)}-to-r{min(spec.ranks)}"


def _resume_same_topology(resumed: Run, reference: Run, from_step: int) -> Check:
    world = resumed.world_size
    problems = []
    if resumed.returncode:
        return _check("4.2", [f"the resume exited {resumed.returncode}: {resumed.error()}"], "", {})
    last = attempts(resumed.run_dir)[-1]
    cursor, cuda = last.get("cursor"), last.get("device_type") == "cuda"
    if cursor != "restored":
        problems.append(f"cursor {cursor!r}, not 'restored' (same topology)")
    ids, ref_ids = step_event_ids(resumed.run_dir), step_event_ids(reference.run_dir)
    differing = _differing_steps(ids, ref_ids)
    if differing:
        problems.append(f"event ids differ from the uninterrupted run at step(s) {differing[:5]}")
    losses, ref_losses = train_losses(resumed.run_dir), train_losses(reference.run_dir)
    loss_diff = max((abs(losses.get(s, math.inf) - v) for s, v in ref_losses.items()), default=math.inf)
    loss_rel = max_relative_difference(losses, ref_losses)
    if losses.keys() != ref_losses.keys() or (losses != ref_losses and not cuda):
        problems.append(f"losses differ from the uninterrupted run (max |difference| {loss_diff:.3g})")
    elif cuda and not loss_rel <= CUDA_RESUME_LOSS_RTOL:
        problems.append(f"losses differ from the uninterrupted run by {loss_rel:.3g} relative "
                        f"(> {CUDA_RESUME_LOSS_RTOL:g} on CUDA)")
    weights, ref_weights = final_weights(resumed.run_dir), final_weights(reference.run_dir)
    weight_diff = math.inf if weights.keys() != ref_weights.keys() else max(
        float((weights[k].double() - ref_weights[k].double()).abs().max()) for k in weights)
    tolerance, why = _resume_weight_tolerance(world, cuda)
    if not weight_diff <= tolerance:
        problems.append(f"final weights differ from the uninterrupted run by {weight_diff:.3g} (allowed: {why})")
    how = "bit-identical" if weight_diff == 0 else f"max |difference| {weight_diff:.2e} ({why})"
    measured = (f"resumed at step {from_step} on {world} ranks (cursor {cursor}): event ids of {len(ref_ids)} steps "
                f"{'identical' if not differing else 'DIFFERENT'}, losses "
                f"{'identical' if losses == ref_losses else 'within tolerance' if not problems else 'DIFFERENT'} "
                f"(max |difference| {loss_diff:.2g}), "
                f"final weights {how}")
    return _check("4.2", problems, measured, {"start_step": from_step, "cursor": cursor,
                                              "max_loss_difference": loss_diff, "max_weight_difference": weight_diff})


def _resume_weight_tolerance(world_size: int, cuda: bool) -> tuple[float, str]:
    """(largest |difference| allowed, why) between a resumed run's final weights and the uninterrupted run's."""
    if cuda:
        return CUDA_RESUME_WEIGHTS_ATOL, (f"<= {CUDA_RESUME_WEIGHTS_ATOL:g} on CUDA, whose atomic adds run in a "
                                          "varying order")
    if world_size <= 2:
        return 0.0, "none: on CPU at <= 2 ranks a resume is bit-identical"
    return WEIGHTS_ATOL_MANY_RANKS, (f"<= {WEIGHTS_ATOL_MANY_RANKS:g} at > 2 ranks: DDP rebuilds its gradient buckets "
                                     "after each process's first step and gloo's ring then adds in another order")


def _stage_other_topology(spec: Spec, launcher: Launcher, runs: dict[str, Run]) -> list[Check]:
    before, after = max(spec.ranks), min(spec.ranks)
    copy = launcher.run_dir(_other_topology_name(spec))
    run = launcher.resume(_other_topology_name(spec), copy, after)
    runs[run.name] = run
    if run.returncode:
        return [_check("5.1", [f"the resume exited {run.returncode}: {run.error()}"], "", {})]
    attempt = attempts(copy)[-1]
    cursor = attempt.get("cursor")
    reference = runs[f"train-r{after}"].run_dir
    problems = []
    loss_diff = max_relative_difference(train_losses(copy), train_losses(reference))
    numbers = {"cursor": cursor, "from_world_size": before, "to_world_size": attempt.get("world_size"),
               "start_step": attempt.get("start_step"), "max_relative_loss_difference": loss_diff}
    if cursor == "remapped":
        differing = _differing_steps(step_event_ids(copy), step_event_ids(reference))
        if differing:
            problems.append(f"cursor remapped but the event ids differ from the uninterrupted run at step(s) "
                            f"{differing[:5]} (events replayed or skipped)")
        recorded = (f"recorded as 'remapped': every step's event ids equal the uninterrupted run's (nothing "
                    f"replayed or skipped); losses within {loss_diff:.2e} relative of the {after}-rank run")
    elif cursor == "epoch_restarted":
        warning = attempt.get("replay_warning") or ""
        if "seen twice" not in warning:
            problems.append("cursor epoch_restarted but provenance has no replay_warning")
        if "seen twice" not in run.log_text():
            problems.append("cursor epoch_restarted but the replay warning is not in the log")
        recorded = f"recorded as 'epoch_restarted' with the replay warning in the log and provenance: {warning}"
    else:
        problems.append(f"cursor {cursor!r}: expected 'remapped' (or 'epoch_restarted' with the replay warning)")
        recorded = f"cursor {cursor!r}"
    measured = f"checkpoint of step {attempt.get('start_step')} at {before} ranks resumed at {after}: {recorded}"
    return [_check("5.1", problems, measured, numbers)]


# -- the report's content ----------------------------------------------------------------------


def throughput(spec: Spec, runs: dict[str, Run]) -> list[dict]:
    """Per rank count: the median events/s of the train steps after the first (which pays the
    start-up), and the scaling efficiency against the smallest rank count R0:
    throughput_R / ((R / R0) x throughput_R0), that is throughput_R / (R x throughput_1) when R0 = 1."""
    rows = []
    for r in spec.ranks:
        rates = [rec["events_per_s"] for rec in records(runs[f"train-r{r}"].run_dir, "train") if rec["step"] > 1]
        rows.append({"world_size": r, "events_per_s": statistics.median(rates) if rates else None})
    base = rows[0]
    for row in rows:
        ok = row["events_per_s"] and base["events_per_s"]
        row["efficiency"] = (row["events_per_s"] / (row["world_size"] / base["world_size"] * base["events_per_s"])
                             if ok else None)
    return rows


def provenance_summary(runs: dict[str, Run]) -> list[dict]:
    """One row per attempt of every run directory: what a reader needs to trust the comparison."""
    rows, seen = [], set()
    for run in runs.values():
        if run.run_dir in seen:
            continue
        seen.add(run.run_dir)
        for a in attempts(run.run_dir):
            rows.append({
                "run": run.run_dir.name, "attempt": a.get("attempt"), "world_size": a.get("world_size"),
                "strategy": a.get("strategy"), "validate_only": a.get("validate_only"),
                "config_hash": a.get("config_hash"),
                "data_hash": ((a.get("data") or {}).get("train") or {}).get("content_hash"),
                "cursor": a.get("cursor"), "start_step": a.get("start_step"), "outcome": a.get("outcome"),
                "replay_warning": a.get("replay_warning"),
            })
    return rows


def _report(spec: Spec, checks: list[Check], runs: dict[str, Run], seconds: float) -> dict:
    verdict = FAIL if any(c.status == FAIL for c in checks) else PASS
    return {
        "verdict": verdict,
        "config": spec.config,
        "ranks": spec.ranks,
        "steps": spec.expected_steps,
        "strategy": spec.strategy,
        "global_batch_size": spec.global_batch_size,
        "seed": spec.cfg["seed"],
        "overrides": spec.overrides,
        "run_overrides": spec.run_overrides,
        "pimm_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(seconds, 1),
        "checks": [{**asdict(c), "title": c.title, "stage": CHECKS[c.id][0]} for c in checks],
        "throughput": throughput(spec, runs) if all(f"train-r{r}" in runs for r in spec.ranks) else [],
        "runs": [{"name": r.name, "world_size": r.world_size, "run_dir": str(r.run_dir), "exit": r.returncode,
                  "seconds": round(r.seconds, 2)} for r in runs.values()],
        "provenance": provenance_summary(runs),
    }
