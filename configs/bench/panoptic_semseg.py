# The semantic model of benchmarks/panoptic.py: per-point pid classes from the same PT-v3m2 encoder as
# configs/bench/panoptic_detector.py (its levels up-cast and concatenated, 112 channels, then a linear head);
# the benchmark clusters its predicted classes with DBSCAN and checks that the two backbones are equal.
_base_ = ["panoptic_detector.py"]

model = dict(
    _delete_=True,
    type="DefaultSegmentorV2",
    num_classes=6,
    backbone_out_channels=112,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2, 2),
        enc_depths=(1, 1, 1),
        enc_channels=(16, 32, 64),
        enc_num_head=(2, 4, 8),
        enc_patch_size=(64, 64, 64),
        mlp_ratio=2,
        enc_mode=True,
        shuffle_orders=True,
        weight_init="fan_in",
    ),
)
# the published semantic recipes' loss (configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec.py:63-64, as the
# detector follows the published detector recipe's): cross-entropy plus Lovasz-softmax at 1/20
task = dict(_delete_=True, type="SemanticSegmentation",
            loss=[dict(type="CrossEntropy", weight=1.0), dict(type="Lovasz", weight=1.0 / 20.0)])
