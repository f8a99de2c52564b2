# Demo: semantic segmentation of synthetic LArTPC events into the 5 PILArNet classes.
# `make demo` generates the data and runs this on 2 CPU processes (about 1-2 minutes).
_base_ = ["../_base_/default_runtime.py"]

seed = 42
epochs = 4
batch_size = 16
batch_size_val = 32
num_worker = 2

model = dict(type="PointSegNet", in_channels=4, num_classes=5, channels=48, grid_sizes=[2, 4, 8, 16, 4])
optimizer = dict(type="AdamW", lr=3e-3, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", max_lr=3e-3, pct_start=0.1)
clip_grad = 1.0
log_every = 20

data = dict(
    # skip_nonfinite=True: leave out events with a NaN/inf coordinate or energy (the launch refuses them otherwise)
    train=dict(type="LArTPCDataset", path="data/demo/train.h5", augment=True, skip_nonfinite=False,
               transforms=None),
    val=dict(type="LArTPCDataset", path="data/demo/val.h5", skip_nonfinite=False, transforms=None),
)
