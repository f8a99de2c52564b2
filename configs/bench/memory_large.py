# Memory benchmark (`pimm bench memory`): a 45M-parameter PointSegNet, so that its parameters,
# gradients and AdamW state (~690 MiB per DDP replica) stand well above the runtime's own
# ~280 MiB per process. The benchmark trains on random point clouds; the data paths are the
# demo's, for `pimm launch` only. batch_size 4 splits over 1, 2 and 4 ranks.
_base_ = ["../_base_/default_runtime.py"]

seed = 0
batch_size = 4

model = dict(type="PointSegNet", in_channels=4, num_classes=5, channels=1024, grid_sizes=[2, 4, 8, 16, 8, 4])
optimizer = dict(type="AdamW", lr=1e-4, weight_decay=0.01)
parallel = dict(strategy="ddp", wrap_classes=["Block"], reshard_after_forward=True, mixed_precision=False)

data = dict(
    train=dict(type="LArTPCDataset", path="data/demo/train.h5", augment=True, skip_nonfinite=False, transforms=None),
    val=dict(type="LArTPCDataset", path="data/demo/val.h5", skip_nonfinite=False, transforms=None),
)
