"""Check a resolved config before any process starts: required keys, types, ranges, known names.

The launcher runs `check_config` (without importing torch) before it creates a run directory,
and every worker runs it again on the config.py it reads. The per-key checks are one table,
`RULES`; the checks that relate two keys follow it. Batch sizes and workers are checked
against the world size in `pimm.distributed.batch`, data files in `pimm.data.event_file`.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pimm import names
from pimm.config.overrides import closest_keys
from pimm.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """What a value must be: `allowed` says it for people, `ok` tests it."""

    allowed: str
    ok: Callable[[Any], bool]
    choices: tuple[str, ...] = ()  # known names, for a "did you mean"
    notes: dict[str, str] = field(default_factory=dict)  # a refused value -> why that one is refused


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(minimum: int, why: str = "") -> Rule:
    return Rule(f"an integer >= {minimum}{why}", lambda v: _is_int(v) and v >= minimum)


def number(minimum: float, strict: bool) -> Rule:
    if strict:
        return Rule(f"a finite number > {minimum:g}", lambda v: _is_number(v) and v > minimum)
    return Rule(f"a finite number >= {minimum:g}", lambda v: _is_number(v) and v >= minimum)


def optional(rule: Rule, meaning: str) -> Rule:
    return Rule(f"{rule.allowed}, or None ({meaning})", lambda v: v is None or rule.ok(v), rule.choices, rule.notes)


def one_of(choices: tuple[str, ...], notes: dict[str, str] | None = None) -> Rule:
    return Rule(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices, choices, notes or {})


def component(kind: str, choices: tuple[str, ...]) -> Rule:
    article = "an" if kind[0] in "aeiou" else "a"
    return Rule(f"dict(type=..., ...) for {article} {kind} ({', '.join(choices)})", lambda v: isinstance(v, dict))


ANY = Rule("set", lambda v: True)
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
DICT = Rule("a dict", lambda v: isinstance(v, dict))
CLASS_NAMES = Rule(
    "None or a list of class names (strings)",
    lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(n, str) for n in v)),
)
PATTERNS = Rule("a list of fnmatch patterns of parameter names (non-empty strings, e.g. 'backbone.*')",
                lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) and x.strip() for x in v))
SPLITS = ("train", "val", "test")
_DATASET = component("dataset", names.DATASETS)
_BACKBONE_AS_MODEL = {  # model.type naming a backbone -> what to write instead
    b: f"{b} is a backbone: model = dict(type='DefaultSegmentorV2', num_classes=..., backbone_out_channels=..., "
       f"backbone=dict(type='{b}', ...)), as the published configs write it" for b in names.BACKBONES}
KEY_MAP_PRESETS = ("pointcept", "sonata")  # pretrained.key_map: pimm.checkpoint.weights.KEY_MAP_PRESETS (no torch here)
_SPLIT = {  # data.<split>.<key>
    "type": one_of(names.DATASETS),
    "path": Rule("a path to a pimm event file (.h5), or for PILArNetDataset a shard or a directory of shards",
                 lambda v: isinstance(v, str) and v.strip() != ""),
    "max_len": optional(integer(1), "all events"),
    "augment": BOOL,
    # a list of dict(type=..., ...) from names.TRANSFORMS, or None; the entries: check_transforms
    "transforms": Rule("None or a list of dict(type=..., ...) transforms "
                       f"({', '.join(names.TRANSFORMS)})",
                       lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(t, dict) for t in v))),
    "skip_nonfinite": BOOL,  # drop events with a non-finite coordinate, energy or feature (pimm.data)
    "features": one_of(names.FEATURE_MODES),  # how feat is computed: pimm.data.transforms.feature_columns
    # PILArNetDataset only (pimm.data.pilarnet_file)
    "split": Rule("a split name such as 'train' (shards <path>/*<split>/*.h5)",
                  lambda v: isinstance(v, str) and v.strip() != ""),
    "revision": one_of(names.PILARNET_REVISIONS),
    "label": one_of(names.PILARNET_LABELS),
    "min_points": integer(0),
    "energy_threshold": number(0, strict=False),
    "volume_size": number(0, strict=True),
    "pid_unlabelled_as_none": BOOL,
    "remove_low_energy_scatters": BOOL,
    "min_points_after_cut": BOOL,
    "instances": BOOL,  # per-point particle / interaction / pid / momentum / vertex targets
}
_PILARNET_ONLY = ("split", "revision", "label", "min_points", "energy_threshold", "volume_size",
                  "pid_unlabelled_as_none", "remove_low_energy_scatters", "min_points_after_cut", "instances")
REQUIRED, OPTIONAL = True, False

# (dotted key, required, rule), parents before children. A nested key is looked at only when its
# parent is a dict (so `scheduler=None` skips scheduler.type); `required` keys must then be present.
RULES: tuple[tuple[str, bool, Rule], ...] = (
    ("seed", REQUIRED, integer(0)),
    ("epochs", REQUIRED, integer(1)),
    ("max_steps", OPTIONAL, optional(integer(1), "run all epochs")),
    ("batch_size", REQUIRED, ANY),  # checked with the world size in pimm.distributed.batch
    ("grad_accum_steps", OPTIONAL, integer(1, " (1: no accumulation)")),  # divisibility: pimm.distributed.batch
    ("log_every", REQUIRED, integer(1)),
    ("eval_every_epochs", REQUIRED, integer(1)),
    ("eval_every_n_steps", OPTIONAL, optional(integer(1), "validate at epoch ends only")),
    ("log_event_ids", OPTIONAL, BOOL),
    ("model", REQUIRED, component("model", names.MODELS)),
    ("model.type", REQUIRED, one_of(names.MODELS, _BACKBONE_AS_MODEL)),
    ("model.num_classes", OPTIONAL, integer(2)),
    ("task", OPTIONAL, optional(component("task", names.TASKS), "SemanticSegmentation with its defaults")),
    ("task.type", REQUIRED, one_of(names.TASKS)),
    ("optimizer", REQUIRED, component("optimizer", names.OPTIMIZERS)),
    ("optimizer.type", REQUIRED, one_of(names.OPTIMIZERS)),
    # >= 0, not > 0: lr=0 keeps the initial weights on purpose (tests compare 1- and 2-rank evaluation)
    ("optimizer.lr", OPTIONAL, number(0, strict=False)),
    ("optimizer.weight_decay", OPTIONAL, number(0, strict=False)),
    ("scheduler", OPTIONAL, optional(component("scheduler", names.SCHEDULERS), "a constant learning rate")),
    ("scheduler.type", REQUIRED, one_of(names.SCHEDULERS)),
    ("clip_grad", OPTIONAL, optional(number(0, strict=True), "no clipping")),
    ("weight_decay_schedule", OPTIONAL, optional(DICT, "a constant weight decay")),
    ("weight_decay_schedule.final", REQUIRED, number(0, strict=False)),
    ("weight_decay_schedule.ratio", OPTIONAL, Rule("a number in (0, 1] (the share of the schedule's steps the "
                                                   "cosine spans)", lambda v: _is_number(v) and 0 < v <= 1)),
    ("amp", OPTIONAL, optional(DICT, "no autocast")),
    ("amp.enabled", OPTIONAL, BOOL),
    ("amp.dtype", OPTIONAL, one_of(names.AMP_DTYPES, notes={
        "float16": "pimm does not use a GradScaler, so float16 autocast would underflow gradients: use bfloat16",
    })),
    ("parallel", OPTIONAL, optional(DICT, "dict(strategy='ddp')")),
    ("parallel.strategy", OPTIONAL, one_of(names.PARALLEL_STRATEGIES, notes={
        **{n: "tensor and pipeline parallelism (and other sharding engines) are not implemented in pimm: "
           "use 'ddp' (replicas) or 'fsdp2' (sharded parameters, gradients and optimizer state)"
           for n in names.NOT_IMPLEMENTED_STRATEGIES},
        "fsdp": "FSDP1 is not used by pimm: 'fsdp2' is torch.distributed.fsdp.fully_shard",
    })),
    ("parallel.wrap_classes", OPTIONAL, Rule("a list of module class names, e.g. ['Block']",
                                             lambda v: isinstance(v, (list, tuple))
                                             and all(isinstance(x, str) for x in v))),
    ("parallel.reshard_after_forward", OPTIONAL, BOOL),
    ("parallel.mixed_precision", OPTIONAL, BOOL),
    ("backends", OPTIONAL, optional(DICT, "dict(sparse_conv='auto')")),
    ("backends.sparse_conv", OPTIONAL, one_of(names.SPARSE_CONV_BACKENDS)),
    ("find_unused_parameters", OPTIONAL, BOOL),
    ("sync_bn", OPTIONAL, BOOL),
    ("data", REQUIRED, DICT),
    ("data.num_classes", REQUIRED, integer(2)),
    ("data.names", OPTIONAL, CLASS_NAMES),
    ("data.train", REQUIRED, _DATASET),
    ("data.val", OPTIONAL, optional(_DATASET, "no validation")),
    ("data.test", OPTIONAL, optional(_DATASET, "no test set")),
    *((f"data.{split}.{key}", key in ("type", "path"), rule) for split in SPLITS for key, rule in _SPLIT.items()),
    ("checkpoint_every_n_steps", OPTIONAL, optional(integer(1), "at the end of every epoch only")),
    ("checkpoint_async", REQUIRED, BOOL),
    ("checkpoint_keep_last", REQUIRED, integer(2, " (the older one is the fallback when the newest is corrupt)")),
    ("save_iter_snapshots", OPTIONAL, BOOL),
    ("resume_strict_state", OPTIONAL, BOOL),
    ("validate_only", OPTIONAL, BOOL),
    ("test_after_training", OPTIONAL, BOOL),
    ("tensorboard", OPTIONAL, optional(DICT, "off")),
    ("tensorboard.enabled", OPTIONAL, BOOL),
    ("wandb", OPTIONAL, optional(DICT, "off")),
    ("wandb.enabled", OPTIONAL, BOOL),
    ("wandb.mode", OPTIONAL, one_of(("offline",))),
    ("wandb.project", OPTIONAL, Rule("a W&B project name", lambda v: isinstance(v, str) and v.strip() != "")),
    ("wandb.entity", OPTIONAL, optional(Rule("a W&B entity (user or team)", lambda v: isinstance(v, str)), "yours")),
    ("wandb.group", OPTIONAL, optional(Rule("a W&B group name", lambda v: isinstance(v, str)), "none")),
    ("wandb.tags", OPTIONAL, optional(Rule("a list of strings", lambda v: isinstance(v, (list, tuple))
                                                 and all(isinstance(t, str) for t in v)), "none")),
    ("wandb.system_metrics", OPTIONAL, BOOL),
    ("pretrained", OPTIONAL, optional(DICT, "no pretrained weights")),  # the entries: check_finetune
    ("pretrained.path", OPTIONAL, optional(Rule("a weights file or directory, or hf://owner/name[@revision][/file]",
                                                lambda v: isinstance(v, str) and v.strip() != ""),
                                           "only --train.weight")),
    ("pretrained.key_map", OPTIONAL, Rule(f"a preset ({', '.join(KEY_MAP_PRESETS)}) or a list of [old_prefix, "
                                          "new_prefix] pairs of strings",
                                          lambda v: v in KEY_MAP_PRESETS if isinstance(v, str) else (
                                              isinstance(v, (list, tuple)) and all(
                                                  isinstance(p, (list, tuple)) and len(p) == 2
                                                  and all(isinstance(x, str) for x in p) for p in v)),
                                          KEY_MAP_PRESETS)),
    ("pretrained.strict", OPTIONAL, BOOL),
    ("pretrained.skip", OPTIONAL, PATTERNS),
    ("freeze", OPTIONAL, optional(PATTERNS, "nothing frozen")),
    ("param_groups", OPTIONAL, optional(Rule("a list of dict(params='pattern|pattern', lr_scale=..., "
                                             "weight_decay=...)", lambda v: isinstance(v, (list, tuple))
                                             and all(isinstance(g, dict) for g in v)), "one group")),
    ("debug", OPTIONAL, optional(DICT, "no fault injection")),
    *((f"debug.{key}", OPTIONAL, optional(integer(1), "off"))
      for key in ("nonfinite_loss_at_step", "interrupt_at_step", "kill_during_checkpoint_at_step",
                  "kill_after_checkpoint_manifest_at_step")),
    ("debug.desync_rank_params", OPTIONAL, optional(BOOL, "off")),
)

_MISSING = object()
_NUMBER_TEXT = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def _lookup(cfg: dict, key: str) -> tuple[bool, Any]:
    """(parent is a dict, value or _MISSING) for a dotted key."""
    *parents, last = key.split(".")
    node: Any = cfg
    for part in parents:
        node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
    if not isinstance(node, dict):
        return False, _MISSING
    return True, node.get(last, _MISSING)


def _refusal(key: str, value: Any, rule: Rule) -> ConfigError:
    why = rule.notes.get(value) if isinstance(value, str) else None
    if why:
        return ConfigError(f"{key}={value!r} is not supported: {why} (allowed: {rule.allowed})")
    msg = f"{key}={value!r:.80} is not allowed: {key} must be {rule.allowed}"
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
        msg += " (the value is a quoted string; write the number without quotes)"
    close = difflib.get_close_matches(value, rule.choices, n=1) if isinstance(value, str) and rule.choices else []
    msg += f"; did you mean {close[0]!r}?" if close else "."
    return ConfigError(f"{msg} Fix it in the config or override it: -- {key}=<value>")


# top-level keys checked elsewhere (pimm.distributed.batch), besides the RULES'
_SPLIT_KEYS = ("batch_size_val", "batch_size_test", "num_worker")
_DATA_KEYS = ("num_classes", "names", *SPLITS)


def _check_known_keys(cfg: dict) -> None:
    """An unknown top-level, data or data.<split> key is a typo pimm would otherwise ignore in
    silence (`lr = 0.1` trains at the default lr): refuse it with the keys it most likely means.
    Top-level names starting with '_' are the config file's own helpers and are left alone."""
    known = {key.split(".")[0] for key, _, _ in RULES} | set(_SPLIT_KEYS)
    scopes = [("", cfg, known)]
    if isinstance(cfg.get("data"), dict):
        scopes.append(("data.", cfg["data"], set(_DATA_KEYS)))
        scopes += [(f"data.{split}.", cfg["data"][split], set(_SPLIT))
                   for split in SPLITS if isinstance(cfg["data"].get(split), dict)]
    for prefix, node, allowed in scopes:
        for key in node:
            if key in allowed or (not prefix and str(key).startswith("_")):
                continue
            if prefix:  # the options of this dict, as the dotted keys they would be
                scope: dict = dict.fromkeys(allowed)
                for part in reversed(prefix.rstrip(".").split(".")):
                    scope = {part: scope}
            else:
                scope = {k: v for k, v in cfg.items() if k in known}
            close = closest_keys(prefix + str(key), scope)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"config key '{prefix}{key}' is not used by pimm, so its value would be ignored.{hint} "
                              "Fix or remove it in the config (names of your own helper variables start with '_')")


