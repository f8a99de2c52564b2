"""Run the published PT-v3m2 (DeepLearnPhysics/pimm) on this machine, to derive what pimm's copy is held to.

A development tool, not part of pimm or its tests: it needs a checkout of the published repository
(`--published`, e.g. the bare mirror that `git clone --mirror https://github.com/DeepLearnPhysics/pimm`
makes; files are read with `git show HEAD:<path>`) and spconv (the CPU wheel, pimm's test extra).
It copies the published model files into a temporary package named `published_pimm` and stands in
for what they import and this machine lacks, without changing what they compute:

* `torch_scatter.segment_csr` -> `torch.segment_reduce` over the same offsets (the same reductions);
* `timm`'s `DropPath` -> per-row stochastic depth (only used in training; the references run in eval);
* `addict.Dict` -> a dict with attribute access;
* spconv's `SubMConv3d` adds its bias after the convolution (spconv's CPU eval path refuses a bias);
* `flash_attn.flash_attn_varlen_qkvpacked_func` -> exact attention per window of `cu_seqlens`, and the
  published cast of q, k, v to bfloat16 before flash is removed, so the reference is float32 throughout;
* `timm`'s `trunc_normal_` -> torch's, and the detector's `get_world_size` -> 1 (one process builds it).

Three commands:

    python scripts/published_reference.py manifest --published MIRROR --out tests/data/published_ptv3m2_manifest.json
    python scripts/published_reference.py outputs --published MIRROR --out tests/data/published_ptv3m2_outputs.pt
    python scripts/published_reference.py detector-manifest --published MIRROR \
        --out tests/data/published_detector_manifest.json

`manifest` builds the published segmentor for each configuration of `CONFIGURATIONS` and writes every
state_dict entry's name, shape and dtype; `outputs` writes small seeded models' weights, inputs and
the published eval outputs (per-point logits) for pimm's tests to compare against; `detector-manifest`
builds the published Detector (detector-v1m1, and the momentum detector detector-v1m2, each with its
MaskQueryDecoder) from the `model` of each recipe in `DETECTOR_RECIPES`, read from the published config file
itself, and writes that model config and every state_dict entry's name, shape and dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import types
import zlib
from pathlib import Path

import torch

PUBLISHED_FILES = {
    "pimm/models/point_transformer_v3/point_transformer_v3m2_sonata.py": "ptv3m2.py",
    "pimm/models/utils/structure.py": "utils/structure.py",
    "pimm/models/utils/misc.py": "utils/misc.py",
    "pimm/models/utils/serialization/__init__.py": "utils/serialization/__init__.py",
    "pimm/models/utils/serialization/default.py": "utils/serialization/default.py",
    "pimm/models/utils/serialization/hilbert.py": "utils/serialization/hilbert.py",
    "pimm/models/utils/serialization/z_order.py": "utils/serialization/z_order.py",
    "pimm/models/modules.py": "modules.py",
    "pimm/models/default.py": "default.py",
    "pimm/models/panda_detector/detector_v1m1.py": "detector_v1m1.py",
    "pimm/models/panda_detector/detector_v1m2_momentum.py": "detector_v1m2.py",
    "pimm/models/panda_detector/postprocess.py": "postprocess.py",
}
# the published detector recipes whose model detector-manifest builds, at their published widths: name -> (file,
# changes to its `model`). "v1m2-pid-dec-iou" is the momentum detector with its optional IoU head (predict_iou=True,
# detector_v1m2_momentum.py:1132), which no published recipe turns on
DETECTOR_RECIPES = {
    **{name: (f"configs/panda/panseg/detector-v1m1-pt-v3m2-ft-{name}.py", {}) for name in ("pid-dec", "vtx-dec")},
    "v1m2-pid-dec": ("configs/panda/panseg/detector-v1m2-pt-v3m2-ft-pid-dec.py", {}),
    "v1m2-pid-dec-iou": ("configs/panda/panseg/detector-v1m2-pt-v3m2-ft-pid-dec.py", {"predict_iou": True}),
}

# the published recipes' backbones (configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-*.py) and the
# variants the published code builds (LayerScale off, mask token, encoder only)
_PANDA = dict(type="PT-v3m2", in_channels=4, order=("hilbert", "hilbert-trans", "z", "z-trans"), stride=(2, 2, 2, 2),
              enc_depths=(3, 3, 3, 9, 3), enc_channels=(48, 96, 192, 384, 512), enc_num_head=(3, 6, 12, 24, 32),
              enc_patch_size=(256, 256, 256, 256, 256), dec_depths=(2, 2, 2, 2), dec_channels=(64, 96, 192, 384),
              dec_num_head=(4, 6, 12, 24), dec_patch_size=(256, 256, 256, 256), mlp_ratio=4, qkv_bias=True,
              qk_scale=None, layer_scale=0.0, attn_drop=0.0, proj_drop=0.0, drop_path=0.3, shuffle_orders=True,
              pre_norm=True, enable_rpe=False, enable_flash=True, upcast_attention=False, upcast_softmax=False,
              traceable=False, mask_token=False, enc_mode=False, freeze_encoder=True)
CONFIGURATIONS = {
    "semseg-dec": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=64, backbone=_PANDA),
    "semseg-lin": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=1232,
                       backbone={**_PANDA, "enc_mode": True, "traceable": True, "freeze_encoder": False}),
    "semseg-no-layer-scale": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=64,
                                  backbone={**_PANDA, "layer_scale": None}),
    "encoder-mask-token": dict(type="DefaultSegmentorV2", num_classes=0, backbone_out_channels=512,
                               backbone={**_PANDA, "enc_mode": True, "mask_token": True}),
    "semseg-mlp-head": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=64, mlp_head=True,
                            backbone=_PANDA),
}


def _stub(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


class _AttrDict(dict):
    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


class _DropPath(torch.nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


def _flash_varlen(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None):
    out = torch.empty_like(qkv[:, 0])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = qkv[start:end].permute(1, 2, 0, 3)  # (H, L, D) each
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=softmax_scale).transpose(0, 1)
    return out


def published_text(mirror: Path, path: str) -> str:
    """A file of the published repository's HEAD."""
    return subprocess.run(["git", "-C", str(mirror), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def load_published(mirror: Path) -> types.ModuleType:
    """The published DefaultSegmentorV2, PT-v3m2 and Detector as an importable package `published_pimm`."""
    import spconv.pytorch as spconv

    class SubMConv3dBiasAfter(spconv.SubMConv3d):
        def forward(self, x):
            bias = self.bias
            self.bias = None
            try:
                out = super().forward(x)
            finally:
                self.bias = bias
            return out if bias is None else out.replace_feature(out.features + bias)

    spconv.SubMConv3d = SubMConv3dBiasAfter
    _stub("addict", Dict=_AttrDict)
    _stub("timm")
    _stub("timm.models")
    _stub("timm.models.layers", DropPath=_DropPath, trunc_normal_=torch.nn.init.trunc_normal_)
    _stub("torch_scatter", segment_csr=lambda src, indptr, reduce="sum": torch.segment_reduce(
        src, reduce, offsets=indptr, axis=0))
    _stub("pointops")
    _stub("flash_attn", flash_attn_varlen_qkvpacked_func=_flash_varlen)
    _stub("torch_cluster")
    # the published PointSequential asks whether a module is one of ocnn's convolutions: none is
    _stub("ocnn", nn=types.SimpleNamespace(**{name: type(name, (), {}) for name in (
        "OctreeConv", "OctreeDeconv", "OctreeGroupConv", "OctreeDWConv")}))

    root = Path(tempfile.mkdtemp(prefix="published-pimm-")) / "published_pimm"
    for source, target in PUBLISHED_FILES.items():
        text = published_text(mirror, source)
        for old, new in (("from pimm.models.utils", "from published_pimm.utils"),
                         ("from pimm.models.modules", "from published_pimm.modules"),
                         ("from pimm.models.builder", "from published_pimm.builder"),
                         ("from pimm.models.losses", "from published_pimm.builder"),
                         ("from .builder", "from published_pimm.builder"),
                         ("from pimm.engines.hooks import HookBase", "HookBase = object"),
                         ("from pimm.utils.comm", "from published_pimm.comm"),
                         ("qkv.to(torch.bfloat16)", "qkv")):  # the last: the reference attends in float32
            text = text.replace(old, new)
        path = root / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "utils" / "__init__.py").write_text(
        "from .misc import offset2batch, offset2bincount, bincount2offset, batch2offset, off_diagonal\n")
    (root / "__init__.py").write_text("")
    (root / "comm.py").write_text("def get_world_size():\n    return 1\n")
    (root / "builder.py").write_text(
        "class Registry(dict):\n"
        "    def register_module(self, name=None, module=None):\n"
        "        def add(cls):\n"
        "            self[name or cls.__name__] = cls\n"
        "            return cls\n"
        "        return add\n"
        "MODELS = Registry()\n"
        "def build_model(cfg):\n"
        "    cfg = dict(cfg)\n"
        "    return MODELS[cfg.pop('type')](**cfg)\n"
        "def build_criteria(cfg):\n"
        "    return None\n")
    sys.path.insert(0, str(root.parent))
    import published_pimm.default  # noqa: F401  (registers DefaultSegmentorV2)
    import published_pimm.detector_v1m1  # noqa: F401  (registers detector-v1m1)
    import published_pimm.detector_v1m2  # noqa: F401  (registers detector-v1m2)
    import published_pimm.ptv3m2  # noqa: F401  (registers PT-v3m2)
    from published_pimm import builder

    return builder


def manifest(builder) -> dict:
    out = {}
    for name, cfg in CONFIGURATIONS.items():
        model = builder.build_model(cfg)
        out[name] = {"config": cfg, "state_dict": {k: [list(v.shape), str(v.dtype).replace("torch.", "")]
                                                       for k, v in model.state_dict().items()}}
    return out


def published_model_config(mirror: Path, path: str) -> dict:
    """The `model` dict of a published config file (it imports nothing and reads only its own names)."""
    text = published_text(mirror, path)
    namespace: dict = {}
    exec(compile(text, path, "exec"), namespace)  # noqa: S102  (a development tool reading the published recipe)
    return namespace["model"]


def detector_manifest(builder, mirror: Path) -> dict:
    out = {}
    for name, (path, changes) in DETECTOR_RECIPES.items():
        cfg = {**published_model_config(mirror, path), **changes}
        model = builder.build_model(cfg)
        out[name] = {"source": path, "config": cfg,
                     "state_dict": {k: [list(v.shape), str(v.dtype).replace("torch.", "")]
                                    for k, v in model.state_dict().items()}}
    return out


SMALL = dict(type="PT-v3m2", in_channels=4, order=("hilbert", "hilbert-trans", "z", "z-trans"), stride=(2, 2),
             enc_depths=(2, 2, 2), enc_channels=(16, 24, 32), enc_num_head=(2, 3, 4), enc_patch_size=(24, 24, 24),
             dec_depths=(2, 2), dec_channels=(16, 24), dec_num_head=(2, 3), dec_patch_size=(24, 24), mlp_ratio=2,
             layer_scale=0.5, drop_path=0.0, shuffle_orders=False, enable_flash=True, upcast_attention=False,
             upcast_softmax=False, traceable=True, enc_mode=False)
REFERENCE_MODELS = {
    "dec": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=16, backbone=SMALL),
    "lin": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=72,
                backbone={**SMALL, "enc_mode": True}),
    "no-flash": dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=16,
                     backbone={**SMALL, "enable_flash": False, "layer_scale": None}),
}


