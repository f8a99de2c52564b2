# benchmarks/label_efficiency.py, fine-tuning: the encoder of label_efficiency_pretrain.py in a DefaultSegmentorV2
# with a linear head on its up-cast multi-scale features (16 + 32 + 32 channels per point, as the published lin
# recipe, configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-lin.py), motif classes. The benchmark picks the
# mode: scratch (random encoder, every weight trained), lin (pretrained.path set, model.freeze_backbone=True) or
# fft (pretrained.path set, every weight trained, same optimizer as scratch), and the paths, epochs and max_len.
_base_ = ["../_base_/default_runtime.py"]

seed = 3
batch_size = 10
batch_size_val = 10
log_every = 10
checkpoint_async = False
test_after_training = False

_scale = 768.0 * 3**0.5 / 2  # detector units per normalised unit (the published NormalizeCoord scale)
_grid = 0.003 * _scale  # label_efficiency_pretrain.py's grid_size, in detector units
model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=80,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2, 2),
        enc_depths=(1, 1, 1),
        enc_channels=(16, 32, 32),
        enc_num_head=(2, 4, 4),
        enc_patch_size=(32, 32, 32),
        mlp_ratio=2,
        enc_mode=True,
        shuffle_orders=True,
        drop_path=0.0,
    ),
    freeze_backbone=False,
    grid_size=_grid,
    grid_origin=384.0,
)
task = dict(loss=[dict(type="CrossEntropy", weight=1.0)])
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", pct_start=0.05, anneal_strategy="cos", div_factor=10.0, final_div_factor=1000.0)
# the student's encoder of a `pimm export --layout published` payload; the mask token and heads are left out
pretrained = dict(path=None, key_map="sonata", strict=False, skip=[])

# as the published lin recipe: the grid fixed first, then the x, y, z features centred (the views of pretraining are
# centred too), rotated and flipped in training
_grid_sample = dict(type="GridSample", grid_size=_grid, mode="random", return_grid_coord=True)
_pilarnet = dict(type="PILArNetDataset", path="data/label_efficiency", revision="v1", label="motif", min_points=50,
                 features="published")
data = dict(
    num_classes=5,
    names=["shower", "track", "michel", "delta", "low_energy"],
    train=dict(_pilarnet, split="train", max_len=None, transforms=[  # max_len: the benchmark's labelled count
        _grid_sample,
        dict(type="CenterShift"),
        dict(type="RandomRotate", axis="z", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomRotate", axis="y", angle=[-180.0, 180.0], p=0.8),
        dict(type="RandomFlip", axes=["x", "y", "z"], p=0.5),
    ]),
    val=dict(_pilarnet, split="val", transforms=[_grid_sample, dict(type="CenterShift")]),
)
