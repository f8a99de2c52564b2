"""How a model's linear and sparse convolution layers start: `weight_init=` of PT-v3m2 and the detectors.

- "trunc_normal" (the published default): weights from a normal of standard deviation 0.02 (truncated at
  +-2, which is 100 standard deviations: in effect none), biases zero, at every width (Pointcept's PT-v3
  `_init_weights`; DeepLearnPhysics/pimm pimm/models/panda_detector/detector_v1m1.py:693-698). Made for
  widths of hundreds of channels.
- "fan_in": each layer as torch builds it, weights and biases uniform within +-1/sqrt(fan_in) (nn.Linear's
  reset_parameters, pimm's SubMConv3d the same), so a layer's output has about the scale of its input at
  any width. At the published widths the two are close (std 0.036 against 0.02 for 256 inputs); at a few
  dozen channels "trunc_normal" starts every layer five times smaller, and the product of two such
  layers (a mask logit) near 0 (docs/panoptic.md, "Training from scratch at a small width").
"""

from __future__ import annotations

from torch import nn

from pimm.models.sparse_conv import SubMConv3d
from pimm.names import WEIGHT_INITS


def initialise(module: nn.Module, scheme: str) -> None:
    """Start every nn.Linear (and SubMConv3d) inside `module` by `scheme` (module docstring)."""
    if scheme not in WEIGHT_INITS:
        raise ValueError(f"weight_init={scheme!r} is not allowed: use one of {', '.join(WEIGHT_INITS)}")
    if scheme == "trunc_normal":
        module.apply(_trunc_normal)
    # "fan_in": the layers already start so (their own reset_parameters at construction)


def _trunc_normal(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, SubMConv3d)):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
