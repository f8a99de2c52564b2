# Tiny config for tests: small model, few events; tests point data.*.path at generated files.
_base_ = ["../_base_/default_runtime.py"]

seed = 7
epochs = 2
batch_size = 4
batch_size_val = 4
num_worker = 0

model = dict(type="PointSegNet", in_channels=4, num_classes=5, channels=16, grid_sizes=[4, 16])
optimizer = dict(type="AdamW", lr=3e-3, weight_decay=0.0)
log_every = 1

data = dict(
    train=dict(type="LArTPCDataset", path="data/tests/train.h5", augment=True, max_len=None, skip_nonfinite=False,
               transforms=None),
    val=dict(type="LArTPCDataset", path="data/tests/val.h5", max_len=None, skip_nonfinite=False, transforms=None),
)
