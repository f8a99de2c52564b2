"""Point-cloud models, built from config dicts through `MODELS`."""

from pimm.models.point_seg_net import Block, PointSegNet
from pimm.models.point_transformer import PointTransformer, TransformerBlock
from pimm.registry import Registry

MODELS = Registry("model")
MODELS.register(PointSegNet)
MODELS.register(PointTransformer)


def build_model(cfg: dict):
    """Build the model described by `cfg` (`dict(type="PointSegNet", ...)`)."""
    return MODELS.build(cfg)


__all__ = ["MODELS", "Block", "PointSegNet", "PointTransformer", "TransformerBlock", "build_model"]
