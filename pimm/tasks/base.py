"""The task interface (see pimm.tasks)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class TaskOutput:
    """One forward: `loss` (scalar, mean over the batch's events: what is backpropagated),
    `event_losses` (B,) each event's loss, `prediction` (the model output, for the meter: logits for
    SemanticSegmentation, a pimm.models.detector.DetectorOutput for Panoptic)."""

    loss: torch.Tensor
    event_losses: torch.Tensor
    prediction: Any


class Meter(ABC):
    """Validation metrics of one rank's batches; `compute` reduces over all ranks (a collective)."""

    @abstractmethod
    def update(self, output: TaskOutput, batch: dict) -> None: ...

    @abstractmethod
    def compute(self) -> dict: ...


class Task(ABC):
    """What the trainer trains and evaluates through (pimm.tasks says how it is used)."""

    best_metric: str  # key of `make_meter().compute()` that picks model_best.pth
    higher_is_better: bool = True

    @abstractmethod
    def forward_loss(self, module: nn.Module, batch: dict) -> TaskOutput:
        """`batch` (collated, on the module's device) -> TaskOutput."""

    @abstractmethod
    def make_meter(self, device: torch.device) -> Meter: ...

    @abstractmethod
    def summary(self, result: dict) -> str:
        """One log line of a validation result (`make_meter().compute()`)."""

    # the optimizer step's hooks, called by the trainer in this order; the defaults do nothing
    def begin_step(self, step: int, total_steps: int) -> None:  # noqa: B027 (an optional hook)
        """Before optimizer step `step` (1-based) of `total_steps`: set what depends on the global step."""

    def prepare_step(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list[dict]:
        """The step's micro-batches (collated, on the host) -> what `forward_loss` gets for each, before any
        backward: the place for work over the whole step (a normalisation over all its samples). `model` is
        the unwrapped module (the strategy's eval_module)."""
        return micro_batches

    def after_optimizer_step(self, model: nn.Module) -> None:  # noqa: B027 (an optional hook)
        """After the optimizer step (an EMA teacher moves here); `model` as in prepare_step."""

    def must_be_finite(self, result: dict) -> dict:
        """The part of a validation result whose non-finite numbers are worth a warning (all of it here)."""
        return result

    def is_better(self, value: float | None, best: float) -> bool:
        """Is `value` of `best_metric` strictly better than `best` (not finite: nothing yet)?"""
        if value is None or not math.isfinite(value):  # missing or NaN is never better
            return False
        if not math.isfinite(best):
            return True
        return value > best if self.higher_is_better else value < best