def reference_weights(state_dict: dict) -> dict:
    """Weights that depend on each entry's name and shape only (no stored file needed): normal with
    1 / sqrt(fan-in) for matrices and kernels, about 1 for norm weights and LayerScale gammas, small
    elsewhere, so that every parameter shapes the output."""
    weights = {}
    for name, value in state_dict.items():
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
        if value.dim() >= 2:
            weights[name] = noise / math.sqrt(math.prod(value.shape[1:]))
        elif name.endswith("gamma") or (name.endswith("weight") and "norm" in name or ".cpe.2." in name
                                         or ".proj.1." in name or ".proj_skip.1." in name):
            weights[name] = 1.0 + 0.1 * noise
        else:
            weights[name] = 0.1 * noise
        weights[name] = weights[name].to(value.dtype)
    return weights


def reference_inputs(seed: int = 0) -> dict:
    """Three events of tracks and blobs on an integer grid (40, 23 and 70 voxels: one below the patch)."""
    generator = torch.Generator().manual_seed(seed)
    grids, feats, sizes = [], [], (40, 23, 70)
    for n in sizes:
        start = torch.randint(0, 20, (3,), generator=generator)
        steps = torch.randint(-1, 2, (n, 3), generator=generator)
        grid = (start + steps.cumsum(0)).clamp(min=0)
        grid = torch.unique(grid, dim=0)[torch.randperm(len(torch.unique(grid, dim=0)), generator=generator)]
        grids.append(grid)
        feats.append(torch.randn(len(grid), 4, generator=generator))
    grid_coord = torch.cat(grids).int()
    offset = torch.tensor([len(g) for g in grids]).cumsum(0)
    return {"coord": grid_coord.float() * 0.01, "grid_coord": grid_coord, "feat": torch.cat(feats),
            "offset": offset, "grid_size": 0.01}


def outputs(builder) -> dict:
    torch.set_num_threads(1)  # spconv's CPU path varies from run to run with several threads
    result = {"inputs": reference_inputs(), "models": {}}
    for name, cfg in REFERENCE_MODELS.items():
        model = builder.build_model(cfg).eval()
        model.load_state_dict(reference_weights(model.state_dict()))
        with torch.no_grad():
            torch.manual_seed(7)  # the pooled levels draw their order permutation from the global RNG
            inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in result["inputs"].items()}
            logits = model(inputs)["seg_logits"]
        result["models"][name] = {"config": cfg, "seg_logits": logits, "rng_seed": 7}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("manifest", "outputs", "detector-manifest"))
    parser.add_argument("--published", type=Path, required=True, help="the published repository (a git dir)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    builder = load_published(args.published)
    if args.what == "manifest":
        args.out.write_text(json.dumps(manifest(builder), indent=1, sort_keys=True) + "\n")
    elif args.what == "detector-manifest":
        args.out.write_text(json.dumps(detector_manifest(builder, args.published), indent=1, sort_keys=True) + "\n")
    else:
        torch.save(outputs(builder), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
