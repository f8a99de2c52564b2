# The published Panda backbone at its published width (PT-v3m2 of configs/panda/semseg/
# semseg-pt-v3m2-pilarnet-ft-5cls-dec.py: 107.1M parameters with its decoder), trained end to end
# (freeze_encoder=False) for speed and memory studies: `pimm bench memory`, benchmarks/ptv3m2.py.
# The data paths are the demo's, for `pimm launch` only; grid_size 1 keeps every PILArNet-M voxel.
_base_ = ["../_base_/default_runtime.py"]

seed = 0
batch_size = 4

model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=64,
    grid_size=1.0,
    backbone=dict(
        type="PT-v3m2", in_channels=4, order=("hilbert", "hilbert-trans", "z", "z-trans"), stride=(2, 2, 2, 2),
        enc_depths=(3, 3, 3, 9, 3), enc_channels=(48, 96, 192, 384, 512), enc_num_head=(3, 6, 12, 24, 32),
        enc_patch_size=(256, 256, 256, 256, 256), dec_depths=(2, 2, 2, 2), dec_channels=(64, 96, 192, 384),
        dec_num_head=(4, 6, 12, 24), dec_patch_size=(256, 256, 256, 256), mlp_ratio=4, layer_scale=0.0,
        drop_path=0.3, shuffle_orders=True, enable_flash=True, enc_mode=False, freeze_encoder=False,
    ),
)
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.05)
parallel = dict(strategy="ddp", wrap_classes=["Block"], reshard_after_forward=True, mixed_precision=False)

data = dict(
    train=dict(type="LArTPCDataset", path="data/demo/train.h5", augment=True, skip_nonfinite=False, transforms=None),
    val=dict(type="LArTPCDataset", path="data/demo/val.h5", skip_nonfinite=False, transforms=None),
)
