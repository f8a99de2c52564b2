"""Point-cloud models, built from config dicts through `MODELS`."""

from pimm.models.detector import Detector, DetectorOutput, MomentumDetector
from pimm.models.point_seg_net import Block, PointSegNet
from pimm.models.point_transformer import PointTransformer, TransformerBlock
from pimm.models.point_transformer_v3m2 import DefaultSegmentorV2, PointTransformerV3
from pimm.models.sonata import Sonata
from pimm.registry import Registry

MODELS = Registry("model")
MODELS.register(PointSegNet)
MODELS.register(PointTransformer)
MODELS.register(DefaultSegmentorV2)
MODELS.register(Detector, name="detector-v1m1")
MODELS.register(MomentumDetector, name="detector-v1m2")
MODELS.register(Sonata, name="Sonata-v1m1")


def build_model(cfg: dict):
    """Build the model described by `cfg` (`dict(type="PointSegNet", ...)`)."""
    return MODELS.build(cfg)


__all__ = ["MODELS", "Block", "DefaultSegmentorV2", "Detector", "DetectorOutput", "MomentumDetector", "PointSegNet",
           "PointTransformer", "PointTransformerV3",
           "TransformerBlock", "build_model"]