def check_config(cfg: dict) -> None:
    """Raise ConfigError for the first config value that training cannot use: an unknown key, a
    missing required key, a wrong type, a value out of range, an unknown component name or two keys
    that disagree."""
    _check_known_keys(cfg)
    for key, required, rule in RULES:
        parent_is_dict, value = _lookup(cfg, key)
        if value is _MISSING:
            if required and parent_is_dict:
                raise ConfigError(
                    f"config is missing '{key}', which must be {rule.allowed}; the defaults are in "
                    "configs/_base_/default_runtime.py (inherit it with _base_ = ['../_base_/default_runtime.py'])"
                )
            continue
        if not rule.ok(value):
            raise _refusal(key, value, rule)

    data, model = cfg["data"], cfg["model"]
    num_classes = data["num_classes"]
    task = cfg.get("task") if isinstance(cfg.get("task"), dict) else {}
    if task.get("type") == "Panoptic" and task.get("label") == "interaction":
        stuff = model.get("stuff_classes")
        # a stuff_classes that is no list is left to the model's argument check, which names its type
        if model.get("num_classes", 2) != 2 or (isinstance(stuff, list) and stuff != [0]):
            raise ConfigError(f"model.num_classes={model.get('num_classes', 2)} and model.stuff_classes={stuff}, but "
                              "task.label='interaction' has 2 classes (stuff, interaction), as the published vtx "
                              "recipes: set model.num_classes=2 and model.stuff_classes=[0]")
    elif "num_classes" in model and model["num_classes"] != num_classes:
        raise ConfigError(
            f"data.num_classes={num_classes} but model.num_classes={model['num_classes']}: the model must "
            "output one score per class of the data; set both to the same value"
        )
    for split in SPLITS:
        dataset = data.get(split)
        if isinstance(dataset, dict) and dataset.get("type") != "PILArNetDataset":
            given = [k for k in _PILARNET_ONLY if k in dataset]
            if given:
                raise ConfigError(f"data.{split}.{given[0]} is an option of PILArNetDataset, not of "
                                  f"{dataset.get('type')}; remove it or set data.{split}.type='PILArNetDataset'")
    for split in SPLITS:
        if isinstance(data.get(split), dict):
            check_transforms(data[split], f"data.{split}")
    check_model(model)
    check_finetune(cfg)
    backbone = model.get("backbone") if isinstance(model.get("backbone"), dict) else {}
    where = "model.backbone.in_channels" if "in_channels" in backbone else "model.in_channels"
    in_channels = backbone.get("in_channels", model.get("in_channels"))
    if in_channels is not None and in_channels != len(names.FEATURE_COLUMNS):
        raise ConfigError(
            f"{where}={in_channels} but every data set gives {len(names.FEATURE_COLUMNS)} feature columns "
            f"per point ({', '.join(names.FEATURE_COLUMNS)}): set {where}={len(names.FEATURE_COLUMNS)}")
    task = cfg.get("task") if isinstance(cfg.get("task"), dict) else {}
    if task.get("type") == "Panoptic":
        check_panoptic(cfg)
    elif task.get("type") == "SelfDistillation":
        unknown = sorted(set(task) - {"type"})
        if unknown:
            raise ConfigError(f"task.{unknown[0]} is not an option of SelfDistillation: its options are the model's "
                              "(model.mask_size_base, model.teacher_temp_base, ...); write task = dict(_delete_=True, "
                              "type='SelfDistillation')")
        if model["type"] != "Sonata-v1m1":
            raise ConfigError(f"task.type='SelfDistillation' trains model.type='Sonata-v1m1' (a student and an EMA "
                              f"teacher), not {model['type']!r}; see configs/tests/tiny_pretrain.py")
        probe = model.get("probe_classes", 0)
        if probe and probe != num_classes:
            raise ConfigError(f"model.probe_classes={probe} but data.num_classes={num_classes}: the online probe "
                              f"predicts the data's classes; set model.probe_classes={num_classes} (or 0: no probe)")
    else:
        if model["type"] == "Sonata-v1m1":
            raise ConfigError("model.type='Sonata-v1m1' is trained by self-distillation: set "
                              "task = dict(_delete_=True, type='SelfDistillation')")
        if model["type"] in names.DETECTORS:
            raise ConfigError(f"model.type={model['type']!r} (a query detector) is trained by the Panoptic task: set "
                              "task=dict(type='Panoptic', label='particle' or 'interaction')")
        unknown = sorted(set(task) - {"type", "class_weights", "ignore_index", "best_metric", "loss"})
        if unknown:
            raise ConfigError(f"task.{unknown[0]} is not an option of {task.get('type')}; its options are "
                              "class_weights, ignore_index, best_metric, loss.")
        check_segmentation_options(num_classes, task.get("class_weights"), task.get("ignore_index", -1),
                                   task.get("best_metric", "miou"), task_loss(cfg))
    class_names = data.get("names")
    if class_names is not None and len(class_names) != num_classes:
        raise ConfigError(
            f"data.names has {len(class_names)} entries {list(class_names)} but data.num_classes={num_classes}; "
            "give one name per class, or data.names=None"
        )
    # an environment fact, not a value: checked here so it fails before any process starts
    if isinstance(cfg.get("tensorboard"), dict) and cfg["tensorboard"].get("enabled") \
            and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "tensorboard.enabled=true but the tensorboard package is not installed in this environment "
            f"({sys.executable}): pip install tensorboard==2.21.0, or set tensorboard.enabled=false"
        )
    if isinstance(cfg.get("wandb"), dict) and cfg["wandb"].get("enabled") and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "wandb.enabled=true but the wandb package is not installed in this environment "
            f"({sys.executable}): pip install wandb==0.31.0 (or pip install 'pimm[wandb]'), or set wandb.enabled=false"
        )


