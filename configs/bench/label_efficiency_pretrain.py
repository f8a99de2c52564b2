# benchmarks/label_efficiency.py, pretraining: the tiny Sonata-v1m1 of configs/tests/tiny_pretrain.py (an 86k-parameter
# PT-v3m2 encoder) on the published features (features="published": x, y, z in the unit ball around the detector
# centre, the published log energy), so that its views and the fine-tuning inputs share one scale. The benchmark sets
# data.train.path and the number of events (one epoch) from its time budget.
_base_ = ["../tests/tiny_pretrain.py"]

_grid = 0.003  # normalised units: two detector voxels (one voxel is 1 / (768 * sqrt(3) / 2) = 0.0015)
# probe_classes=0: pretraining reads no label (the online probe would learn the motif classes from them)
model = dict(mask_jitter=_grid / 2, match_max_r=2 * _grid, grid_size=_grid, probe_classes=0)
batch_size = 8
# the published schedule (pretrain-sonata-v1m1-pilarnet-smallmask.py:113-120) at tiny_pretrain.py's lr
scheduler = dict(type="OneCycleLR", pct_start=0.05, anneal_strategy="cos", div_factor=10.0, final_div_factor=1000.0)
log_every = 10
checkpoint_async = False  # the benchmark exports the last checkpoint as soon as the run ends
data = dict(train=dict(features="published", revision="v1", min_points=50), val=None)
