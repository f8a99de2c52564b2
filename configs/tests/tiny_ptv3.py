# Tiny PointTransformer for tests: tests/tiny_semseg.py's data and steps with a 32k-parameter
# transformer of 2 stages (patches of 16 voxels, so events span several patches).
_base_ = ["tiny_semseg.py"]

model = dict(
    _delete_=True,
    type="PointTransformer",
    in_channels=4,
    num_classes=5,
    grid_size=2.0,
    orders=["z", "z-trans", "hilbert", "hilbert-trans"],
    shuffle_orders=True,  # the parity tests check that every rank draws the same curves
    enc_depths=[2, 2],
    enc_channels=[16, 32],
    enc_num_head=[2, 4],
    enc_patch_size=[16, 16],
    dec_depths=[1],
    dec_channels=[16],
    dec_num_head=[2],
    dec_patch_size=[16],
    mlp_ratio=2.0,
    drop_path=0.2,  # keyed by step and event id: 1 and 2 ranks drop the same branches (the parity tests)
)
parallel = dict(wrap_classes=["TransformerBlock"])