# best_metric choices of SemanticSegmentation -> higher is better
SEGMENTATION_METRICS = {"miou": True, "accuracy": True, "loss": False}


# task.loss: terms of pimm.tasks.losses, summed with their weights; the default is plain cross-entropy
DEFAULT_LOSS = [{"type": "CrossEntropy", "weight": 1.0}]
# loss type -> its options besides type and weight (the constructor arguments of pimm.tasks.losses)
LOSS_OPTIONS: dict[str, dict[str, Rule]] = {
    "CrossEntropy": {},
    "Lovasz": {},
    "Focal": {"gamma": number(0, strict=False)},
}


# the published criteria (model.criteria of DefaultSegmentorV2) -> pimm's loss term and the options it keeps
_PUBLISHED_CRITERIA = {"CrossEntropyLoss": "CrossEntropy", "LovaszLoss": "Lovasz", "FocalLoss": "Focal"}
_CRITERIA_KEPT = {"FocalLoss": ("gamma",)}
# options of a published criterion pimm accepts at these values only (pimm's task owns them)
_CRITERIA_FIXED = {"ignore_index": (-1,), "mode": ("multiclass",), "class_weights": (None,), "weight": (None,),
                   "reduction": ("mean",), "alpha": (None,)}


def loss_from_criteria(criteria: Any) -> list[dict]:
    """task.loss from the published `model.criteria` (CrossEntropyLoss, LovaszLoss, FocalLoss with their
    loss_weight): what pimm's task computes when a pasted published model brings its losses. pimm's terms
    are per event (pimm.tasks.losses); ConfigError for a criterion or an option pimm cannot honour."""
    terms = []
    for i, criterion in enumerate(criteria or []):
        key = f"model.criteria[{i}]"
        kind = criterion.get("type") if isinstance(criterion, dict) else None
        if kind not in _PUBLISHED_CRITERIA:
            raise ConfigError(f"{key}={criterion!r:.100} is not a criterion pimm can compute: its type must be one of "
                              f"{', '.join(_PUBLISHED_CRITERIA)}; or remove model.criteria and set task.loss "
                              f"({', '.join(names.LOSSES)})")
        term = {"type": _PUBLISHED_CRITERIA[kind], "weight": criterion.get("loss_weight", 1.0)}
        for option, value in criterion.items():
            if option in ("type", "loss_weight"):
                continue
            if option in _CRITERIA_KEPT.get(kind, ()):
                term[option] = value
            elif value not in _CRITERIA_FIXED.get(option, ()):
                where = {"ignore_index": "task.ignore_index", "class_weights": "task.class_weights",
                         "weight": "task.class_weights", "alpha": "task.class_weights"}.get(option)
                how = f"set {where} instead" if where else "remove it"
                raise ConfigError(f"{key}.{option}={value!r} is not supported by pimm's {term['type']}: {how}")
        terms.append(term)
    return terms


