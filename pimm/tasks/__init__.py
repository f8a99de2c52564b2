"""What is learned from a batch: the trainer's loop is the same for every task.

A task turns a batch into a loss (`forward_loss`), makes the meter that accumulates validation
metrics exactly across ranks (`make_meter`), and names the validation metric that picks
`model_best.pth` (`best_metric`, `higher_is_better`). The trainer moves the batch to the device,
runs `forward_loss` under autocast, backpropagates `output.loss` and feeds the meter; it never
looks at labels or logits itself, so a second task (another label set, a regression) is a new
class here, not a fork of the loop.
"""

from pimm.config.validate import model_classes, task_loss
from pimm.models.sonata import model_options
from pimm.registry import Registry
from pimm.tasks.base import Meter, Task, TaskOutput
from pimm.tasks.losses import LOSSES
from pimm.tasks.panoptic import Panoptic
from pimm.tasks.segmentation import SemanticSegmentation, event_mean_loss
from pimm.tasks.self_distillation import SelfDistillation

TASKS = Registry("task")
TASKS.register(SemanticSegmentation)
TASKS.register(Panoptic)
TASKS.register(SelfDistillation)


def build_task(cfg: dict) -> Task:
    """The task of a resolved config: `cfg["task"]` (type and options) with the data's classes."""
    task = {"type": "SemanticSegmentation", **(cfg.get("task") or {})}
    if task["type"] == "SelfDistillation":  # its options are the published model's (model_options)
        return SelfDistillation(model_options(cfg["model"]), seed=int(cfg.get("seed") or 0),
                                class_names=model_classes(cfg)[1])
    task["loss"] = task_loss(cfg)  # task.loss, or the published model.criteria
    num_classes, class_names = model_classes(cfg)
    return TASKS.build(task, num_classes=num_classes, class_names=class_names)


__all__ = ["LOSSES", "TASKS", "Meter", "Panoptic", "SelfDistillation", "SemanticSegmentation", "Task", "TaskOutput",
           "build_task", "event_mean_loss"]
