# A ~100M-parameter PointTransformer (99.2M): PTv3's five-stage layout, wider and deeper (16 blocks at
# 512 channels, 1024 at the coarsest stage), for FSDP2 sharding and memory studies on GPUs. The tests
# build it on the meta device only; on CPU, one forward and backward of 2 demo events took 4 s. It has
# never been trained: its lr is a transformer default, not tuned. The model keys not set here (orders,
# shuffle, mlp_ratio, classes) are the demo's; so are the data paths, for `pimm launch` only.
_base_ = ["../demo/semseg_ptv3.py"]

batch_size = 8

model = dict(
    grid_size=1.0,
    enc_depths=[2, 2, 6, 16, 2],
    enc_channels=[64, 128, 256, 512, 1024],
    enc_num_head=[2, 4, 8, 16, 32],
    enc_patch_size=[1024, 1024, 1024, 1024, 1024],
    dec_depths=[2, 2, 2, 2],
    dec_channels=[128, 128, 256, 512],
    dec_num_head=[4, 4, 8, 16],
    dec_patch_size=[1024, 1024, 1024, 1024],
    drop_path=0.3,
)
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.05)
scheduler = dict(type="OneCycleLR", max_lr=2e-3, pct_start=0.05)
parallel = dict(strategy="fsdp2", wrap_classes=["TransformerBlock"], reshard_after_forward=True, mixed_precision=True)
