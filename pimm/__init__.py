"""pimm: distributed training for 3D point clouds from particle-imaging detectors."""

__version__ = "0.1.0"
