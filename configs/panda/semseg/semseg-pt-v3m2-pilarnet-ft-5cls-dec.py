# PILArNet-M 5-class semantic segmentation, the published "dec" recipe: the Sonata-pretrained PT-v3m2
# encoder (Panda-Base) kept fixed, its decoder and a linear head trained with layer-wise lr decay.
# Source: DeepLearnPhysics/pimm configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec.py ("dec.py:N"
# below is its line N), with configs/_base_/default_runtime.py, pimm/datasets/pilarnet.py,
# pimm/datasets/transform.py and pimm/engines/hooks/misc.py there. Where pimm differs, the comment says so.
#   pimm launch --train.config panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec --resources.nproc-per-node 4 --
#     pretrained.path=/scratch/sonata/model_last.pth data.train.path=/scratch/pilarnet-m
#     data.val.path=/scratch/pilarnet-m data.test.path=/scratch/pilarnet-m
_base_ = ["../../_base_/default_runtime.py"]

seed = 0  # dec.py:12
epochs = 20  # dec.py:69 (eval_epoch = 20, dec.py:70, is read by no published code)
batch_size = 48  # dec.py:4, global as in pimm
num_worker = 24  # dec.py:5, global as in pimm
clip_grad = 1.0  # dec.py:7
# dec.py:9-10 (pimm: autocast on CUDA only). matmul_precision="high" (dec.py:11) has no pimm key: torch's
# default ("highest", no TF32) applies
amp = dict(enabled=True, dtype="bfloat16")
# dec.py:191-193: the CheckpointLoader hook renames the Sonata pretraining checkpoint's student backbone onto
# this model (strict=False by the hook's default): pimm's key_map="sonata" does the same rename
pretrained = dict(path=None, key_map="sonata", strict=False, skip=[])

_scale = 768.0 * 3**0.5 / 2  # dec.py:107: NormalizeCoord's scale (detector units per normalised unit)
# dec.py:24-66, pasted verbatim; grid_size and grid_origin are pimm's: the published grid_coord (NormalizeCoord
# centre 384, scale _scale, then GridSample grid_size 0.001, dec.py:107-109) in detector units
model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=64,
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
        layer_scale=0.0,
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
        enc_mode=False,  # + decoder!
        freeze_encoder=True,
    ),
    criteria=[
        # dict(type="FocalLoss", loss_weight=1.0, weight=class_weights, ignore_index=-1),
        dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1),
        dict(type="LovaszLoss", mode="multiclass", loss_weight=1.0 / 20.0, ignore_index=-1, class_weights=None),
    ],
    freeze_backbone=False,
    grid_size=0.001 * _scale,
    grid_origin=384.0,
)
# pimm computes model.criteria in its task (CE + Lovasz/20); its terms are means per event, then over the
# events of the batch, where the published criteria pool the points of the whole batch
task = dict(loss=None)

_base_lr = 0.0026  # dec.py:71
_lr_decay = 0.9  # dec.py:72
_base_wd = 0.04  # dec.py:73
# final_wd = 0.2 (dec.py:75) is not applied by the published recipe: its hooks (dec.py:182-208) have no
# WeightDecayScheduler, so the weight decay stays base_wd for the whole run, as here
optimizer = dict(type="AdamW", lr=_base_lr, weight_decay=_base_wd)  # dec.py:93
# dec.py:95-102; total_steps = epochs x steps per epoch, as the published trainer sets it
scheduler = dict(type="OneCycleLR", max_lr=_base_lr, pct_start=0.05, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=1000.0)

# The published WeightDecayExclusion hook (dec.py:194-201) gives weight decay 0 to biases and to parameters
# named *norm*, *gamma* or *token* or with one dimension; PT-v3m2's other 1-D parameters are the LayerNorms of
# cpe (cpe.2) and of the unpooling projections (up.proj.1, up.proj_skip.1), named here (pimm groups by name)
_NO_DECAY = ("*.bias", "*norm*", "*gamma*", "*token*", "*cpe.2.weight", "*up.proj.1.weight", "*up.proj_skip.1.weight")


def _block_groups(keyword, lr_scale):
    """A published param_dicts entry (substring `keyword`, lr = base_lr x lr_scale) split as the published
    WeightDecayExclusion splits it: its no-decay parameters first (pimm takes the first matching entry)."""
    return [dict(params="|".join(f"*{keyword}{p}" for p in _NO_DECAY), lr_scale=lr_scale, weight_decay=0.0),
            dict(params=f"*{keyword}*", lr_scale=lr_scale)]


# dec.py:76-91: decoder block b of stage e at base_lr x lr_decay^exp, exp from 7 (dec0.block0) down to 0
# (dec3.block1). PT-v3m2 runs dec3 first and dec0 last, so the stage nearest the output learns slowest.
_dec_depths = model["backbone"]["dec_depths"]
param_groups = []
for _e in range(len(_dec_depths)):
    for _b in range(_dec_depths[_e]):
        _exp = sum(_dec_depths) - sum(_dec_depths[:_e]) - _b - 1
        param_groups += _block_groups(f"dec{_e}.block{_b}.", _lr_decay**_exp)
param_groups.append(dict(params="|".join(_NO_DECAY), weight_decay=0.0))  # the rest: the default group's split

# dec.py:139-178. Data: v1 shards, motif labels; point data.*.path at the download root (<root>/*train/*.h5 ...)
# features="published": dec.py:107-108 NormalizeCoord (centre 384, scale _scale) and LogTransform(0.01, 20)
# (pimm.data.transforms.feature_columns), computed from the points after the transforms (Collect, dec.py:118-122)
_pilarnet = dict(type="PILArNetDataset", path="data/pilarnet", revision="v1", label="motif", min_points=1024,
                 energy_threshold=0.13, remove_low_energy_scatters=False, features="published", volume_size=768.0,
                 augment=False)
# dec.py:109: GridSample at 0.001 of the normalised coordinates is 0.665 voxel: every voxel is kept. Its
# grid_coord (return_grid_coord) is what the model voxelises; the rotations and flip after it move only
# the x, y, z feature columns (published and pimm alike). A voxel stored more than once (in two clusters)
# keeps one of its points drawn at random, as published mode="train" does.
_grid = dict(type="GridSample", grid_size=0.001 * _scale, mode="random", return_grid_coord=True)
_train_transforms = [
    _grid,
    # dec.py:111-113: angle [-1, 1] x pi about the volume centre, each axis with p=0.8
    dict(type="RandomRotate", axis="z", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomRotate", axis="y", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomFlip", axes=["x", "y"], p=0.5),  # dec.py:114 (the published default axes: x, y)
]
data = dict(
    num_classes=5,  # dec.py:140
    names=["shower", "track", "michel", "delta", "led"],  # dec.py:142
    # dec.py:143-154: max_len 1_000_000 (more than the train split holds)
    train=dict(_pilarnet, split="train", transforms=_train_transforms, max_len=1_000_000),
    val=dict(_pilarnet, split="val", transforms=[_grid], max_len=1000),  # dec.py:155-166 (test_transform)
    test=dict(_pilarnet, split="test", transforms=[_grid], max_len=1000),  # dec.py:167-177
)
# dec.py:205-206: validate (then checkpoint) every 1000 steps. The published evaluator then skips the validation
# at epoch ends; pimm validates there too (eval_every_epochs, at least 1)
eval_every_n_steps = 1000
# dec.py:207: the test split is evaluated with model_best when training ends (pimm: test_after_training).
# dec.py:16-17: use_wandb=True; pimm logs to Weights & Biases with wandb.enabled=True (offline by default)
