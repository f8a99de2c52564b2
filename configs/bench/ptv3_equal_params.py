# pimm's PointTransformer (depthwise CPE) at the parameter count of the published Panda PT-v3m2
# (configs/bench/ptv3m2_panda.py, 107.1M): the published layout (depths, heads, windows of 256, four
# orders) with every width x1.75, 108.7M parameters. The baseline of PT-v3m2's training speed
# (`pimm bench memory`, docs/performance.md); never trained.
_base_ = ["ptv3m2_panda.py"]

model = dict(
    _delete_=True,
    type="PointTransformer",
    in_channels=4,
    num_classes=5,
    grid_size=1.0,
    orders=["hilbert", "hilbert-trans", "z", "z-trans"],
    shuffle_orders=True,
    enc_depths=[3, 3, 3, 9, 3],
    enc_channels=[84, 168, 336, 672, 896],
    enc_num_head=[3, 6, 12, 24, 32],
    enc_patch_size=[256, 256, 256, 256, 256],
    dec_depths=[2, 2, 2, 2],
    dec_channels=[112, 168, 336, 672],
    dec_num_head=[4, 6, 12, 24],
    dec_patch_size=[256, 256, 256, 256],
    drop_path=0.3,
)
parallel = dict(wrap_classes=["TransformerBlock"])