def check_schedule_length(scheduler: dict | None, total_steps: int) -> None:
    """ConfigError for a OneCycleLR that torch cannot step over `total_steps` (the run's epochs x steps per
    epoch): a warm-up of pct_start x total_steps = 1 step, or pct_start = 1, leaves a phase of no length,
    and torch divides by it at the first step."""
    if not isinstance(scheduler, dict) or scheduler.get("type") != "OneCycleLR":
        return
    total = scheduler.get("total_steps") or total_steps
    pct = scheduler.get("pct_start", 0.3)
    warmup_end = float(pct * total) - 1
    if warmup_end == 0 or warmup_end == total - 1:
        raise ConfigError(f"scheduler OneCycleLR with pct_start={pct} over {total} steps gives a phase of no length "
                          f"(warm-up {pct * total:g} step(s) of {total}); torch cannot step it. Change "
                          "scheduler.pct_start, or train for another number of steps (epochs, batch_size)")


def model_classes(cfg: dict) -> tuple[int, list[str]]:
    """(number, names) of the classes a config's model predicts: the data's, except for a Panoptic task on
    interactions, whose classes are ("stuff", "interaction")."""
    task = cfg.get("task") or {}
    if task.get("type") == "Panoptic" and task.get("label") == "interaction":
        return 2, ["stuff", "interaction"]
    num_classes = int(cfg["data"]["num_classes"])
    return num_classes, list(cfg["data"].get("names") or [str(i) for i in range(num_classes)])


def task_loss(cfg: dict):
    """The loss a config trains with: task.loss, else the published model.criteria (for SemanticSegmentation
    as pimm's loss terms), else the task's default (DEFAULT_LOSS; None for Panoptic)."""
    task, model = cfg.get("task") or {}, cfg.get("model") or {}
    if task.get("loss") is not None and model.get("criteria"):
        raise ConfigError("task.loss and model.criteria are both set: pimm computes the loss in the task, from one of "
                          "them. Remove model.criteria (the published losses) or task.loss")
    if task.get("loss") is not None:
        return task["loss"]
    if task.get("type") == "Panoptic":
        return model.get("criteria") or None
    return loss_from_criteria(model.get("criteria")) or DEFAULT_LOSS


PANOPTIC_OPTIONS: dict[str, Rule] = {
    "label": one_of(names.PANOPTIC_LABELS),
    "stuff_classes": optional(Rule("a list of class indices >= 0", lambda v: isinstance(v, (list, tuple)) and all(
        _is_int(x) and x >= 0 for x in v)), "the last class for particles, class 0 (stuff) for interactions"),
    "best_metric": one_of((*names.PANOPTIC_EVENT_METRICS, "pq_pooled", "detection_f1_pooled", "loss")),
    "iou_threshold": Rule("a number in [0.5, 1) (matches above 0.5 IoU are unique)",
                          lambda v: _is_number(v) and 0.5 <= v < 1),
    "loss": ANY,  # panoptic_loss_weights checks it
    "stuff_loss_weight": number(0, strict=False),
}


def check_panoptic(cfg: dict) -> None:
    """ConfigError for a Panoptic task the run cannot train: unknown or bad options, a model that is not the
    query detector, data without instance targets, stuff classes outside the task's classes."""
    task, model, data = cfg["task"], cfg["model"], cfg["data"]
    inherited = [k for k in ("class_weights", "ignore_index") if k in task]
    if inherited:
        raise ConfigError(f"task.{inherited[0]} is an option of SemanticSegmentation, not of Panoptic (a config "
                          "inheriting configs/_base_/default_runtime.py gets its task options): write "
                          "task = dict(_delete_=True, type='Panoptic', label=...)")
    _check_component_options(task, PANOPTIC_OPTIONS, "task")
    if "label" not in task:
        raise ConfigError("task.label is required for Panoptic: 'particle' (particles as instances) or 'interaction'")
    if model["type"] not in names.DETECTORS:
        raise ConfigError(f"task.type='Panoptic' needs a query detector: model.type one of {names.DETECTORS} (got "
                          f"{model['type']!r}); see configs/tests/tiny_panoptic.py")
    classes = 2 if task["label"] == "interaction" else data["num_classes"]
    bad = [c for c in task.get("stuff_classes") or () if c >= classes]
    if bad:
        raise ConfigError(f"task.stuff_classes={task['stuff_classes']!r} is not allowed: class {bad[0]} is outside "
                          f"0..{classes - 1}")
    for split in SPLITS:
        dataset = data.get(split)
        if isinstance(dataset, dict) and dataset.get("instances") is not True:
            raise ConfigError(f"task.type='Panoptic' learns from instance targets but data.{split} gives none: set "
                              f"data.{split}.instances=True (PILArNetDataset)")
    panoptic_loss_weights(task_loss(cfg))


def panoptic_loss_weights(loss: Any) -> dict[str, float]:
    """A Panoptic task.loss (None; a dict of names.PANOPTIC_LOSS_WEIGHTS; or the published criteria, one
    dict(type='InstanceSegmentationLoss', ...)) -> the weights it sets; ConfigError for anything else."""
    if loss is None:
        return {}
    if isinstance(loss, (list, tuple)):
        if len(loss) != 1 or not isinstance(loss[0], dict) or loss[0].get("type") != "InstanceSegmentationLoss":
            raise ConfigError(f"task.loss={loss!r:.100} is not allowed for Panoptic: give the published criteria as "
                              "one dict(type='InstanceSegmentationLoss', ...), or a dict of loss weights")
        term = {k: v for k, v in loss[0].items() if k != "type"}
        if term.pop("truth_label", "instance") != "instance":
            raise ConfigError("InstanceSegmentationLoss truth_label must be 'instance' (task.label says what an "
                              "instance is)")
        unknown = sorted(set(term) - set(names.PUBLISHED_INSTANCE_LOSS))
        if unknown:
            raise ConfigError(f"InstanceSegmentationLoss option {unknown[0]!r} is not supported; its options are "
                              f"{', '.join(names.PUBLISHED_INSTANCE_LOSS)}, truth_label")
        loss = {names.PUBLISHED_INSTANCE_LOSS[k]: v for k, v in term.items()}
    if not isinstance(loss, dict):
        raise ConfigError(f"task.loss={loss!r:.80} is not allowed for Panoptic: give a dict of loss weights "
                          f"({', '.join(names.PANOPTIC_LOSS_WEIGHTS)})")
    for key, value in loss.items():
        if key not in names.PANOPTIC_LOSS_WEIGHTS:
            close = difflib.get_close_matches(str(key), names.PANOPTIC_LOSS_WEIGHTS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"task.loss.{key} is not a Panoptic loss weight: {hint}its weights are "
                              f"{', '.join(names.PANOPTIC_LOSS_WEIGHTS)}")
        if not (_is_int(value) and value >= 1 if key == "match_points" else _is_number(value) and value >= 0):
            raise ConfigError(f"task.loss.{key}={value!r} is not allowed: give "
                              f"{'an integer >= 1' if key == 'match_points' else 'a finite number >= 0'}")
    return dict(loss)


