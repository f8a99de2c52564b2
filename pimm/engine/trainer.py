"""The training loop: one readable `Trainer` over a plain model and a strategy.

Global batch semantics: each optimizer step consumes one global batch of `batch_size` events,
split evenly over ranks, and on each rank into `grad_accum_steps` micro-batches. The task
(pimm.tasks) makes each micro-batch's loss a mean over its events, so the gradient (micro-steps
summed, averaged over ranks by the strategy) is the same at any world size and accumulation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pimm.checkpoint.layout import BEST, BEST_RECORD, CheckpointError, sha256_file
from pimm.checkpoint.manager import CheckpointManager
from pimm.checkpoint.state import capture, checkpoint_components, cursor_facts, restore
from pimm.checkpoint.weights import load_pretrained, save, save_weight_file
from pimm.config import config_hash
from pimm.config.validate import model_classes
from pimm.data.collate import collate_events, split_events
from pimm.data.dataset import build_dataset
from pimm.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from pimm.distributed.batch import plan_batches
from pimm.distributed.env import DistEnv, all_gather_objects, all_reduce_sum, barrier
from pimm.distributed.strategy import build_strategy
from pimm.engine.evaluation import evaluate_events, to_device
from pimm.engine.logs import MetricsWriter, TensorBoardScalars, WandbScalars
from pimm.engine.optim import (
    WeightDecaySchedule,
    build_optimizer,
    build_scheduler,
    freeze_parameters,
    group_facts,
    optimizer_implementation,
    parameter_groups,
)
from pimm.engine.plot import plot_metrics
from pimm.errors import EXIT_CHECKPOINTED, EXIT_FAILED, ConfigError, TrainingError
from pimm.files import atomic_path, write_atomic
from pimm.json_io import dumps, nonfinite_keys
from pimm.models import build_model
from pimm.models.sparse_conv import apply_backends
from pimm.provenance import Provenance
from pimm.signals import StopRequest, ignore_further_stop_signals, ignore_stop_signals, loader_workers_forked
from pimm.tasks import build_task

log = logging.getLogger("pimm")


@dataclass
class TrainState:
    """Where training stands; with the weights and optimizer this is everything a resume needs."""

    epoch: int = 0  # the epoch in progress (0-based)
    samples_in_epoch: int = 0  # global events consumed so far in that epoch (the data cursor)
    step: int = 0  # optimizer steps taken since the start of the run
    best_metric: float = -math.inf  # the best value of the task's best_metric so far (-inf: none yet)


class Interrupted(Exception):
    """Training stopped on request (signal) after writing a complete checkpoint."""


class Trainer:
    """Builds data, model, strategy and optimizer from a resolved config and runs epochs."""

    def __init__(self, cfg: dict, run_dir: Path, env: DistEnv, stop: StopRequest | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.env = env
        self.plan = plan_batches(cfg, env.world_size)
        self.seed = int(cfg["seed"])
        self.state = TrainState()

        self.train_set = build_dataset(cfg["data"]["train"], seed=self.seed)
        self.val_set = build_dataset(cfg["data"]["val"], seed=self.seed) if cfg["data"].get("val") else None
        self.sampler = GlobalBatchSampler(
            len(self.train_set), self.plan.global_batch_size, env.world_size, env.rank, self.seed
        )
        self.train_loader = self._loader(self.train_set, self.sampler)
        self.steps_per_epoch = self.sampler.steps_per_epoch
        # the LR schedule always spans every epoch; max_steps only stops early (and resumes cleanly)
        schedule_steps = self.steps_per_epoch * int(cfg["epochs"])
        self.total_steps = min(schedule_steps, int(cfg["max_steps"])) if cfg.get("max_steps") else schedule_steps

        # identical initial weights on every rank and at every world size
        torch.manual_seed(self.seed)
        self.model = build_model(cfg["model"])
        self.backends = apply_backends(self.model, cfg, env.device)
        if self.backends and env.is_main:
            log.info("backends: %s", ", ".join(f"{k} {v}" for k, v in self.backends.items()))
        # frozen before the wrap: DDP and FSDP2 then leave them out of gradient reduction
        self.frozen = freeze_parameters(self.model, cfg.get("freeze"))
        self.task = build_task(cfg)
        self.strategy = build_strategy(cfg, env)
        self.module = self.strategy.wrap(self.model, env)
        # modules whose training randomness is keyed by the optimizer step (PointTransformer)
        self._step_listeners = [m.begin_optimizer_step for m in self.model.modules()
                                if hasattr(m, "begin_optimizer_step")]
        groups = parameter_groups(self.strategy.eval_module(self.module).named_parameters(), cfg["optimizer"],
                                  cfg.get("param_groups"))
        self.optimizer = build_optimizer(cfg["optimizer"], groups)
        self.optimizer_groups = group_facts(self.optimizer, cfg["optimizer"].get("lr", 1e-3))
        for g in self.optimizer_groups:
            log.info("optimizer group %s: %d tensors (%d elements), lr %.3g, weight_decay %s; %d tensors frozen",
                     g["params"], g["tensors"], g["elements"], g["lr"], g["weight_decay"], len(self.frozen))
        self.scheduler = build_scheduler(cfg.get("scheduler"), self.optimizer, schedule_steps)
        self.weight_decay = (WeightDecaySchedule(cfg["weight_decay_schedule"], self.optimizer, schedule_steps)
                             if cfg.get("weight_decay_schedule") else None)
        self._seed_rank_streams()

        amp = cfg.get("amp") or {}
        self.autocast = bool(amp.get("enabled", False)) and env.device.type == "cuda"
        self.autocast_dtype = getattr(torch, amp.get("dtype", "bfloat16"))
        if amp.get("enabled") and not self.autocast:
            log.info("amp: autocast is CUDA-only; training in float32 on %s", env.device.type)
        self.clip_grad = cfg.get("clip_grad")
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl" if env.is_main else None,
                                     self._scalar_sinks(cfg, run_dir) if env.is_main else [])
        self.event_log = (
            open(run_dir / "logs" / f"event_ids_rank{env.rank}.jsonl", "a", encoding="utf-8")
            if cfg.get("log_event_ids")
            else None
        )
        debug = cfg.get("debug") or {}
        self._nonfinite_at = debug.get("nonfinite_loss_at_step")
        self._interrupt_at = debug.get("interrupt_at_step")
        self._desync_params = bool(debug.get("desync_rank_params"))
        self.validate_only = bool(cfg.get("validate_only"))
        self.checkpoints = CheckpointManager(
            run_dir / "model", env.rank, env.world_size,
            keep_last=int(cfg["checkpoint_keep_last"]), async_save=bool(cfg["checkpoint_async"]),
            kill_during_save_at_step=debug.get("kill_during_checkpoint_at_step"),
            kill_after_manifest_at_step=debug.get("kill_after_checkpoint_manifest_at_step"),
        )
        # model, optimizer, scheduler, progress and RNG, handed to the checkpoint as stateful objects
        self.checkpoint_components = checkpoint_components(self)
        self.checkpoint_every = cfg.get("checkpoint_every_n_steps")
        self.eval_every_n_steps = int(cfg.get("eval_every_n_steps") or 0)  # 0: at epoch ends only
        self.stop = stop or StopRequest()
        if env.distributed and env.device.type != "cpu":
            # stop flags on a CPU group of their own: reading one never syncs the device (on CPU
            # the default gloo group already is one, and a second group costs 2-rank throughput)
            self.stop.use_group(torch.distributed.new_group(backend="gloo"))
        self.provenance = Provenance(run_dir, env.is_main)

    # -- setup -----------------------------------------------------------------------------

    def _loader(self, dataset, batch_sampler) -> torch.utils.data.DataLoader:
        workers = self.plan.workers_per_rank
        return torch.utils.data.DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=workers,
            collate_fn=collate_events,
            worker_init_fn=ignore_stop_signals if workers > 0 else None,
            pin_memory=self.env.device.type == "cuda",
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers > 0 else None,
        )

    def _seed_rank_streams(self) -> None:
        """Per-rank streams (dropout, anything unkeyed) derived from the one global seed."""
        rank_seed = self.seed + 1_000_003 * self.env.rank
        torch.manual_seed(rank_seed)
        np.random.seed(rank_seed % 2**32)
        random.seed(rank_seed)

    @staticmethod
    def _scalar_sinks(cfg: dict, run_dir: Path) -> list:
        """Rank 0's optional scalar sinks for the metrics records: TensorBoard, W&B (offline)."""
        names = model_classes(cfg)[1]
        sinks: list = []
        if (cfg.get("tensorboard") or {}).get("enabled"):
            sinks.append(TensorBoardScalars(run_dir / "tensorboard", names))
        wandb = cfg.get("wandb") or {}
        if wandb.get("enabled"):
            sinks.append(WandbScalars(run_dir, wandb, cfg, names))
        return sinks

    def describe(self) -> None:
        p = self.plan
        log.info(
            "world size %d (%d per node), strategy %s, device %s",
            p.world_size, self.env.local_world_size, self.strategy.name, self.env.device,
        )
        log.info(
            "global batch %d = %d events/rank (%d micro-batch(es) of %d); val %d/rank; workers %d/rank (global %d)",
            p.global_batch_size, p.events_per_rank, p.grad_accum_steps, p.micro_batch_per_rank,
            p.val_events_per_rank, p.workers_per_rank, p.global_workers,
        )
        if self.validate_only:
            log.info("validate_only: data.val is evaluated once with the given weights; nothing is trained "
                     "(a finished run's checkpoints: `pimm test --run-dir RUN --split val`)")
        else:
            log.info(
                "train events %d -> %d optimizer steps/epoch (last %d events of each epoch's order dropped), "
                "%d steps total",
                len(self.train_set), self.steps_per_epoch, len(self.train_set) % p.global_batch_size,
                self.total_steps,
            )
        n_params = sum(t.numel() for t in self.model.parameters())
        log.info("model %s: %.2fM parameters", self.cfg["model"]["type"], n_params / 1e6)

    # -- loop ------------------------------------------------------------------------------

    def fit(self, resume: bool = False, weight: str | None = None) -> dict:
        """Train to the end (resuming or warm-starting first); returns the final validation metrics.

        Raises Interrupted after a stop request once a complete checkpoint is on disk."""
        self.stop.install()
        self.provenance.start(**self._provenance_facts())
        exit_code = EXIT_FAILED  # the attempt's, for the metric sinks (W&B records it)
        try:
            if self.validate_only and not (weight or (self.cfg.get("pretrained") or {}).get("path")):
                raise ConfigError("validate_only=true evaluates given weights and trains nothing: pass "
                                  "--train.weight PATH or set pretrained.path (weights.pth, model_best.pth, a "
                                  "checkpoint or export directory)")
            resumed_from, cursor = self._start(resume, weight)
            self.provenance.update(**self._start_facts(resumed_from, cursor))
            if self._desync_params:
                self._desync_rank1_parameters()
            self.describe()
            final = self._validate_once() if self.validate_only else self._fit_loop()
            exit_code = 0
        except Interrupted:
            self.provenance.end(f"interrupted by {self.stop.signal_name}", checkpoint_step=self.state.step)
            exit_code = EXIT_CHECKPOINTED
            raise
        except TrainingError as exc:  # raised on every rank alike: let the write in flight finish
            self.checkpoints.wait()
            self.provenance.end("failed", error=str(exc)[:2000])
            raise
        except BaseException as exc:
            self.provenance.end("failed", error=f"{type(exc).__name__}: {exc}"[:2000])
            raise
        finally:
            self._stop_loader_workers()
            self.metrics.close(exit_code)  # the worker leaves with os._exit: end the sinks' threads first
        self.provenance.end("completed", final_step=self.state.step, final_val=final)
        return final

    def _stop_loader_workers(self) -> None:
        """End the persistent loader workers now. They ignore stop signals (pimm.signals), so the
        interpreter's exit, which terminates them with SIGTERM and joins, would wait forever."""
        self.train_loader._iterator = None  # the only reference: its __del__ shuts the workers down

    def _fit_loop(self) -> dict:
        epochs = int(self.cfg["epochs"])
        final: dict = {}
        if self.state.step >= self.total_steps and self.val_set is not None:
            # resumed from a stop on the last step (the ranks agreed on it before the run's end): what
            # is left is the end of the run, its final validation and the checkpoint that records it
            final = self.evaluate()
            self._save_best(final)
            self.checkpoints.last_saved_step = None  # the same step again, now with the final best value
            self.save_checkpoint()
        while self.state.epoch < epochs and self.state.step < self.total_steps:
            self.sampler.set_cursor(self.state.epoch, self.state.samples_in_epoch)
            self._train_epoch()
            if self.state.samples_in_epoch >= self.steps_per_epoch * self.plan.global_batch_size:
                self.state.epoch += 1
                self.state.samples_in_epoch = 0
            last = self.state.epoch >= epochs or self.state.step >= self.total_steps
            epoch_end_validation = last or self.state.epoch % int(self.cfg["eval_every_epochs"]) == 0
            if self.val_set is not None and (epoch_end_validation or self._validates_at(self.state.step)):
                final = self.evaluate()
                self._save_best(final)
            self.save_checkpoint()
            if not last and self.stop.agreed_now():  # a signal during validation or the epoch's end
                self._stop_with_checkpoint()
        self.stop.drain()
        self.provenance.update(parameters=self._parameter_facts())
        self.checkpoints.wait()
        self.metrics.close()
        if self.env.is_main:
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plot.png", self.task.best_metric)
            self._write_summary(final)
        barrier()
        return final

    def _validate_once(self) -> dict:
        """validate_only: evaluate the warm-started weights once; nothing is trained or checkpointed."""
        if self.val_set is None:
            raise ConfigError("validate_only=true needs a validation set: set data.val.path")
        final = self.evaluate()
        self.provenance.update(parameters=self._parameter_facts())
        self.metrics.close()
        if self.env.is_main:
            self._write_summary(final)
        barrier()
        return final

    @torch.no_grad()
    def _parameter_facts(self) -> dict:
        """What every rank holds of the parameters (a collective: every rank calls it): the model's
        element count, each rank's local element count (a DTensor's local shard) and a checksum of
        those elements (float64 sum and sum of squares), in rank order."""
        total, held, total_sum, total_squares = 0, 0, 0.0, 0.0
        for p in self.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            values = local.detach().double()
            total += p.numel()  # a DTensor's numel is the global one
            held += local.numel()
            total_sum += float(values.sum())
            total_squares += float(values.square().sum())
        ranks = all_gather_objects([held, total_sum, total_squares])
        return {"total": total, "local": [r[0] for r in ranks], "checksum": [r[1:] for r in ranks]}

    @torch.no_grad()
    def _desync_rank1_parameters(self) -> None:
        """debug.desync_rank_params: rank 1 shifts its parameters after the wrap (so after DDP's
        initial broadcast) and the start: replicas that differ, which validate-scaling must catch."""
        if self.env.rank != 1:
            return
        for p in self.module.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).add_(1e-3)
        log.warning("debug.desync_rank_params: rank 1's parameters shifted by +1e-3")

    # -- start: fresh, warm start, or resume -----------------------------------------------

    def _start(self, resume: bool, weight: str | None) -> tuple[str | None, str]:
        """Returns (what the run started from, cursor outcome). A resume (also after a torchrun
        restart) continues from the newest usable checkpoint; without one, a warm start (`weight`)
        loads its weights, so a restart before the first checkpoint keeps the warm start."""
        frozen_elements = sum(p.numel() for n, p in self.model.named_parameters() if n in set(self.frozen))
        self.provenance.update(frozen={"tensors": len(self.frozen), "elements": frozen_elements},
                               optimizer_groups=self.optimizer_groups)
        # rank 0 finishes interrupted writes and lists; every rank then tries the same list in order
        found = self.checkpoints.resume_candidates() if resume else []
        if not found:
            if resume:
                self._truncate_logs_after(0)  # an attempt that died before its first checkpoint is redone
            pretrained = self.cfg.get("pretrained") or {}
            weight = weight or pretrained.get("path")
            if weight:
                self._warm_start(weight, pretrained)
                return str(weight), "fresh"
            if resume:
                log.warning("resume: no checkpoint in %s yet; starting from step 0", self.run_dir / "model")
            return None, "fresh"
        strict = bool(self.cfg.get("resume_strict_state", True))
        problems = []
        bad = []
        for ckpt in found:
            try:
                cursor = restore(self.checkpoint_components, ckpt, self.env, self.checkpoints.group,
                                 cursor_facts(self.plan, self.train_set, self.env), strict)
            except CheckpointError as exc:
                problems.append(str(exc))
                bad.append(ckpt.path)
                log.error("%s", exc)
                if ckpt is not found[-1]:
                    log.warning("falling back to the next older complete checkpoint")
                continue
            log.info(
                "resumed from %s (step %d, epoch %d, %d events into the epoch; cursor %s)",
                ckpt.path, self.state.step, self.state.epoch + 1, self.state.samples_in_epoch, cursor,
            )
            self.checkpoints.set_aside(bad)
            self._truncate_logs_after(self.state.step)  # ends with a barrier
            self.checkpoints.last_saved_step = self.state.step
            return str(ckpt.path), cursor
        raise CheckpointError("no usable checkpoint: " + " | ".join(problems))

    def _warm_start(self, weight: str, pretrained: dict) -> None:
        """Load the weights at `weight` (pretrained.key_map, skip, strict); the entries a partial
        load leaves out keep this run's initial values (gathered whole on every rank)."""
        own = self.strategy.eval_module(self.module).state_dict()
        match = load_pretrained(weight, {k: v.shape for k, v in own.items()}, self.cfg["model"], pretrained)
        kept = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()  # DTensor: a collective
                for k, v in own.items() if k not in match.loaded}
        self.strategy.load_full_model_state(self.module, {**kept, **match.loaded})
        self.provenance.update(pretrained=match.facts())
        log.info("warm start: %s (optimizer, schedule and data order start fresh)", match.summary())

    def _truncate_logs_after(self, step: int) -> None:
        """Drop records of steps after the checkpoint (they are redone), so logs read as one run."""
        if self.env.is_main:
            self.metrics.continue_after(step)
            for path in sorted((self.run_dir / "logs").glob("event_ids_rank*.jsonl")):
                if path.exists():
                    keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
                    # in place, not renamed over: this rank's event log is open for appending
                    path.write_text("".join(ln + "\n" for ln in keep))
        barrier()

    def _provenance_facts(self) -> dict:
        data = {
            split: {k: dataset.info[k] for k in ("path", "size_bytes", "num_events", "content_hash")}
            for split, dataset in (("train", self.train_set), ("val", self.val_set))
            if dataset is not None
        }
        return {
            "device_type": self.env.device.type,
            "host_allocator": self.strategy.host_allocator,
            "backends": self.backends,
            "world_size": self.env.world_size,
            "nodes": self.env.world_size // self.env.local_world_size,
            "processes_per_node": self.env.local_world_size,
            "workers_per_rank": self.plan.workers_per_rank,
            "global_batch_size": self.plan.global_batch_size,
            "strategy": self.strategy.name,
            "validate_only": self.validate_only,
            "config_hash": config_hash(self.cfg),
            "data": data,
            "launch": self._launch_facts(),
        }

    def _launch_facts(self) -> dict:
        """What `pimm launch` was asked for this time (overrides, resume and what it changed)."""
        try:
            launch = json.loads((self.run_dir / "launch.json").read_text())
        except (OSError, ValueError):
            return {}
        return {k: launch.get(k) for k in ("overrides", "resumed", "resume_changes", "nproc_per_node", "nnodes")}

    def _start_facts(self, resumed_from: str | None, cursor: str) -> dict:
        facts = {"resumed_from": resumed_from, "start_step": self.state.step, "cursor": cursor,
                 "optimizer_implementation": optimizer_implementation(self.optimizer)}
        if cursor == "epoch_restarted":
            facts["replay_warning"] = (
                f"the data cursor could not be mapped: epoch {self.state.epoch + 1} restarted, so events of that "
                "epoch consumed before the checkpoint may be seen twice"
            )
        return facts

    def _train_epoch(self) -> None:
        self.module.train()
        log_every = int(self.cfg["log_every"])
        # (sum of step losses, steps), kept on the device: no host sync per step
        window_loss = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        window_start = time.perf_counter()
        progress = self._progress()
        with loader_workers_forked():
            batches = iter(self.train_loader)
        for batch in batches:
            if self.event_log is not None:
                self._record_event_ids(batch)
            loss = self._train_step(batch)
            self.state.step += 1
            self.state.samples_in_epoch += self.plan.global_batch_size
            window_loss[0] += loss.double()
            window_loss[1] += 1
            if progress is not None:
                progress.update(1)
            if self.state.step % log_every == 0 or self.state.step >= self.total_steps:
                self._log_train(window_loss, time.perf_counter() - window_start, progress)
                window_loss.zero_()
                window_start = time.perf_counter()
            if self._validates_mid_epoch():
                self._save_best(self.evaluate())
                self.save_checkpoint()  # a stop right after this validation loses nothing
                self.module.train()
            elif self.checkpoint_every and self.state.step % int(self.checkpoint_every) == 0:
                self.save_checkpoint()
            if self.stop.agreed() or self._interrupt_at == self.state.step:
                if progress is not None:
                    progress.close()
                self._stop_with_checkpoint()
            if self.state.step >= self.total_steps:
                break
        if progress is not None:
            progress.close()

    def _validates_at(self, step: int) -> bool:
        """eval_every_n_steps: a validation after every N-th optimizer step (fixed by the step alone,
        so the same steps at any world size and across resumes)."""
        return bool(self.eval_every_n_steps) and self.val_set is not None and step % self.eval_every_n_steps == 0

    def _validates_mid_epoch(self) -> bool:
        """Validate now, inside the epoch? The epoch's and the run's last step validate at the
        epoch's end (_fit_loop), once."""
        epoch_done = self.state.samples_in_epoch >= self.steps_per_epoch * self.plan.global_batch_size
        return self._validates_at(self.state.step) and not epoch_done and self.state.step < self.total_steps

    def _stop_with_checkpoint(self) -> None:
        """Every rank at the same step: write a complete checkpoint, wait until rank 0 has promoted
        it (no rank may exit earlier: torchrun would take that exit for a failure and kill the
        others mid-write), then raise Interrupted."""
        self.stop.drain()
        reason = self.stop.signal_name or "debug.interrupt_at_step"
        self.stop.signal_name = reason
        log.warning("stop requested (%s): writing a checkpoint at step %d", reason, self.state.step)
        self.save_checkpoint(blocking=True)
        barrier()
        ignore_further_stop_signals()  # the checkpoint is complete; repeats must not cut the exit short
        raise Interrupted(reason)

    def _train_step(self, batch: dict) -> torch.Tensor:
        """One optimizer step on this rank's events of the global batch, run as `grad_accum_steps`
        micro-batches of consecutive events; returns the rank's mean event loss (detached)."""
        device = self.env.device
        accum = self.plan.grad_accum_steps
        step_loss = torch.zeros((), device=device)
        self.optimizer.zero_grad(set_to_none=True)
        for announce in self._step_listeners:  # every micro-batch of the step draws the step's randomness
            announce(self.state.step + 1)
        self.task.begin_step(self.state.step + 1, self.total_steps)
        model = self.strategy.eval_module(self.module)
        for i, micro in enumerate(self.task.prepare_step(model, split_events(batch, accum), device)):
            # gradients are reduced across ranks once per step: in the last micro-step's backward
            with self.strategy.no_gradient_sync(self.module) if i < accum - 1 else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast):
                    loss = self.task.forward_loss(self.module, to_device(micro, device)).loss
                loss = loss / accum  # equal micro-batches: the sum over micro-steps is the mean over events
                if self._nonfinite_at == self.state.step + 1 and self.env.is_main:
                    loss = loss * float("nan")  # fault injection for the non-finite guard (tests)
                loss.backward()
            step_loss += loss.detach()
        # the norm is computed after the gradient all-reduce, so every rank sees the same value
        grad_norm = self.strategy.clip_grad_norm(self.module, self.clip_grad or math.inf)
        if not torch.isfinite(grad_norm):
            self._stop_nonfinite(step_loss, grad_norm)
        if self.weight_decay is not None:
            self.weight_decay.apply(self.optimizer, self.state.step + 1)
        self.optimizer.step()
        self.task.after_optimizer_step(model)
        self.scheduler.step()
        return step_loss

    def _stop_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        step = self.state.step + 1
        last_good = self.run_dir / "model" / "last"
        where = f"the last good weights are in {last_good}" if (last_good / ".complete").exists() else (
            "no checkpoint had been written yet"
        )
        raise TrainingError(
            f"non-finite loss at step {step} (epoch {self.state.epoch + 1}): loss={float(loss.detach()):.4g}, "
            f"grad norm={float(grad_norm):.4g}. Training stopped before the optimizer step; {where}. "
            "Lower the learning rate, enable clip_grad, or check the data."
        )

    def _log_train(self, window_loss: torch.Tensor, elapsed: float, progress) -> None:
        all_reduce_sum(window_loss)  # every rank holds the same number of events: mean of ranks is exact
        loss = float(window_loss[0] / window_loss[1])
        steps = window_loss[1] / self.env.world_size
        rate = float(steps) * self.plan.global_batch_size / max(elapsed, 1e-9)
        lr = self.optimizer.param_groups[0]["lr"]
        record = {
            "kind": "train", "step": self.state.step, "epoch": self.state.epoch + 1,
            "loss": loss, "lr": lr, "events_per_s": rate,
        }
        self.metrics.write(record)
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            return
        remaining = (self.total_steps - self.state.step) * self.plan.global_batch_size / max(rate, 1e-9)
        log.info(
            "epoch %d step %d/%d loss %.4f lr %.2e %.1f events/s eta %s",
            self.state.epoch + 1, self.state.step, self.total_steps, loss, lr, rate,
            time.strftime("%H:%M:%S", time.gmtime(remaining)),
        )

    def _progress(self):
        if not (self.env.is_main and sys.stderr.isatty()):
            return None
        return tqdm(
            total=self.sampler.steps_per_epoch, initial=self.sampler.start_step,
            desc=f"epoch {self.state.epoch + 1}/{self.cfg['epochs']}", unit="step", dynamic_ncols=True,
        )

    def _record_event_ids(self, batch: dict) -> None:
        record = {
            "step": self.state.step + 1, "epoch": self.state.epoch, "rank": self.env.rank,
            "world_size": self.env.world_size, "event_ids": batch["event_id"].tolist(),
        }
        self.event_log.write(json.dumps(record) + "\n")
        self.event_log.flush()

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Every validation event exactly once over all ranks; metrics summed exactly across ranks."""
        sampler = ShardedEvalSampler(
            len(self.val_set), self.plan.val_events_per_rank, self.env.world_size, self.env.rank
        )
        loader = self._loader(self.val_set, sampler)
        result = evaluate_events(self.module, self.strategy, self.task, self.val_set, loader, sampler,
                                 self.env.device, self.autocast_dtype if self.autocast else None)
        self.module.train()
        nonfinite = nonfinite_keys(self.task.must_be_finite(result))
        if nonfinite:  # warn, record as null, never pick as best; the weights are unchanged, so training goes on
            result["nonfinite"] = nonfinite
            (log.warning if self.env.is_main else log.info)(
                "validation epoch %d step %d: %s not finite (%s); recorded as null in metrics.jsonl and "
                "summary.json and never chosen for model_best.pth. Training goes on (validation changes no "
                "weights); check the model's outputs on data.val (diverging weights, amp overflow)",
                self.state.epoch, self.state.step, ", ".join(nonfinite),
                ", ".join(f"{k}={result[k]}" for k in nonfinite),
            )
        log.info("validation epoch %d step %d: %s", self.state.epoch, self.state.step, self.task.summary(result))
        self.metrics.write({"kind": "val", "step": self.state.step, "epoch": self.state.epoch, **result})
        return result

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, blocking: bool = False) -> None:
        """Checkpoint the current step (all ranks); blocks only for the CPU copy unless `blocking`."""
        if self.checkpoints.last_saved_step != self.state.step:
            model_state, dcp_state = capture(self.checkpoint_components, self.env.is_main, self.checkpoints.stage)
            self.checkpoints.save(self.state.step, model_state, dcp_state, blocking=blocking)
            if self.env.is_main and self.cfg.get("save_iter_snapshots"):
                save_weight_file(model_state, self.run_dir / "model" / f"iter_{self.state.step}.pth")
        if blocking:
            self.checkpoints.wait()  # also a write of this step that is still in flight

    def _save_best(self, metrics: dict) -> None:
        """model_best.pth (and model_best.json: which step, metric and value) when the task's
        best_metric is strictly better than at every earlier validation."""
        value = metrics.get(self.task.best_metric)
        if not self.task.is_better(value, self.state.best_metric):
            return
        self.state.best_metric = value
        state = self.strategy.full_model_state(self.module)
        if self.env.is_main:
            # the record names the file by its hash, taken before the file is renamed into place: a
            # reader during training (pimm.checkpoint.choose.hold_weights) holds one matching pair
            (self.run_dir / "model").mkdir(exist_ok=True)  # a validation may come before the first checkpoint
            with atomic_path(self.run_dir / "model" / BEST) as tmp:
                save(state, tmp)
                digest = sha256_file(tmp)
            record = {"step": self.state.step, "metric": self.task.best_metric, "value": value, "sha256": digest}
            write_atomic(self.run_dir / "model" / BEST_RECORD, dumps(record) + "\n")

    def _write_summary(self, final: dict) -> None:
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.state.step,
            "epochs_completed": self.state.epoch,
            "world_size": self.env.world_size,
            "validate_only": self.validate_only,
            "final_val": final,
            "best_metric": self.task.best_metric,
            "best_value": self.state.best_metric if math.isfinite(self.state.best_metric) else None,
        }
        write_atomic(self.run_dir / "summary.json", dumps(summary, indent=2))  # NaN -> null (final_val.nonfinite)
