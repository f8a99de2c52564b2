# PILArNet-M particles, their pid and their momentum, the published momentum detector "dec" recipe: the v1m1 pid dec
# recipe with the published momentum regressor (detector-v1m2) learning log10 p of each matched particle.
# Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m2-pt-v3m2-ft-pid-dec.py ("v1m2-pid-dec.py:N" below
# is its line N) and pimm/models/panda_detector/detector_v1m2_momentum.py there. The published file is the v1m1
# pid dec file (pimm: detector-v1m1-pt-v3m2-ft-pid-dec.py, the base here, every value cited there) but for the
# lines set here; its other lines are equal to v1m1's, shifted by up to 3.
#   pimm launch --train.config panda/panseg/detector-v1m2-pt-v3m2-ft-pid-dec --resources.nproc-per-node 8 --
#     pretrained.path=/scratch/sonata/model_last.pth data.train.path=/scratch/pilarnet-m
#     data.val.path=/scratch/pilarnet-m data.test.path=/scratch/pilarnet-m
_base_ = ["detector-v1m1-pt-v3m2-ft-pid-dec.py"]

model = dict(
    type="detector-v1m2",  # v1m2-pid-dec.py:27
    train_filter_use_gt=True,  # v1m2-pid-dec.py:32: in training the queries attend to the true non-stuff points
    predict_iou=False,  # v1m2-pid-dec.py:34: no IoU head (its loss weight below then has nothing to weigh)
    # v1m2-pid-dec.py:89-107, pasted verbatim: v1m1's criteria plus iou_loss_weight (v1m2-pid-dec.py:100)
    criteria=[
        dict(
            type="InstanceSegmentationLoss",
            cost_mask=1.0,
            cost_dice=1.0,
            cost_class=1.0,
            loss_weight_focal=2.0,
            loss_weight_dice=5.0,
            cls_weight_matched=2.0,
            cls_weight_noobj=0.5,
            momentum_loss_weight=1.0,
            iou_loss_weight=1.0,
            focal_alpha=0.25,
            focal_gamma=2.0,
            aux_loss_weight=1.0,
            num_points=100_000,
            truth_label="instance",
        ),
    ],
)

# v1m2-pid-dec.py:147, 164: MomentumTransform (p -> log10 p) in both transform lists, before GridSample; the momentum
# target reaches pimm's batch with instances=True (the published Collect adds it, v1m2-pid-dec.py:157, 170)
_momentum = dict(type="MomentumTransform", keys=("momentum",))
_scale = 768.0 * 3**0.5 / 2  # v1m2-pid-dec.py:145
_grid = dict(type="GridSample", grid_size=0.001 * _scale, mode="random", return_grid_coord=True)  # :148, 165
data = dict(
    train=dict(transforms=[
        _momentum,
        _grid,
        dict(type="RandomRotate", axis="z", angle=[-180.0, 180.0], p=0.8),  # v1m2-pid-dec.py:149-151
        dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomRotate", axis="y", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomFlip", axes=["x", "y"], p=0.5),  # v1m2-pid-dec.py:152
    ]),
    val=dict(transforms=[_momentum, _grid]),  # test_transform, v1m2-pid-dec.py:161-173
    test=dict(transforms=[_momentum, _grid]),
)
# pimm's panoptic metrics compare the predicted and true momentum in this log10 space (momentum resolution)
