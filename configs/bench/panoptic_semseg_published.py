# The semantic model of benchmarks/panoptic.py --timing-pairs at the published size: per-point pid classes from
# the published detector's encoder (configs/bench/panoptic_detector_published.py, pasted from
# configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-dec.py with the fft recipe's freeze_encoder=False), its levels
# up-cast and concatenated (1232 channels), then a linear head. The benchmark checks that the two backbones are equal.
_base_ = ["panoptic_detector_published.py"]

_scale = 768.0 * 3**0.5 / 2  # as configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-dec.py

model = dict(
    _delete_=True,
    type="DefaultSegmentorV2",
    num_classes=6,
    backbone_out_channels=1232,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,  # [xyz, energy]
        order=("hilbert", "hilbert-trans", "z", "z-trans"),
        stride=(2, 2, 2, 2),
        enc_depths=(3, 3, 3, 9, 3),
        enc_channels=(48, 96, 192, 384, 512),
        enc_num_head=(3, 6, 12, 24, 32),
        enc_patch_size=(256, 256, 256, 256, 256),
        dec_depths=(2, 2, 2, 2),
        dec_channels=(64, 96, 192, 384),
        dec_num_head=(4, 6, 12, 24),
        dec_patch_size=(256, 256, 256, 256),
        mlp_ratio=4,
        qkv_bias=True,
        qk_scale=None,
        layer_scale=1e-5,
        attn_drop=0.0,
        proj_drop=0.0,
        drop_path=0.3,
        shuffle_orders=True,
        pre_norm=True,
        enable_rpe=False,
        enable_flash=True,
        upcast_attention=False,
        upcast_softmax=False,
        traceable=False,
        mask_token=False,
        enc_mode=True,  # encoder only
        freeze_encoder=False,  # as the fft recipe's
    ),
    grid_size=0.001 * _scale,  # the detector's voxels (detector-v1m1-pt-v3m2-ft-pid-dec.py)
    grid_origin=384.0,
)
# the published semantic recipes' loss (configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec.py:63-64, as the
# detector follows the published detector recipe's): cross-entropy plus Lovasz-softmax at 1/20
task = dict(_delete_=True, type="SemanticSegmentation",
            loss=[dict(type="CrossEntropy", weight=1.0), dict(type="Lovasz", weight=1.0 / 20.0)])
