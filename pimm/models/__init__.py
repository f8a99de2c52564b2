"""Point-cloud models, built from config dicts through `MODELS`."""

from pimm.models.point_seg_net import Block, PointSegNet
from pimm.registry import Registry

MODELS = Registry("model")
MODELS.register(PointSegNet)


def build_model(cfg: dict):
    """Build the model described by `cfg` (`dict(type="PointSegNet", ...)`)."""
    return MODELS.build(cfg)


__all__ = ["MODELS", "Block", "PointSegNet", "build_model"]