def check_loss_terms(loss: Any) -> None:
    """ConfigError for a task.loss that is not a non-empty list of known loss terms with valid options."""
    example = "e.g. [dict(type='CrossEntropy', weight=1.0), dict(type='Lovasz', weight=1.0)]"
    if not isinstance(loss, (list, tuple)) or not loss or not all(isinstance(t, dict) for t in loss):
        raise ConfigError(f"task.loss={loss!r:.80} is not allowed: give a non-empty list of "
                          f"dict(type=..., weight=...) loss terms ({', '.join(names.LOSSES)}), {example}")
    for i, term in enumerate(loss):
        key = f"task.loss[{i}]"
        kind = term.get("type")
        if kind not in names.LOSSES:
            close = difflib.get_close_matches(str(kind), names.LOSSES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "."
            raise ConfigError(f"{key}.type={kind!r} is not a loss type{hint} Loss types: {', '.join(names.LOSSES)}")
        options = LOSS_OPTIONS[kind]
        for option, value in term.items():
            if option == "type":
                continue
            if option == "weight":
                rule = number(0, strict=False)
            elif option in options:
                rule = options[option]
            else:
                close = difflib.get_close_matches(option, [*options, "weight"], n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ConfigError(f"{key}.{option} is not an option of loss {kind}; {hint}its options are "
                                  f"{', '.join(['weight', *options])}")
            if not rule.ok(value):
                raise ConfigError(f"{key}.{option}={value!r} is not allowed: it must be {rule.allowed}")
    if not any(term.get("weight", 1.0) > 0 for term in loss):
        raise ConfigError(f"task.loss has every weight 0, so nothing would be learned: give at least one loss term "
                          f"a weight > 0, {example}")


def check_segmentation_options(num_classes, class_weights, ignore_index, best_metric, loss=None) -> None:
    """ConfigError for task options SemanticSegmentation cannot use (also run by the launcher).
    loss=None: the default, DEFAULT_LOSS."""
    check_loss_terms(DEFAULT_LOSS if loss is None else loss)
    if class_weights is not None:
        weights = list(class_weights) if isinstance(class_weights, (list, tuple)) else None
        numbers = weights is not None and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < float("inf") for w in weights)
        if not numbers or len(weights) != num_classes or not any(weights):
            raise ConfigError(
                f"task.class_weights={class_weights!r:.80} is not allowed: give one finite weight >= 0 per class "
                f"({num_classes} for data.num_classes={num_classes}), not all 0, e.g. "
                f"[{', '.join(['1.0'] * num_classes)}]; or None for equal weights")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or 0 <= ignore_index < num_classes:
        raise ConfigError(
            f"task.ignore_index={ignore_index!r} is not allowed: it must be an integer label outside the classes "
            f"0..{num_classes - 1} (PILArNet marks unlabelled points -1, the default); to leave a class out of "
            "the loss give it task.class_weights 0")
    if best_metric not in SEGMENTATION_METRICS:
        raise ConfigError(f"task.best_metric={best_metric!r} is not allowed: it must be one of "
                          f"{', '.join(SEGMENTATION_METRICS)} (the validation metric that picks model_best.pth)")


def _list_of(what: str, ok: Callable[[Any], bool]) -> Rule:
    return Rule(f"a non-empty list of {what}", lambda v: isinstance(v, (list, tuple)) and len(v) > 0
                and all(ok(x) for x in v))


_STAGE_LIST = _list_of("integers >= 1, one per encoder stage", lambda x: _is_int(x) and x >= 1)
_DECODER_LIST = Rule("a list of integers >= 1, one per decoder stage (len(enc_depths) - 1)",
                     lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) and x >= 1 for x in v))
_CRITERIA = Rule("a list of dict(type='CrossEntropyLoss' | 'LovaszLoss', loss_weight=..., ...) (the published "
                 "losses; pimm computes the loss in the task: see task.loss)",
                 lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(c, dict) for c in v)))
_PROBABILITY = Rule("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1)
_FRACTION = Rule("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1)
# pimm's own option of PT-v3m2 and the detectors (pimm.models.weight_init)
_WEIGHT_INIT = Rule(f"one of {', '.join(names.WEIGHT_INITS)} (how the layers start; trunc_normal is the published)",
                    lambda v: v in names.WEIGHT_INITS)


def _ZERO(why: str) -> Rule:
    return Rule(f"0 ({why})", lambda v: _is_number(v) and v == 0)


_INSTANCE_CRITERIA = Rule("None or [dict(type='InstanceSegmentationLoss', ...)] (the published instance loss; pimm "
                          "computes it in the Panoptic task: see task.loss)",
                          lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(c, dict) for c in v)))
