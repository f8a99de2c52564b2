# Demo with the published backbone: DefaultSegmentorV2 + PT-v3m2 (pimm.models.point_transformer_v3m2)
# at demo size, the same data, task and batch as demo/semseg.py and the layout of demo/semseg_ptv3.py
# (its lr and schedule too). Not a published configuration: the published Panda widths are in
# configs/panda/semseg/ and configs/bench/ptv3m2_panda.py. Every repeated unit is a Block, which FSDP2 shards.
_base_ = ["semseg.py"]

model = dict(
    _delete_=True,
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=32,
    grid_size=2.0,  # voxel edge in coordinate units: points of one voxel share its logits
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2, 2, 2),
        enc_depths=(1, 1, 2, 1),
        enc_channels=(32, 48, 96, 128),
        enc_num_head=(2, 3, 6, 8),
        enc_patch_size=(128, 128, 128, 128),
        dec_depths=(1, 1, 1),
        dec_channels=(32, 48, 96),
        dec_num_head=(2, 3, 6),
        dec_patch_size=(128, 128, 128),
        mlp_ratio=4,
        layer_scale=None,
        drop_path=0.0,
        shuffle_orders=True,
    ),
)
optimizer = dict(type="AdamW", lr=8e-3, weight_decay=0.05)
scheduler = dict(type="OneCycleLR", max_lr=8e-3, pct_start=0.05)
parallel = dict(wrap_classes=["Block"])
