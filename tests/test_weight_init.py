"""weight_init of PT-v3m2 and the detectors (pimm.models.weight_init): "trunc_normal" starts every linear and sparse
convolution layer as the published code does, the stuff head included; "fan_in" as torch builds them, at the scale
of their width; anything else is refused before any process starts."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import REPO, pimm_in_process
from torch import nn

from pimm.config import load_config
from pimm.models import build_model
from pimm.models.sparse_conv import SubMConv3d


def tiny_detector(weight_init: str | None = None) -> nn.Module:
    """configs/tests/tiny_panoptic.py's detector, decoder and backbone started by `weight_init` (None: the default)."""
    model = load_config(REPO / "configs/tests/tiny_panoptic.py")["model"]
    if weight_init is not None:
        model = {**model, "weight_init": weight_init, "backbone": {**model["backbone"], "weight_init": weight_init}}
    torch.manual_seed(0)
    return build_model(model)


def layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, SubMConv3d))}


def fan_in(layer: nn.Module) -> int:
    return layer.weight[0].numel()  # Linear (out, in); SubMConv3d (out, k, k, k, in)


def test_the_default_starts_every_layer_as_published_the_stuff_head_too():
    found = layers(tiny_detector())
    assert {"decoder.stuff_head.0", "decoder.stuff_head.2", "decoder.blocks.0.mask_mlp.fc1"} <= set(found)
    assert any(isinstance(layer, SubMConv3d) for name, layer in found.items() if name.startswith("backbone."))
    for name, layer in found.items():
        weight = layer.weight.detach()
        # torch's (and timm's) truncation is at +-2 itself, 100 standard deviations: in effect a normal of std 0.02
        assert weight.abs().max() < 0.15, name
        if weight.numel() >= 500:
            assert 0.016 < weight.std() < 0.024, (name, weight.std())
        if layer.bias is not None:
            assert not layer.bias.detach().any(), name


def test_fan_in_starts_every_layer_at_the_scale_of_its_width():
    found = layers(tiny_detector("fan_in"))
    for name, layer in found.items():
        bound = 1 / math.sqrt(fan_in(layer))
        weight = layer.weight.detach()
        assert weight.abs().max() <= bound + 1e-6, name
        if weight.numel() >= 500:  # uniform in +-bound: standard deviation bound / sqrt(3)
            assert abs(weight.std() / (bound / math.sqrt(3)) - 1) < 0.15, (name, weight.std(), bound)
        if layer.bias is not None:
            assert layer.bias.detach().abs().max() <= bound + 1e-6 and layer.bias.detach().any(), name


def test_fan_in_mask_logits_start_away_from_zero_where_the_published_start_is_flat():
    """The product of two layers started at std 0.02 (a query's mask embedding against a point's) is near zero for
    every (query, point) at 32 channels: every mask starts as sigmoid ~0.5 everywhere. Started at their width, the
    masks differ between queries and points from the first step."""
    spread = {}
    for scheme in ("trunc_normal", "fan_in"):
        model = tiny_detector(scheme)
        decoder = model.decoder
        torch.manual_seed(1)
        feat, coord = torch.randn(300, 48), torch.randn(300, 3)
        with torch.no_grad():
            out = decoder(feat, torch.tensor([300]), coord)
        spread[scheme] = out.layers[0].mask_logits.std().item()
    # measured: 0.036 and 1.04 (sigmoid within 0.01 of 0.5 for a typical point, against 0.26 to 0.74)
    assert spread["trunc_normal"] < 0.1 and spread["fan_in"] > 0.5, spread


@pytest.mark.parametrize("where", ["model", "model.backbone"])
def test_an_unknown_weight_init_is_refused_before_any_process_starts(tmp_path, where):
    config = tmp_path / "mine.py"
    value = 'dict(weight_init="xavier")' if where == "model" else 'dict(backbone=dict(weight_init="xavier"))'
    config.write_text(f'_base_ = ["{REPO}/configs/tests/tiny_panoptic.py"]\nmodel = {value}\n')
    res = pimm_in_process(["launch", "--train.config", str(config), "--paths.exp-root", str(tmp_path / "exp"),
                           "--dry-run"], cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{where}.weight_init='xavier' is not allowed" in lines[0], res.stderr
    assert "trunc_normal, fan_in" in lines[0], res.stderr
    assert not (tmp_path / "exp").exists()