# model type -> its constructor arguments (pimm.models; a test holds these to the signatures)
MODEL_OPTIONS: dict[str, dict[str, Rule]] = {
    "PointSegNet": {
        "in_channels": integer(1, " (feature columns per point)"),
        "num_classes": integer(2),
        "channels": integer(1),
        "grid_sizes": _list_of("finite numbers > 0 (a voxel edge per Block)", lambda x: _is_number(x) and x > 0),
        "expansion": integer(1, " (MLP width / channels)"),
    },
    "PointTransformer": {
        "in_channels": integer(1, " (feature columns per point)"),
        "num_classes": integer(2),
        "grid_size": number(0, strict=True),
        "orders": _list_of(", ".join(names.SERIALIZATION_ORDERS), lambda x: x in names.SERIALIZATION_ORDERS),
        "shuffle_orders": BOOL,
        **{key: _STAGE_LIST for key in ("enc_depths", "enc_channels", "enc_num_head", "enc_patch_size")},
        **{key: _DECODER_LIST for key in ("dec_depths", "dec_channels", "dec_num_head", "dec_patch_size")},
        "mlp_ratio": number(0, strict=True),
        "drop_path": Rule("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1),
    },
    "DefaultSegmentorV2": {
        "num_classes": integer(0, " (0: no head, the backbone's features)"),
        "backbone_out_channels": integer(1, " (the backbone's output width: dec_channels[0], or with enc_mode the "
                                            "sum of enc_channels)"),
        "backbone": component("backbone", names.BACKBONES),
        "criteria": _CRITERIA,
        "freeze_backbone": BOOL,
        "mlp_head": BOOL,
        "grid_size": number(0, strict=True),
        "grid_origin": Rule("a finite number", _is_number),
    },
    # the published detector (pimm.models.detector): every published constructor argument, and pimm's own
    "detector-v1m1": {
        "num_classes": integer(1, " (the task's classes: data.num_classes for particles, 2 for interactions)"),
        "full_in_channels": integer(1, " (the backbone's width per point: with enc_mode the sum of enc_channels, "
                                       "otherwise dec_channels[0])"),
        "hidden_channels": integer(1),
        "num_heads": integer(1),
        "num_queries": integer(1),
        "backbone": component("backbone", names.BACKBONES),
        "criteria": _INSTANCE_CRITERIA,
        "depth": integer(1, " (decoder layers)"),
        "mlp_ratio": number(0, strict=True),
        "qkv_bias": BOOL,
        "qk_scale": Rule("None (attention is scaled by 1/sqrt(channels per head))", lambda v: v is None),
        "attn_drop": _ZERO("the decoder has no dropout"),
        "proj_drop": _ZERO("the decoder has no dropout"),
        "drop_path": _ZERO("the decoder has no drop path"),
        "layer_scale": Rule("None (the decoder has no LayerScale)", lambda v: v is None),
        "pre_norm": Rule("true (the decoder is pre-norm)", lambda v: v is True),
        "enable_flash": BOOL,
        "upcast_attention": BOOL,
        "upcast_softmax": BOOL,
        "pos_emb": BOOL,
        "attn_mask_anneal": Rule("false (attention-mask annealing is not implemented; the recipes leave it off)",
                                 lambda v: v is False),
        "attn_mask_anneal_steps": integer(0),
        "attn_mask_warmup_steps": integer(0),
        "attn_mask_progressive": Rule("false (attention-mask annealing is not implemented)", lambda v: v is False),
        "attn_mask_progressive_delay": integer(0),
        "query_type": Rule(f"one of {', '.join(names.QUERY_TYPES)} (learned is the only query type published; "
                           "anchored is pimm's: queries anchored at farthest-point-sampled voxels)",
                           lambda v: v in names.QUERY_TYPES),
        "use_stuff_head": BOOL,
        "stuff_classes": optional(_list_of("class indices >= 0", lambda x: _is_int(x) and x >= 0), "none"),
        "supervise_attn_mask": Rule("true (every decoder layer's masks are supervised)", lambda v: v is True),
        "train_filter_use_gt": BOOL,
        "mlp_point_proj": BOOL,
        "stuff_threshold": _PROBABILITY,
        "mask_threshold": _PROBABILITY,
        "conf_threshold": _PROBABILITY,
        "nms_kernel": Rule("'gaussian' (matrix NMS is gaussian)", lambda v: v == "gaussian"),
        "nms_sigma": number(0, strict=True),
        "nms_pre": Rule("-1 (every candidate query goes to NMS)", lambda v: v == -1 and _is_int(v)),
        "nms_max": Rule("-1 (every instance NMS keeps is kept)", lambda v: v == -1 and _is_int(v)),
        "min_points": integer(1),
        "fill_uncovered": BOOL,
        "momentum_head": BOOL,
        "vertex_head": BOOL,
        "grid_size": number(0, strict=True),
        "grid_origin": Rule("a finite number", _is_number),
        "weight_init": _WEIGHT_INIT,
        "anchor_length": number(0, strict=True),
        "connect_radius": optional(number(0, strict=True), "off: the published post-processing alone"),
        "connect_min_points": integer(1),
        "connect_collinear": optional(Rule("a number in (0, 1) (the smallest |cosine| between two touching instances' "
                                           "axes and the line through their centres that joins them)",
                                           lambda v: _is_number(v) and 0 < v < 1), "off: no instances joined"),
    },
    # Sonata-style self-distillation (pimm.models.sonata): every published constructor argument, and pimm's own
    "Sonata-v1m1": {
        "backbone": component("backbone", names.BACKBONES),
        "head_in_channels": integer(1, " (the up-cast features' width: the sum of the last up_cast_level + 1 "
                                       "enc_channels)"),
        "head_hidden_channels": integer(1),
        "head_embed_channels": integer(1),
        "head_num_prototypes": integer(1),
        "teacher_custom": optional(DICT, "the teacher as the student"),
        "num_global_view": Rule("1 or 2 (the published roll-mask loss pairs two global views)", lambda v: v in (1, 2)
                                and _is_int(v)),
        "num_local_view": integer(0),
        "mask_size_start": number(0, strict=True),
        "mask_size_base": number(0, strict=True),
        "mask_size_warmup_ratio": _FRACTION,
        "mask_ratio_start": _PROBABILITY,
        "mask_ratio_base": _PROBABILITY,
        "mask_ratio_warmup_ratio": _FRACTION,
        "mask_jitter": optional(number(0, strict=False), "its schedule from mask_jitter_start to mask_jitter_base"),
        "mask_jitter_start": number(0, strict=False),
        "mask_jitter_base": number(0, strict=False),
        "mask_jitter_warmup_ratio": _FRACTION,
        "teacher_temp_start": number(0, strict=True),
        "teacher_temp_base": number(0, strict=True),
        "teacher_temp_warmup_ratio": _FRACTION,
        "student_temp": number(0, strict=True),
        "mask_loss_weight": number(0, strict=False),
        "roll_mask_loss_weight": number(0, strict=False),
        "unmask_loss_weight": number(0, strict=False),
        "momentum_base": _PROBABILITY,
        "momentum_final": _PROBABILITY,
        "match_max_k": integer(1),
        "match_max_r": number(0, strict=True),
        "up_cast_level": integer(0),
        "grid_size": number(0, strict=True),
        "grid_origin": Rule("a finite number", _is_number),
        "probe_classes": integer(0, " (pimm's online linear probe: data.num_classes, or 0 for none)"),
    },
}
# the published momentum detector (pimm.models.detector.MomentumDetector): detector-v1m1's arguments and predict_iou
# (detector_v1m2_momentum.py:1132); not pimm's momentum_head, as the published momentum regressor is always built
MODEL_OPTIONS["detector-v1m2"] = {**{k: v for k, v in MODEL_OPTIONS["detector-v1m1"].items() if k != "momentum_head"},
                                  "predict_iou": BOOL}


_ORDERS = names.SERIALIZATION_ORDERS
_ORDER_NAMES = Rule(f"one of {', '.join(_ORDERS)} or a list of them",
                    lambda v: (v in _ORDERS) if isinstance(v, str) else (
                        isinstance(v, (list, tuple)) and len(v) > 0 and all(x in _ORDERS for x in v)))
# PT-v3m2, the published backbone (pimm.models.point_transformer_v3m2): every published constructor argument
BACKBONE_OPTIONS: dict[str, dict[str, Rule]] = {
    "PT-v3m2": {
        "in_channels": integer(1, " (feature columns per point)"),
        "order": _ORDER_NAMES,
        "stride": _list_of("integers >= 1, one per pooling (len(enc_depths) - 1)", lambda x: _is_int(x) and x >= 1),
        **{key: _STAGE_LIST for key in ("enc_depths", "enc_channels", "enc_num_head", "enc_patch_size")},
        **{key: _DECODER_LIST for key in ("dec_depths", "dec_channels", "dec_num_head", "dec_patch_size")},
        "mlp_ratio": number(0, strict=True),
        "qkv_bias": BOOL,
        "qk_scale": optional(number(0, strict=True), "1 / sqrt(channels per head)"),
        "attn_drop": _FRACTION,
        "proj_drop": _FRACTION,
        "drop_path": _FRACTION,
        "layer_scale": optional(number(0, strict=False), "no LayerScale"),
        "pre_norm": BOOL,
        "shuffle_orders": BOOL,
        "enable_rpe": Rule("false: pimm's PT-v3m2 has no relative position encoding (the published recipes do not "
                           "use it; with flash attention the published code refuses it too)", lambda v: v is False),
        "enable_flash": BOOL,
        "full_attention": Rule("false (the published code ignores it too)", lambda v: v is False),
        "upcast_attention": BOOL,
        "upcast_softmax": BOOL,
        "traceable": BOOL,
        "mask_token": BOOL,
        "enc_mode": BOOL,
        "freeze_encoder": BOOL,
        "cpe_first_layer_only": BOOL,
        "cpe_shared_weight": BOOL,
        "embedding_act_layer": BOOL,
        "add_iso_features": Rule("false (the published code computes no iso feature either: its code is commented "
                                 "out)", lambda v: v is False),
        "iso_k": integer(1),
        "iso_r": optional(number(0, strict=True), "none"),
        "weight_init": _WEIGHT_INIT,
    },
}


def check_backbone_arguments(type_name: str, arguments: dict) -> None:
    """What a backbone's constructor runs on all its arguments (as check_model_arguments for models)."""
    _check_backbone({"type": type_name, **arguments}, "model.backbone")


def _check_component_options(component: dict, options: dict[str, Rule], where: str) -> None:
    """ConfigError for an option of `component` (dict(type=..., ...) at `where`) that its type does not have
    (naming the closest one) or a value its rule refuses."""
    for key, value in component.items():
        if key == "type":
            continue
        if key not in options:
            close = difflib.get_close_matches(str(key), options, n=1, cutoff=0.6)
            hint = f"did you mean '{where}.{close[0]}'? " if close else ""
            raise ConfigError(f"{where}.{key} is not an option of {component['type']}: {hint}its options are "
                              f"{', '.join(options)}. Fix or remove it in the config")
        if not options[key].ok(value):
            raise _refusal(f"{where}.{key}", value, options[key])


def _check_backbone(backbone: Any, where: str) -> None:
    if not isinstance(backbone, dict) or backbone.get("type") not in BACKBONE_OPTIONS:
        raise ConfigError(f"{where}={backbone!r:.80} is not allowed: it must be dict(type=..., ...) with type one of "
                          f"{', '.join(BACKBONE_OPTIONS)}")
    _check_component_options(backbone, BACKBONE_OPTIONS[backbone["type"]], where)
    encoder_only = backbone.get("enc_mode") is True  # its decoder lists are not used
    stages = {k: v for k, v in backbone.items() if not (encoder_only and k in _PTV3_DECODER_KEYS)}
    _check_point_transformer_stages(stages, where)
    if stages.get("enc_depths") is not None and backbone.get("stride") is not None and \
            len(backbone["stride"]) != len(backbone["enc_depths"]) - 1:
        raise ConfigError(f"{where}.stride={backbone['stride']!r} is not allowed: it has {len(backbone['stride'])} "
                          f"entries but the encoder pools {len(backbone['enc_depths']) - 1} time(s) "
                          "(len(enc_depths) - 1)")


def check_model(model: dict) -> None:
    """ConfigError for a model config its model cannot be built from: an unknown option (with the
    closest one), a value of the wrong type or range, and for PointTransformer stage lists that do
    not fit together. The launcher checks the options a config gives; each model checks all of its
    arguments, defaults included, with the same rules (check_model_arguments)."""
    _check_component_options(model, MODEL_OPTIONS[model["type"]], "model")
    if model["type"] == "PointTransformer":
        _check_point_transformer_stages(model)
    if model["type"] == "DefaultSegmentorV2":
        _check_backbone(model.get("backbone"), "model.backbone")
    if model["type"] in names.DETECTORS:
        _check_detector(model)
    if model["type"] == "Sonata-v1m1":
        _check_sonata(model)


def _check_sonata(model: dict) -> None:
    """The self-distillation options that relate to each other and to the backbone."""
    _check_backbone(model.get("backbone"), "model.backbone")
    backbone = model["backbone"]
    if backbone.get("enc_mode") is not True or backbone.get("mask_token") is not True:
        raise ConfigError("model.backbone of Sonata-v1m1 must be an encoder with a mask token: set "
                          "model.backbone.enc_mode=True and model.backbone.mask_token=True (as published)")
    channels = list(backbone.get("enc_channels") or (32, 64, 128, 256, 512))
    level = model.get("up_cast_level", 2)
    if _is_int(level) and level >= len(channels):
        raise ConfigError(f"model.up_cast_level={level} is not allowed: the encoder has {len(channels) - 1} pooled "
                          f"levels; set it to at most {len(channels) - 1}")
    width = sum(channels[len(channels) - 1 - level:]) if _is_int(level) else None
    if width is not None and model.get("head_in_channels") != width:
        raise ConfigError(f"model.head_in_channels={model.get('head_in_channels')!r} but the up-cast features are "
                          f"{width} wide (the last {level + 1} enc_channels); set model.head_in_channels={width}")
    weights = [model.get(k, d) for k, d in (("mask_loss_weight", 0.25), ("roll_mask_loss_weight", 0.25),
                                            ("unmask_loss_weight", 0.5))]
    if sum(weights) <= 0:
        raise ConfigError("model.mask_loss_weight, roll_mask_loss_weight and unmask_loss_weight are all 0: "
                          "nothing would be learned; give at least one a weight > 0")
    if model.get("num_global_view", 2) == 1 and model.get("roll_mask_loss_weight", 0.25) > 0:
        raise ConfigError("model.roll_mask_loss_weight > 0 needs two global views (model.num_global_view=2): the "
                          "roll-mask loss matches each global view with the other")


def _check_detector(model: dict) -> None:
    """The detector options that relate to each other and to its backbone."""
    _check_backbone(model.get("backbone"), "model.backbone")
    backbone = model["backbone"]
    if backbone.get("enc_mode") is True:
        width, what = sum(backbone.get("enc_channels") or (32, 64, 128, 256, 512)), "the sum of enc_channels"
    else:
        width, what = (backbone.get("dec_channels") or (64,))[0], "dec_channels[0]"
    if model.get("full_in_channels") != width:
        raise ConfigError(f"model.full_in_channels={model.get('full_in_channels')!r} but the backbone gives {width} "
                          f"channels per point ({what}); set model.full_in_channels={width}")
    classes = model.get("num_classes")
    bad = [c for c in model.get("stuff_classes") or () if _is_int(classes) and c >= classes]
    if bad:
        raise ConfigError(f"model.stuff_classes={model['stuff_classes']!r} is not allowed: class {bad[0]} is outside "
                          f"0..{classes - 1} (model.num_classes={classes})")
    if (model.get("hidden_channels", 256) or 1) % (model.get("num_heads", 16) or 1):
        raise ConfigError(f"model.hidden_channels={model.get('hidden_channels', 256)} is not a multiple of "
                          f"model.num_heads={model.get('num_heads', 16)}; choose num_heads that divides it")
    if model.get("connect_collinear") is not None and model.get("connect_radius") is None:
        raise ConfigError(f"model.connect_collinear={model['connect_collinear']!r} joins the instances that "
                          "connect_radius connects, but model.connect_radius is None (off): set model.connect_radius "
                          "(e.g. 12 for PILArNet-M voxels) or leave connect_collinear out")


def check_model_arguments(type_name: str, arguments: dict) -> None:
    """What a model's constructor runs on all its arguments: check_model of dict(type=type_name, ...)."""
    check_model({"type": type_name, **arguments})


_PTV3_STAGE_KEYS = ("enc_depths", "enc_channels", "enc_num_head", "enc_patch_size")
_PTV3_DECODER_KEYS = ("dec_depths", "dec_channels", "dec_num_head", "dec_patch_size")


def _check_point_transformer_stages(model: dict, where: str = "model") -> None:
    """The PointTransformer options that relate to each other: one entry per encoder stage, one per
    decoder stage (one fewer), channels divisible by heads."""
    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}.{key}={model[key]!r:.100} is not allowed: {why}. Fix it in the config or "
                           f"override it: -- {where}.{key}=<value>")

    stages = len(model["enc_depths"]) if model.get("enc_depths") is not None else None
    for keys, expected, what in ((_PTV3_STAGE_KEYS, stages, "the encoder has {} stage(s) (len(enc_depths))"),
                                 (_PTV3_DECODER_KEYS, None if stages is None else stages - 1,
                                  "the decoder has {} stage(s) (len(enc_depths) - 1)")):
        for key in keys:
            if expected is not None and model.get(key) is not None and len(model[key]) != expected:
                raise fail(key, f"it has {len(model[key])} entries but {what.format(expected)}, one entry each")
    for channels_key, heads_key in (("enc_channels", "enc_num_head"), ("dec_channels", "dec_num_head")):
        channels, heads = model.get(channels_key), model.get(heads_key)
        if channels is not None and heads is not None:
            for c, h in zip(channels, heads):
                if c % h:
                    raise fail(heads_key, f"{channels_key} must be divisible by it stage by stage ({c} by {h})")


