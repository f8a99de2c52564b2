# PILArNet-M 5-class semantic segmentation, the published "lin" recipe (linear probing): the Sonata-pretrained
# PT-v3m2 encoder (Panda-Base) frozen, its multi-scale features up-cast to the points (48+96+192+384+512 = 1232
# channels) and a linear head trained on them.
# Source: DeepLearnPhysics/pimm configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-lin.py ("lin.py:N" below
# is its line N), with configs/_base_/default_runtime.py, pimm/datasets/pilarnet.py, pimm/datasets/transform.py
# and pimm/engines/hooks/misc.py there. Where pimm differs, the comment says so.
#   pimm launch --train.config panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-lin --resources.nproc-per-node 4 --
#     pretrained.path=/scratch/sonata/model_last.pth data.train.path=/scratch/pilarnet-m
#     data.val.path=/scratch/pilarnet-m data.test.path=/scratch/pilarnet-m
_base_ = ["../../_base_/default_runtime.py"]

seed = 0  # lin.py:12
epochs = 20  # lin.py:69 (eval_epoch = 20, lin.py:70, is read by no published code)
batch_size = 48  # lin.py:4, global as in pimm
num_worker = 24  # lin.py:5, global as in pimm
clip_grad = None  # lin.py:7
# lin.py:9-10 (pimm: autocast on CUDA only). matmul_precision="high" (lin.py:11) has no pimm key: torch's
# default ("highest", no TF32) applies. The DtypeOverrider hook (lin.py:175-181) runs every LayerNorm in
# float32, which torch's autocast does for layer_norm already
amp = dict(enabled=True, dtype="bfloat16")
# lin.py:182-187: the CheckpointLoader hook renames the Sonata pretraining checkpoint's student backbone onto
# this model, strict=False: pimm's key_map="sonata" does the same rename
pretrained = dict(path=None, key_map="sonata", strict=False, skip=[])

_scale = 768.0 * 3**0.5 / 2  # lin.py:84: NormalizeCoord's scale (detector units per normalised unit)
_grid_size = 0.001  # lin.py:82, in normalised units
# lin.py:24-66, pasted verbatim; grid_size and grid_origin are pimm's: the published grid_coord (NormalizeCoord
# centre 384, scale _scale, then GridSample grid_size 0.001, lin.py:84-93) in detector units
model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
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
        layer_scale=0.0,
        mlp_ratio=4,
        qkv_bias=True,
        qk_scale=None,
        attn_drop=0.0,
        proj_drop=0.0,
        drop_path=0.3,
        shuffle_orders=True,
        pre_norm=True,
        enable_rpe=False,
        enable_flash=True,
        upcast_attention=False,
        upcast_softmax=False,
        traceable=True,
        mask_token=False,
        enc_mode=True,
        freeze_encoder=False,
    ),
    criteria=[
        # dict(type="FocalLoss", loss_weight=1.0, weight=class_weights, ignore_index=-1),
        dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1),
        dict(type="LovaszLoss", mode="multiclass", loss_weight=1.0 / 20.0, ignore_index=-1, class_weights=None),
    ],
    freeze_backbone=True,
    grid_size=_grid_size * _scale,
    grid_origin=384.0,
)
# pimm computes model.criteria in its task (CE + Lovasz/20); its terms are means per event, then over the
# events of the batch, where the published criteria pool the points of the whole batch
task = dict(loss=None)

# lin.py:71: weight decay 0.01 on every trained parameter (lin.py has no WeightDecayExclusion hook)
optimizer = dict(type="AdamW", lr=0.0015, weight_decay=0.01)
# lin.py:72-79; total_steps = epochs x steps per epoch, as the published trainer sets it. The published second
# group, param_dicts = [dict(keyword="block", lr=0.00015)] (lin.py:80) with max_lr 0.00015, holds only
# encoder blocks, which freeze_backbone freezes: it trains nothing, and pimm refuses a group with no trainable
# parameter, so only the head's group (lr 0.0015) is here
scheduler = dict(type="OneCycleLR", max_lr=0.0015, pct_start=0.05, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=1000.0)
param_groups = []

# lin.py:122-164. Data: v1 shards, motif labels; point data.*.path at the download root (<root>/*train/*.h5 ...)
# features="published": lin.py:84-85 NormalizeCoord (centre 384, scale _scale) and LogTransform(0.01, 20)
# (pimm.data.transforms.feature_columns), computed from the points after the transforms (Collect, lin.py:101-105)
_pilarnet = dict(type="PILArNetDataset", path="data/pilarnet", revision="v1", label="motif", min_points=1024,
                 energy_threshold=0.13, remove_low_energy_scatters=False, features="published", volume_size=768.0,
                 augment=False)
# lin.py:86-93: GridSample at 0.001 of the normalised coordinates is 0.665 voxel: every voxel is kept. Its
# grid_coord (return_grid_coord) is what the model voxelises; the transforms after it move only the x, y, z
# feature columns (published and pimm alike). A voxel stored more than once (in two clusters) keeps one of
# its points drawn at random, as published mode="train" does.
_grid = dict(type="GridSample", grid_size=_grid_size * _scale, mode="random", return_grid_coord=True)
_train_transforms = [
    _grid,
    dict(type="CenterShift"),  # lin.py:94: x, y, z features centred on the event's bounding box
    # lin.py:95-97: angle [-1, 1] x pi about the (shifted) centre, each axis with p=0.8
    dict(type="RandomRotate", axis="z", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomRotate", axis="y", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomFlip", axes=["x", "y"], p=0.5),  # lin.py:98 (the published default axes: x, y)
    # lin.py:99: sigma grid_size / 8, cut at grid_size (normalised units), here in detector units
    dict(type="Jitter", sigma=_grid_size / 8 * _scale, clip=_grid_size * _scale),
]
data = dict(
    num_classes=5,  # lin.py:123
    names=["shower", "track", "michel", "delta", "led"],  # lin.py:125
    # lin.py:126-139: no energy cut in training (energy_threshold 0.0), max_len 1_000_000
    train=dict(_pilarnet, split="train", transforms=_train_transforms, energy_threshold=0.0, max_len=1_000_000),
    # lin.py:140-152: validation with the training transforms (augmented; pimm draws them per epoch and event)
    val=dict(_pilarnet, split="val", transforms=_train_transforms, max_len=1000),
    test=dict(_pilarnet, split="test", transforms=[_grid], max_len=1000),  # lin.py:153-163 (test_transform)
)
# lin.py:191-192: validate (then checkpoint) every 1000 steps. The published evaluator then skips the validation
# at epoch ends; pimm validates there too (eval_every_epochs, at least 1)
eval_every_n_steps = 1000
# lin.py:193: the test split is evaluated with model_best when training ends (pimm: test_after_training).
# lin.py:16-17: use_wandb=True; pimm logs to Weights & Biases with wandb.enabled=True (offline by default)
