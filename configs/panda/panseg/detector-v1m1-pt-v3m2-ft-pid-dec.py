# PILArNet-M particles and their pid, the published detector "dec" recipe: the Sonata-pretrained PT-v3m2 encoder
# (Panda-Base) kept fixed, every encoder level up-cast and concatenated (1232 channels per point), read by 32
# learned queries of a 3-layer query decoder (detector-v1m1) with a stuff head for the low-energy deposits.
# Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-dec.py ("pid-dec.py:N" below
# is its line N), with configs/_base_/default_runtime.py, pimm/datasets/pilarnet.py, pimm/datasets/transform.py,
# pimm/engines/hooks/{misc,evaluator}.py and pimm/models/panda_detector/detector_v1m1.py there. Where pimm
# differs, the comment says so.
#   pimm launch --train.config panda/panseg/detector-v1m1-pt-v3m2-ft-pid-dec --resources.nproc-per-node 8 --
#     pretrained.path=/scratch/sonata/model_last.pth data.train.path=/scratch/pilarnet-m
#     data.val.path=/scratch/pilarnet-m data.test.path=/scratch/pilarnet-m
_base_ = ["../../_base_/default_runtime.py"]

seed = 0  # pid-dec.py:13
epochs = 20  # pid-dec.py:22 (eval_epoch = 20, pid-dec.py:23, is read by no published code)
batch_size = 48  # pid-dec.py:4, global as in pimm
num_worker = 24  # pid-dec.py:5, global as in pimm
# val_batch_size = 1 (pid-dec.py:6) is read by no published code: the published validation takes one event per
# GPU (batch_size_val = None in its default_runtime.py), as pimm's batch_size_val = None does
clip_grad = 1.0  # pid-dec.py:8
# pid-dec.py:10-11 (pimm: autocast on CUDA only). matmul_precision="high" (pid-dec.py:12) has no pimm key: torch's
# default ("highest", no TF32) applies. mix_prob 0 and empty_cache False (pid-dec.py:7, 9): pimm does neither
amp = dict(enabled=True, dtype="bfloat16")
find_unused_parameters = False  # pid-dec.py:15
# pid-dec.py:223-227: the CheckpointLoader hook renames the Sonata pretraining checkpoint's student backbone onto
# this model (strict=False by the hook's default): pimm's key_map="sonata" does the same rename
pretrained = dict(path=None, key_map="sonata", strict=False, skip=[])

_scale = 768.0 * 3**0.5 / 2  # pid-dec.py:143: NormalizeCoord's scale (detector units per normalised unit)
# pid-dec.py:26-106, pasted verbatim; grid_size and grid_origin are pimm's: the published grid_coord (NormalizeCoord
# centre 384, scale _scale, then GridSample grid_size 0.001, pid-dec.py:141-145) in detector units. The decoder's
# point positions (pos_emb) are the x, y, z feature columns, the published point.coord
model = dict(
    type="detector-v1m1",
    num_classes=6,  # photon, electron, muon, pion, proton, led
    query_type="learned",
    use_stuff_head=True,
    stuff_classes=[5],
    train_filter_use_gt=False,
    supervise_attn_mask=True,
    num_queries=32,
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
        freeze_encoder=True,
    ),
    full_in_channels=1232,
    mlp_point_proj=True,
    hidden_channels=256,
    num_heads=16,
    depth=3,
    mlp_ratio=4.0,
    qkv_bias=True,
    qk_scale=None,
    attn_drop=0.0,
    proj_drop=0.0,
    drop_path=0.0,
    layer_scale=None,
    pre_norm=True,
    enable_flash=True,
    upcast_attention=False,
    upcast_softmax=False,
    pos_emb=True,
    attn_mask_anneal=False,
    attn_mask_anneal_steps=10000,
    attn_mask_warmup_steps=0,
    attn_mask_progressive=False,
    attn_mask_progressive_delay=0,
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
            focal_alpha=0.25,
            focal_gamma=2.0,
            aux_loss_weight=1.0,
            num_points=100_000,
            truth_label="instance",
        ),
    ],
    grid_size=0.001 * _scale,
    grid_origin=384.0,
)
# pimm computes model.criteria in its task, plus the stuff head's binary cross-entropy (weight 1, as
# detector_v1m1.py adds it); every term is per event, then the mean over the batch's events, where the
# published loss pools the batch. Particles are the instances, pid the class, class 5 ("none", the published
# "led") is stuff (pid-dec.py:31, 150); model_best is picked by the detection F1 over all validation instances,
# the published ins_det_f1 (evaluator.py InstanceSegmentationEvaluator); IoU >= 0.5 matches (pid-dec.py:243)
task = dict(_delete_=True, type="Panoptic", label="particle", stuff_classes=[5], best_metric="detection_f1_pooled",
            iou_threshold=0.5, loss=None, stuff_loss_weight=1.0)