def _range(lo_min: float | None) -> Rule:
    """[lo, hi] with lo <= hi (and lo > lo_min when given)."""
    def ok(v: Any) -> bool:
        return (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v) and v[0] <= v[1]
                and (lo_min is None or v[0] > lo_min))
    return Rule("[lo, hi] with " + ("lo <= hi" if lo_min is None else f"{lo_min:g} < lo <= hi"), ok)


_AXES = ("x", "y", "z")
_PROBABILITY = Rule("a probability in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1)
# the rules of each argument in names.TRANSFORMS (same names: a test keeps the two tables in step)
TRANSFORM_ARGUMENTS: dict[str, dict[str, Rule]] = {
    "RandomRotate": {"axis": one_of(_AXES), "angle": _range(None), "p": _PROBABILITY},
    "RandomFlip": {"axes": Rule("a list of axes from x, y, z", lambda v: isinstance(v, (list, tuple))
                                and all(a in _AXES for a in v)),
                   "p": _PROBABILITY},
    "Jitter": {"sigma": number(0, strict=False), "clip": optional(number(0, strict=True), "no cut")},
    "RandomScale": {"scale": _range(0.0)},
    "GridSample": {"grid_size": number(0, strict=True), "mode": one_of(("first", "sum", "random")),
                   "return_grid_coord": BOOL},
    "NormalizeCoord": {},
    "LogEnergy": {"scale": optional(number(0, strict=True), "the dataset's energy_scale")},
    "RandomCrop": {"max_points": integer(1)},
    "CenterShift": {},
    "MomentumTransform": {"keys": Rule("a list of per-point target names (e.g. ['momentum'])", lambda v: isinstance(
        v, (list, tuple)) and all(isinstance(k, str) for k in v))},
}
# transforms after which the coordinates (or energies) are not the ones NormalizeCoord (LogEnergy) saw
_MOVES_COORD = ("RandomRotate", "RandomFlip", "Jitter", "RandomScale", "CenterShift")
_CHANGES_ENERGY = ("GridSample",)  # with mode="sum"


def check_transforms(dataset: dict, where: str) -> None:
    """ConfigError for a transform list (`dataset["transforms"]`, at config key `where`) that
    pimm.data.transforms cannot build: unknown type or argument, a bad value, a transform placed
    after the feature transform it would bypass, or augment=True set as well."""
    transforms = dataset.get("transforms")
    if transforms is None:
        return
    if not isinstance(transforms, (list, tuple)):
        raise ConfigError(f"{where}.transforms={transforms!r:.80} must be None or a list of dict(type=..., ...)")
    if dataset.get("augment"):
        raise ConfigError(f"{where} sets both augment=True and transforms: the transforms replace the built-in "
                          f"augmentation, so set {where}.augment=False (or transforms=None to keep augment)")
    seen: dict[str, int] = {}
    for i, spec in enumerate(transforms):
        key = f"{where}.transforms[{i}]"
        if not isinstance(spec, dict) or "type" not in spec:
            raise ConfigError(f"{key}={spec!r:.80} must be a dict(type=..., ...) with type one of "
                              f"{', '.join(names.TRANSFORMS)}")
        kind = spec["type"]
        if kind not in names.TRANSFORMS:
            close = difflib.get_close_matches(str(kind), names.TRANSFORMS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ConfigError(f"{key}.type={kind!r} is not a transform pimm knows (one of "
                              f"{', '.join(names.TRANSFORMS)}){hint}")
        rules = TRANSFORM_ARGUMENTS[kind]
        for arg, value in spec.items():
            if arg == "type":
                continue
            if arg not in rules:
                close = difflib.get_close_matches(str(arg), rules, n=1)
                options = ", ".join(rules) or "none"
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{key}: {arg!r} is not an argument of {kind} (its arguments: {options}).{hint}")
            if not rules[arg].ok(value):
                raise ConfigError(f"{key}: {kind} {arg}={value!r:.80} is not allowed: {arg} must be "
                                  f"{rules[arg].allowed}")
        moves = kind in _MOVES_COORD
        changes = kind in _CHANGES_ENERGY and spec.get("mode", names.TRANSFORMS[kind]["mode"]) == "sum"
        for feature, bypassed in (("NormalizeCoord", moves), ("LogEnergy", changes)):
            if bypassed and feature in seen:
                raise ConfigError(f"{key}: {kind} comes after {feature} ({where}.transforms[{seen[feature]}]), "
                                  f"which has already computed the features from the points; put {feature} after it")
        seen.setdefault(kind, i)


_PRETRAINED_OPTIONS = ("path", "key_map", "strict", "skip")
_GROUP_OPTIONS = ("params", "lr_scale", "weight_decay")  # as pimm.engine.optim.GROUP_OPTIONS (no torch import here)


def check_finetune(cfg: dict) -> None:
    """The options of pretrained and of each param_groups entry (their patterns are matched against
    the model's parameter names in pimm.engine.optim)."""
    pretrained = cfg.get("pretrained")
    if isinstance(pretrained, dict):
        unknown = [k for k in pretrained if k not in _PRETRAINED_OPTIONS]
        if unknown:
            raise ConfigError(f"pretrained.{unknown[0]} is not an option of pretrained; its options are "
                              f"{', '.join(_PRETRAINED_OPTIONS)}")
    for i, group in enumerate(cfg.get("param_groups") or []):
        entry = f"param_groups[{i}]={group!r:.100}"
        unknown = [k for k in group if k not in _GROUP_OPTIONS]
        if unknown:
            raise ConfigError(f"{entry}: {unknown[0]!r} is not an option of a parameter group; its options are "
                              f"{', '.join(_GROUP_OPTIONS)}")
        if not isinstance(group.get("params"), str) or not group["params"].strip():
            raise ConfigError(f"{entry}: params must be a pattern of parameter names such as 'backbone.*' "
                              "(fnmatch, alternatives separated by '|')")
        for key in ("lr_scale", "weight_decay"):
            if key in group and not (_is_number(group[key]) and group[key] >= 0):
                raise ConfigError(f"{entry}: {key}={group[key]!r} must be a finite number >= 0")
