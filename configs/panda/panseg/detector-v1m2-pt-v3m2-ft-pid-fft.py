# PILArNet-M particles, their pid and their momentum, the published momentum detector "fft" recipe (full
# fine-tuning). Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m2-pt-v3m2-ft-pid-fft.py
# ("v1m2-pid-fft.py:N" below). The published file is the v1m1 pid fft file (pimm: detector-v1m1-pt-v3m2-ft-pid-fft.py,
# the base here) but for the model type and the MomentumTransform; unlike v1m2-pid-dec.py it keeps
# train_filter_use_gt=False (v1m2-pid-fft.py:32), sets no predict_iou (False) and no iou_loss_weight (the criteria
# are v1m1's, inherited: the published loss's default is 0, as is pimm's DetectorLossWeights.iou).
_base_ = ["detector-v1m1-pt-v3m2-ft-pid-fft.py"]

model = dict(type="detector-v1m2")  # v1m2-pid-fft.py:27

# v1m2-pid-fft.py:158, 175: MomentumTransform (p -> log10 p) in both transform lists, before GridSample
_momentum = dict(type="MomentumTransform", keys=("momentum",))
_scale = 768.0 * 3**0.5 / 2  # v1m2-pid-fft.py:156
_grid = dict(type="GridSample", grid_size=0.001 * _scale, mode="random", return_grid_coord=True)  # :159, 176
data = dict(
    train=dict(transforms=[
        _momentum,
        _grid,
        dict(type="RandomRotate", axis="z", angle=[-180.0, 180.0], p=0.8),  # v1m2-pid-fft.py:160-162
        dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomRotate", axis="y", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomFlip", axes=["x", "y"], p=0.5),  # v1m2-pid-fft.py:163
    ]),
    val=dict(transforms=[_momentum, _grid]),  # test_transform, v1m2-pid-fft.py:172-184
    test=dict(transforms=[_momentum, _grid]),
)