_base_lr = 2e-4  # pid-dec.py:109
_lr_decay = 0.97  # pid-dec.py:108
_base_wd = 0.01  # pid-dec.py:110; no WeightDecayScheduler hook (pid-dec.py:216-263): constant
# backbone_mult = 0.05 (pid-dec.py:111) is used by no line of the dec file: its encoder is frozen and in no group
optimizer = dict(type="AdamW", lr=_base_lr, weight_decay=_base_wd)  # pid-dec.py:130
# pid-dec.py:131-138; total_steps = epochs x steps per epoch, as the published trainer sets it
scheduler = dict(type="OneCycleLR", max_lr=_base_lr, pct_start=0.025, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=1000.0)

# The published WeightDecayExclusion hook (pid-dec.py:248-255) gives weight decay 0 to biases and to parameters
# named *norm*, *gamma* or *token* or with one dimension; the detector's other 1-D parameters are the LayerNorms
# of the encoder's cpe (cpe.2), named here (pimm groups by name)
_NO_DECAY = ("*.bias", "*norm*", "*gamma*", "*token*", "*cpe.2.weight")


def _block_groups(keyword, lr_scale):
    """A published param_dicts entry (substring `keyword`, lr = base_lr x lr_scale) split as the published
    WeightDecayExclusion splits it: its no-decay parameters first (pimm takes the first matching entry)."""
    return [dict(params="|".join(f"*{keyword}{p}" for p in _NO_DECAY), lr_scale=lr_scale, weight_decay=0.0),
            dict(params=f"*{keyword}*", lr_scale=lr_scale)]


# pid-dec.py:117-128: decoder block b at base_lr x lr_decay^(depth - b - 1), the last block fastest; the queries,
# projections, stuff head and class head are in the default group (base_lr)
_depth = model["depth"]
param_groups = []
for _b in range(_depth):
    param_groups += _block_groups(f"decoder.blocks.{_b}.", _lr_decay ** (_depth - _b - 1))
param_groups.append(dict(params="|".join(_NO_DECAY), weight_decay=0.0))  # the rest: the default group's split

# pid-dec.py:172-212. Data: v2 shards, pid labels (-1 read as class 5 "none", as the published reader's
# segment_pid), per-point particle and interaction instances (the published instance_particle, the Copy of
# pid-dec.py:150). Point data.*.path at the download root (<root>/*train/*.h5 ...).
# features="published": pid-dec.py:143-144 NormalizeCoord (centre 384, scale _scale) and LogTransform(0.01, 20)
# (pimm.data.transforms.feature_columns), computed from the points after the transforms (Collect, pid-dec.py:152)
_pilarnet = dict(type="PILArNetDataset", path="data/pilarnet", revision="v2", label="pid", instances=True,
                 min_points=1024, energy_threshold=0.13, remove_low_energy_scatters=False, features="published",
                 volume_size=768.0, augment=False)
# pid-dec.py:145: GridSample at 0.001 of the normalised coordinates is 0.665 voxel: every voxel is kept. Its
# grid_coord (return_grid_coord) is what the model voxelises; the rotations and flip after it move only the
# x, y, z feature columns (published and pimm alike). A voxel stored more than once (in two clusters) keeps
# one of its points drawn at random, as published mode="train" does.
_grid = dict(type="GridSample", grid_size=0.001 * _scale, mode="random", return_grid_coord=True)
_train_transforms = [
    _grid,
    # pid-dec.py:146-148: angle [-1, 1] x pi about the volume centre, each axis with p=0.8
    dict(type="RandomRotate", axis="z", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomRotate", axis="x", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomRotate", axis="y", angle=[-180.0, 180.0], p=0.8),
    dict(type="RandomFlip", axes=["x", "y"], p=0.5),  # pid-dec.py:149 (the published default axes: x, y)
]
data = dict(
    num_classes=6,  # pid-dec.py:173
    names=["photon", "electron", "muon", "pion", "proton", "none"],  # pid-dec.py:175 (pimm: "none" for "led")
    # pid-dec.py:176-187: max_len 1_000_000 (more than the train split holds)
    train=dict(_pilarnet, split="train", transforms=_train_transforms, max_len=1_000_000),
    val=dict(_pilarnet, split="val", transforms=[_grid], max_len=1000),  # pid-dec.py:188-199 (test_transform)
    test=dict(_pilarnet, split="test", transforms=[_grid], max_len=1000),  # pid-dec.py:200-211
)
# pid-dec.py:239, 247: validate (then checkpoint) every 1000 steps; pimm validates at epoch ends too
# (eval_every_epochs, at least 1). Post-processing: the model's stuff_threshold, mask_threshold (0.5, as the
# evaluator's, pid-dec.py:240-241) and conf_threshold, nms_sigma, min_points (the published Detector's defaults)
eval_every_n_steps = 1000
# pid-dec.py:262: FinalEvaluator(test_last=True) tests model_last when training ends; pimm's test_after_training
# tests model_best (`pimm test --run-dir RUN --checkpoint last` tests the last weights).
# pid-dec.py:18: use_wandb=True; pimm logs to Weights & Biases with wandb.enabled=True (offline by default).
# pid-dec.py:256-261: the AttentionMaskAnnealingHook does nothing with attn_mask_anneal=False
