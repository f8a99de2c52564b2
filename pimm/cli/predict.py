"""`pimm predict --weights RUN|EXPORT --data PATH`: a model's per-point predictions on data without labels.

The launcher checks the weights and the data, writes a spec into a hidden scratch directory beside
the output file (`.NAME.pimm-predict/`: eval.json, per-rank parts, logs, errors), runs torchrun with
`python -m pimm.engine.evaluation --eval-dir SCRATCH` (the `pimm test` worker, with "predict": true:
the plain model, every event once, no loss and no metrics) and removes the scratch directory once
the merged file is in place. After a failure it is kept and named.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from pimm.errors import PimmError

DEFAULT_OUT = Path("predictions.h5")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "predict", help="write a model's per-point predictions on data without labels",
        description="Predict every point's class of a pimm event file (with or without labels) or of PILArNet-M "
        "shards with the weights of a run (--checkpoint, default best, else last) or of a `pimm export` directory, "
        "on N processes (every event once). Writes one predictions file (the `pimm test --save-predictions` format, "
        "without labels) with the weights' sha256, the data's identity and the world size in its provenance.",
        usage="pimm predict --weights RUN|EXPORT_DIR --data PATH [options]",
    )
    p.add_argument("--weights", type=Path, required=True, metavar="RUN|EXPORT_DIR",
                   help="a run directory (config.py, model/) or a directory written by `pimm export`")
    p.add_argument("--data", type=Path, required=True, metavar="PATH",
                   help="a pimm event file (.h5), or PILArNet-M shards (one .h5 shard or a directory)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="FILE.h5",
                   help=f"the predictions file to write, never overwritten (default ./{DEFAULT_OUT})")
    p.add_argument("--split", default=None, metavar="S",
                   help="PILArNet-M directories: the split whose shards to read (default: the reader's, train)")
    p.add_argument("--checkpoint", default=None, metavar="best|last|step_N",
                   help="with a run directory: best (default; last when the run has no model_best.pth), last, step_N")
    p.add_argument("--resources.nproc-per-node", dest="nproc_per_node", default="1", metavar="N|auto",
                   help="processes: one per GPU, or N CPU processes with gloo (default 1)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=1, metavar="B",
                   help="events per process in one forward (default 1)")
    p.add_argument("--save-scores", action="store_true",
                   help="also every point's softmax scores (float16, one per class)")
    p.set_defaults(run=run)


def _model_source(args: argparse.Namespace) -> dict:
    """{model, num_classes, class_names, weights, step, checkpoint, reader} of --weights; PimmError for
    anything but a run directory or a `pimm export` directory. `reader` is how the model's inputs were
    computed (pimm.data.transforms.preprocessing: the run's config, or the export's record of it)."""
    from pimm.checkpoint.weights import EXPORTED_CONFIG, EXPORTED_WEIGHTS

    given: Path = args.weights
    if (given / "config.py").is_file():
        from pimm.checkpoint.choose import choose_weights
        from pimm.config import load_config
        from pimm.data.transforms import preprocessing

        cfg = load_config(given / "config.py")
        which = args.checkpoint or ("best" if (given / "model" / "model_best.pth").is_file() else "last")
        weights, step = choose_weights(given, which)
        data = cfg["data"]
        num_classes = int(data["num_classes"])
        reader = preprocessing(data)
        return {"model": cfg["model"], "num_classes": num_classes, "weights": weights, "step": step,
                "class_names": list(data.get("names") or [str(i) for i in range(num_classes)]),
                "checkpoint": which, "reader": reader}
    if (given / EXPORTED_CONFIG).is_file() and (given / EXPORTED_WEIGHTS).is_file():
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
        return {"model": model, "num_classes": num_classes, "weights": given / EXPORTED_WEIGHTS,
                "step": config.get("step"), "checkpoint": f"export:{config.get('checkpoint')}",
                "reader": config.get("preprocessing") or {},
                "class_names": list(config.get("class_names") or [str(i) for i in range(num_classes)])}
    what = ("does not exist" if not given.exists() else "is a file: a weights file carries no model config"
            if given.is_file() else f"holds neither config.py (a run) nor {EXPORTED_CONFIG} + {EXPORTED_WEIGHTS}")
    raise PimmError(f"--weights {given} {what}; give a run directory (config.py and model/) or a directory "
                    "written by `pimm export --run-dir RUN DIR`")


def _reader_options(reader: dict, pilarnet: bool) -> dict:
    """The dataset options that make new data look as the model's training inputs did: features mode,
    energy_scale and evaluation transforms always; volume_size when both are PILArNet-M layout (a
    pimm event file's volume is fixed)."""
    keys = ("features", "energy_scale", "transforms") + (("volume_size",) if pilarnet else ())
    same_layout = reader.get("dataset") == "PILArNetDataset"
    return {k: reader[k] for k in keys if k in reader and (k != "volume_size" or same_layout)}


def _data_source(args: argparse.Namespace, reader: dict) -> tuple[dict, dict]:
    """(dataset config with labels=False, data identity) of --data; PimmError when it is missing or is
    neither a pimm event file nor PILArNet-M shards."""
    from pimm.data.dataset import UNCHECKED_CLASSES
    from pimm.data.event_file import validate_event_file
    from pimm.data.pilarnet_file import DEFAULT_SPLIT, detect_revision, is_pilarnet, open_pilarnet

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


def prepare(args: argparse.Namespace) -> tuple[dict, Path, Path]:
    """Check everything before a process starts -> (spec, output file, scratch directory)."""
    from pimm.checkpoint.layout import sha256_file
    from pimm.checkpoint.weights import check_weights_fit
    from pimm.launch.plan import resolve_nproc, visible_gpus

    out: Path = args.out.absolute()
    if out.exists():
        raise PimmError(f"--out {args.out} exists; predictions are never overwritten: give a new file name")
    if not out.parent.is_dir():
        raise PimmError(f"--out {args.out}: directory {out.parent} does not exist; create it or give another path")
    if args.batch_size < 1:
        raise PimmError(f"--batch-size must be a positive number of events per process, got {args.batch_size}")
    nproc = resolve_nproc(str(args.nproc_per_node), visible_gpus())
    source = _model_source(args)
    if not 1 <= source["num_classes"] <= 256 or len(source["class_names"]) != source["num_classes"]:
        raise PimmError(f"--weights {args.weights}: {source['num_classes']} classes named {source['class_names']}; "
                        "a predictions file holds 1..256 classes, one name each")
    check_weights_fit(source["weights"], source["model"])
    data, identity = _data_source(args, source["reader"])
    spec = {
        "predict": True, "out": str(out), "data": data, "data_identity": identity, "split": data.get("split", "all"),
        "model": source["model"], "num_classes": source["num_classes"], "class_names": source["class_names"],
        "weights": str(Path(source["weights"]).resolve()), "weights_sha256": sha256_file(source["weights"]),
        "checkpoint": source["checkpoint"], "step": source["step"], "save_scores": bool(args.save_scores),
        "batch_size": int(args.batch_size), "nproc_per_node": nproc, "num_events": identity["num_events"],
    }
    return spec, out, scratch_dir(out)


def run(args: argparse.Namespace) -> int:
    from pimm.cli.evaluate import torchrun_argv
    from pimm.engine.evaluation import EVAL_SPEC, write_atomic
    from pimm.json_io import dumps
    from pimm.launch.node import run_torchrun

    spec, out, scratch = prepare(args)
    shutil.rmtree(scratch, ignore_errors=True)  # of an earlier prediction into this file that failed
    scratch.mkdir()
    write_atomic(scratch / EVAL_SPEC, dumps(spec, indent=2) + "\n")
    print(f"pimm predict: {spec['num_events']} events of {spec['data']['path']} with {spec['weights']} "
          f"(step {spec['step']}) on {spec['nproc_per_node']} process(es) -> {out}", flush=True)
    returncode, _ = run_torchrun(torchrun_argv(scratch, spec["nproc_per_node"]), None)
    if returncode != 0 or not out.is_file():
        errors = sorted((scratch / "errors").glob("rank*.txt"))
        for path in errors:
            print(f"pimm predict: {path.stem}: {path.read_text().strip()}", file=sys.stderr)
        print(f"pimm predict: failed (torchrun exit status {returncode}); logs and parts kept in {scratch}",
              file=sys.stderr)
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"pimm predict: wrote {out} ({spec['num_events']} events)")
    return 0
