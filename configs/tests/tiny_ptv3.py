# Tiny PT-v3m2 (the published backbone, DefaultSegmentorV2 as published) for tests: tests/tiny_semseg.py's
# data and steps with a ~40k-parameter network of 2 stages (windows of 16 voxels, so events span several).
_base_ = ["tiny_semseg.py"]

model = dict(
    _delete_=True,
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=16,
    grid_size=2.0,  # pimm's call grid-samples the points (detector units)
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2,),
        enc_depths=(2, 2),
        enc_channels=(16, 32),
        enc_num_head=(2, 4),
        enc_patch_size=(16, 16),
        dec_depths=(1,),
        dec_channels=(16,),
        dec_num_head=(2,),
        dec_patch_size=(16,),
        mlp_ratio=2,
        layer_scale=0.5,
        shuffle_orders=True,  # the parity tests check that every rank draws the same curves
        drop_path=0.2,  # keyed by step, event id and voxel: 1 and 2 ranks drop the same branches (parity tests)
    ),
)
parallel = dict(wrap_classes=["Block"])
