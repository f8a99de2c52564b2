"""The launcher side of `pimm predict`: the model and weights of a run (or a `pimm export`
directory), the data read as the model's training inputs were, and the ranks over a hidden scratch
directory beside the output file (`.NAME.pimm-predict/`: eval.json, the held weights, per-rank
parts, logs, errors). The ranks are `python -m pimm.engine.eval_worker --eval-dir SCRATCH` (the
`pimm test` worker, with "predict": true: the plain model, every event once, no loss and no
metrics); the scratch directory is removed once the merged file is in place, and kept and named
after a failure.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from pimm import names
from pimm.checkpoint.choose import default_checkpoint, recorded_weights
from pimm.checkpoint.layout import sha256_file
from pimm.checkpoint.weights import EXPORTED_CONFIG, EXPORTED_WEIGHTS, PUBLISHED_WEIGHTS, check_weights_fit
from pimm.config import read_run_config
from pimm.config.validate import model_classes
from pimm.data.dataset import UNCHECKED_CLASSES
from pimm.data.event_format import validate_event_file
from pimm.data.pilarnet_file import DEFAULT_SPLIT, detect_revision, is_pilarnet, open_pilarnet
from pimm.data.predictions import instance_table_path
from pimm.data.transforms import preprocessing
from pimm.engine.eval_dir import HELD_WEIGHTS, write_spec
from pimm.errors import EXIT_FAILED, PimmError
from pimm.files import os_error_reason
from pimm.launch.evaluate import SCORES_OF_A_DETECTOR, hold_checked, run_eval_dir
from pimm.launch.plan import resolve_nproc, visible_gpus


@dataclass
class PredictRequest:
    """What `pimm predict` was asked (its flags)."""

    weights: Path  # a run directory or an export directory
    data: Path
    out: Path
    split: str | None = None
    checkpoint: str | None = None
    nproc_per_node: str = "1"
    batch_size: int = 1
    save_scores: bool = False


def _model_source(args: PredictRequest) -> dict:
    """{model, num_classes, class_names, weights, step, checkpoint, reader} of --weights; PimmError for
    anything but a run directory or a `pimm export` directory. `reader` is how the model's inputs were
    computed (pimm.data.transforms.preprocessing: the run's config, or the export's record of it)."""
    given: Path = args.weights
    if (given / "config.py").is_file():
        cfg = read_run_config(given / "config.py")
        which = args.checkpoint or default_checkpoint(given)
        weights, step, _ = recorded_weights(given, which)  # held when the ranks start (a training may rotate it)
        num_classes, class_names = model_classes(cfg)
        reader = preprocessing(cfg["data"])
        return {"model": cfg["model"], "num_classes": num_classes, "weights": weights, "step": step,
                "class_names": class_names,
                "checkpoint": which, "reader": reader, "run_dir": given}
    # an export in pimm's layout (model.safetensors) or the published one (model.pth: {"state_dict": module.*})
    exported = next((given / f for f in (EXPORTED_WEIGHTS, PUBLISHED_WEIGHTS) if (given / f).is_file()), None)
    if (given / EXPORTED_CONFIG).is_file() and exported is not None:
        if args.checkpoint is not None:
            raise PimmError(f"--checkpoint {args.checkpoint} picks a checkpoint of a run directory; the export "
                            f"{given} holds one set of weights: leave --checkpoint out")
        try:
            config = json.loads((given / EXPORTED_CONFIG).read_text())
            num_classes = int(config["num_classes"])
            model = config["model"]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise PimmError(f"--weights {given}: {EXPORTED_CONFIG} is unreadable ({exc}); export the run again with "
                            "`pimm export --run-dir RUN NEW_DIR`") from exc
        return {"model": model, "num_classes": num_classes, "weights": exported, "run_dir": None,
                "step": config.get("step"), "checkpoint": f"export:{config.get('checkpoint')}",
                "reader": config.get("preprocessing") or {},
                "class_names": list(config.get("class_names") or [str(i) for i in range(num_classes)])}
    what = ("does not exist" if not given.exists() else "is a file: a weights file carries no model config"
            if given.is_file() else f"holds neither config.py (a run) nor {EXPORTED_CONFIG} + {EXPORTED_WEIGHTS} "
            f"(or {PUBLISHED_WEIGHTS}: --layout published)")
    raise PimmError(f"--weights {given} {what}; give a run directory (config.py and model/) or a directory "
                    "written by `pimm export --run-dir RUN DIR`")


def _reader_options(reader: dict, pilarnet: bool) -> dict:
    """The dataset options that make new data look as the model's training inputs did: features mode,
    energy_scale and evaluation transforms always; volume_size when both are PILArNet-M layout (a
    pimm event file's volume is fixed)."""
    keys = ("features", "energy_scale", "transforms") + (("volume_size",) if pilarnet else ())
    same_layout = reader.get("dataset") == "PILArNetDataset"
    return {k: reader[k] for k in keys if k in reader and (k != "volume_size" or same_layout)}


def _data_source(args, reader: dict) -> tuple[dict, dict]:
    """(dataset config with labels=False, data identity) of --data; PimmError when it is missing or is
    neither a pimm event file nor PILArNet-M shards."""
    path: Path = args.data.absolute()
    if not path.exists():
        raise PimmError(f"--data {args.data} does not exist; give a pimm event file (.h5) or PILArNet-M shards")
    if is_pilarnet(path):
        split = args.split or DEFAULT_SPLIT
        revision = detect_revision(path, split)
        features = _reader_options(reader, pilarnet=True)
        data = {"type": "PILArNetDataset", "path": str(path), "split": split, "revision": revision, **features}
        info, _, _ = open_pilarnet(path, split, revision, num_classes=UNCHECKED_CLASSES)  # labels unused: unchecked
        identity = {k: info.get(k) for k in ("path", "size_bytes", "num_events", "content_hash", "layout",
                                              "revision", "split", "shards")}
        return data, identity
    if args.split is not None:
        raise PimmError(f"--split {args.split} chooses among PILArNet-M shards; {args.data} is one pimm event file: "
                        "leave --split out")
    info = validate_event_file(path, labels=False)
    features = _reader_options(reader, pilarnet=False)
    identity = {k: info.get(k) for k in ("path", "size_bytes", "num_events", "content_hash", "format_version")}
    return {"type": "LArTPCDataset", "path": str(path), **features}, identity


def scratch_dir(out: Path) -> Path:
    """The hidden directory beside `out` that holds a prediction's spec, parts, logs and errors."""
    return out.with_name(f".{out.name}.pimm-predict")


def prepare_predict(args: PredictRequest) -> tuple[dict, Path, Path, Path | None]:
    """Check everything before a process starts -> (spec, output file, scratch directory, the run
    whose weights the ranks load: held in the scratch directory once it exists; None for an export)."""
    out: Path = args.out.absolute()
    if out.exists():
        raise PimmError(f"--out {args.out} exists; predictions are never overwritten: give a new file name")
    if instance_table_path(out).exists():  # a detector's per-instance table goes beside the file
        raise PimmError(f"{instance_table_path(out)} exists (the per-instance table --out {args.out} would get); "
                        "predictions are never overwritten: give a new file name")
    if not out.parent.is_dir():
        what = "is a file, not a directory" if out.parent.exists() else "does not exist"
        raise PimmError(f"--out {args.out}: {out.parent} {what}; create the directory or give another path")
    if args.batch_size < 1:
        raise PimmError(f"--batch-size must be a positive number of events per process, got {args.batch_size}")
    nproc = resolve_nproc(str(args.nproc_per_node), visible_gpus())
    source = _model_source(args)
    if not 1 <= source["num_classes"] <= 256 or len(source["class_names"]) != source["num_classes"]:
        raise PimmError(f"--weights {args.weights}: {source['num_classes']} classes named {source['class_names']}; "
                        "a predictions file holds 1..256 classes, one name each")
    if source["model"].get("type") == "Sonata-v1m1":
        raise PimmError(f"--weights {args.weights} is a self-distillation run (Sonata-v1m1): it predicts no classes. "
                        "Export its encoder (pimm export --layout published) and fine-tune it, then predict with that")
    if args.save_scores and source["model"].get("type") in names.DETECTORS:
        raise PimmError(SCORES_OF_A_DETECTOR)
    if source["run_dir"] is None:  # an export: nothing rewrites it
        check_weights_fit(source["weights"], source["model"])
    data, identity = _data_source(args, source["reader"])
    weights = Path(source["weights"])
    spec = {
        "predict": True, "out": str(out), "data": data, "data_identity": identity, "split": data.get("split", "all"),
        "model": source["model"], "num_classes": source["num_classes"], "class_names": source["class_names"],
        "weights": str(weights.resolve()), "held_weights": str(weights.resolve()),
        "weights_sha256": None if source["run_dir"] else sha256_file(weights),
        "checkpoint": source["checkpoint"], "step": source["step"], "save_scores": bool(args.save_scores),
        "batch_size": int(args.batch_size), "nproc_per_node": nproc, "num_events": identity["num_events"],
    }
    return spec, out, scratch_dir(out), source["run_dir"]


def run_predict(args: PredictRequest) -> int:
    """Check, hold the weights, run the ranks; 0 once the predictions file is in place."""
    spec, out, scratch, run_dir = prepare_predict(args)
    shutil.rmtree(scratch, ignore_errors=True)  # of an earlier prediction into this file that failed
    try:
        scratch.mkdir()
    except OSError as exc:
        raise PimmError(f"--out {args.out}: cannot write in {out.parent}: {os_error_reason(exc)}; give a --out in a "
                        "writable directory") from None
    try:
        if run_dir is not None:  # one complete checkpoint, also while the run trains
            held = hold_checked(run_dir, spec["checkpoint"], scratch / HELD_WEIGHTS, spec["model"])
            spec.update(weights=str(held.source.resolve()), held_weights=str(held.path.resolve()),
                        weights_sha256=held.sha256, step=held.step)
        write_spec(scratch, spec)
    except (PimmError, OSError) as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(exc, PimmError):
            raise
        raise PimmError(f"--out {args.out}: cannot write in {out.parent}: {os_error_reason(exc)}; give a --out in a "
                        "writable directory") from None
    print(f"pimm predict: {spec['num_events']} events of {spec['data']['path']} with {spec['weights']} "
          f"(step {spec['step']}) on {spec['nproc_per_node']} process(es) -> {out}", flush=True)
    if run_eval_dir(scratch, spec["nproc_per_node"], "pimm predict", out, kept=True) != 0:
        return EXIT_FAILED
    shutil.rmtree(scratch, ignore_errors=True)
    table = instance_table_path(out)
    print(f"pimm predict: wrote {out} ({spec['num_events']} events)"
          + (f" and its per-instance table {table}" if table.exists() else ""))
    return 0
