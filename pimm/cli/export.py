"""`pimm export --run-dir RUN [--checkpoint last|best|step_N] [--layout pimm|published] OUT`: a run's weights
as a portable directory.

    OUT/model.safetensors  the full model state_dict (bare-model names); --layout pimm, the default
    OUT/model.pth          --layout published instead: {"state_dict": {"module." + name: tensor}}, the file the
                           published trainer saves and its CheckpointLoader and tester read
                           (DeepLearnPhysics/pimm pimm/engines/hooks/misc.py, pimm/engines/test.py)
    OUT/config.json        {"model": <the run's cfg["model"]>, "class_names", "num_classes", "preprocessing",
                            "pimm_version", "checkpoint", "step", "config_hash"}; no local paths.
                            preprocessing: how the model's inputs are computed (dataset type, features
                            mode, energy_scale, volume_size, evaluation transforms;
                            pimm.data.transforms.preprocessing), which `pimm predict` applies

Loading needs neither pimm's trainer nor a process group:

    config = json.load(open("OUT/config.json"))
    model = pimm.models.build_model(config["model"])
    model.load_state_dict(safetensors.torch.load_file("OUT/model.safetensors"))

and `pimm launch --train.weight OUT` warm-starts a new run from it (either layout).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pimm
from pimm.checkpoint.choose import choose_weights
from pimm.config import config_hash, read_run_config
from pimm.config.validate import model_classes
from pimm.errors import PimmError
from pimm.files import atomic_path, os_error_reason, write_atomic
from pimm.json_io import dumps

LAYOUTS = ("pimm", "published")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="write a run's weights as model.safetensors + config.json",
        description="Export a checkpoint of a run as OUT/model.safetensors (the full state_dict) and OUT/config.json "
        "(the model config, class names, pimm version, step and config hash; no local paths). Load it with "
        "safetensors.torch.load_file and pimm.models.build_model(config['model']), or warm-start a run from it "
        "with `pimm launch --train.weight OUT`. --layout published writes OUT/model.pth instead, the file the "
        "published trainer (DeepLearnPhysics/pimm, Pointcept) saves and loads: {'state_dict': {'module.' + name: "
        "tensor}}.",
    )
    p.add_argument("--run-dir", dest="run_dir", type=Path, required=True, metavar="RUN",
                   help="the run directory (with config.py and model/), e.g. exp/demo/semseg-20261202-114630")
    p.add_argument("--checkpoint", default="last", metavar="last|best|step_N",
                   help="last (default): the newest complete checkpoint; best: model/model_best.pth; step_N: the "
                   "complete checkpoint (or iter_N.pth snapshot) of optimizer step N")
    p.add_argument("--layout", choices=LAYOUTS, default="pimm",
                   help="pimm (default): model.safetensors with the model's own names; published: model.pth "
                   "holding {'state_dict': {'module.' + name: tensor}}, as the published trainer (DeepLearnPhysics/"
                   "pimm, Pointcept) saves and loads it")
    p.add_argument("out", type=Path, metavar="OUT", help="a new or empty directory to write into")
    p.set_defaults(run=run)


def _local_paths(value, where: str) -> list[str]:
    """The config keys under `where` whose values are absolute or home-relative paths."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in _local_paths(v, f"{where}.{key}")]
    if isinstance(value, list | tuple):
        return [k for i, v in enumerate(value) for k in _local_paths(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")) else []


def export_config(cfg: dict, checkpoint: str, step: int | None, layout: str = "pimm") -> dict:
    """The config.json of an export of a run with resolved config `cfg`: no data or other local paths."""
    from pimm.data.transforms import preprocessing  # deferred: h5py and numpy, only for an export

    found = _local_paths(cfg["model"], "model")
    if found:
        raise PimmError(f"the model config holds local paths ({', '.join(found)}), which an export must not carry; "
                        "remove them from model.* (weights belong in --train.weight)")
    return {
        "model": cfg["model"],
        "class_names": model_classes(cfg)[1],
        "num_classes": model_classes(cfg)[0],
        "preprocessing": preprocessing(cfg["data"]),
        "pimm_version": pimm.__version__,
        "checkpoint": checkpoint,
        "step": step,
        "config_hash": config_hash(cfg),
        "layout": layout,
    }


def run(args: argparse.Namespace) -> int:
    # deferred: torch and safetensors, only for an export, not for `pimm --help`
    from safetensors.torch import save_file

    from pimm.checkpoint.weights import (  # deferred: torch, only for an export
        EXPORTED_CONFIG,
        EXPORTED_WEIGHTS,
        PUBLISHED_WEIGHTS,
        differences,
        load_weight_file,
        match_weights,
        model_entries,
        save,
    )

    run_dir, out = args.run_dir, args.out
    if not (run_dir / "config.py").is_file():
        raise PimmError(f"--run-dir {run_dir}: {'no config.py in it' if run_dir.is_dir() else 'does not exist'}; "
                        "give the directory of a pimm run (it holds config.py and model/)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PimmError(f"{out} exists and is {'not empty' if out.is_dir() else 'a file'}; refusing to overwrite it: "
                        "give a new or empty directory")
    weights, step = choose_weights(run_dir, args.checkpoint)
    cfg = read_run_config(run_dir / "config.py")  # data: nothing in a run directory is executed
    config = export_config(cfg, args.checkpoint, step, args.layout)
    state = load_weight_file(weights)  # torch.load(weights_only=True): the same safe load as a warm start
    match = match_weights(weights, state, model_entries(cfg["model"]))
    if not match.complete:  # an export of them would not load into build_model(config["model"])
        raise PimmError(f"--checkpoint {args.checkpoint}: the weights {weights} do not fit the model of {run_dir}/"
                        f"config.py: {', '.join(differences(match))}; nothing exported. Export a checkpoint this "
                        "run saved with this config (another --checkpoint), or restore the run's config.py")
    seen: set[int] = set()
    tensors = {}
    for key, tensor in state.items():  # safetensors refuses shared storage: give tied tensors their own copy
        tensor = tensor.contiguous()
        tensors[key] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())

    try:
        out.mkdir(parents=True, exist_ok=True)
        # config.json last, each file under a temporary name first: a directory with both is a finished export
        weights_name = PUBLISHED_WEIGHTS if args.layout == "published" else EXPORTED_WEIGHTS
        with atomic_path(out / weights_name) as tmp:
            if args.layout == "published":  # the names of the published trainer's DDP model
                save({"state_dict": {"module." + key: tensor for key, tensor in tensors.items()}}, tmp)
            else:
                save_file(tensors, tmp, metadata={"format": "pt", "config_hash": config["config_hash"],
                                                  "step": str(step)})
        write_atomic(out / EXPORTED_CONFIG, dumps(config, indent=2) + "\n")
    except OSError as exc:
        raise PimmError(f"cannot write the export to {out}: {os_error_reason(exc)}; give a writable directory"
                        ) from None
    size = (out / weights_name).stat().st_size
    print(f"exported {weights} (step {step}) to {out}: {weights_name} ({len(tensors)} tensors, "
          f"{size / 2**20:.3g} MiB) and {EXPORTED_CONFIG}; warm-start a run with `pimm launch --train.weight {out}`")
    return 0
