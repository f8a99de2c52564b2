# PILArNet-M Sonata-style self-distillation of the PT-v3m2 encoder (Panda-Base), the published pretraining recipe.
# Source: DeepLearnPhysics/pimm configs/panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask.py ("pt.py:N" below is
# its line N), with configs/_base_/default_runtime.py, pimm/models/sonata/sonata_v1m1_base.py,
# pimm/datasets/transform.py (MultiViewGenerator) and pimm/engines/hooks/misc.py there. Where pimm differs, the
# comment says so; docs/pretraining.md says why the targets are exact at any world size.
#   pimm launch --train.config panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask --resources.nproc-per-node 4 --
#     data.train.path=/scratch/pilarnet-m data.val.path=/scratch/pilarnet-m
#   pimm export --run-dir RUN --layout published OUT   (then pretrained.path=OUT/model.pth in the semseg recipes)
_base_ = ["../../_base_/default_runtime.py"]

seed = 0  # pt.py:21
epochs = 100  # pt.py:94; the published trainer's schedule is epoch x steps per epoch (pimm's too)
batch_size = 48  # pt.py:8, global as in pimm
num_worker = 24  # pt.py:9, global as in pimm
batch_size_val = 32  # pt.py:10
clip_grad = 3.0  # pt.py:12
# pt.py:14-15 (pimm: autocast on CUDA only). matmul_precision="high" (pt.py:19) has no pimm key: torch's default
# ("highest", no TF32) applies. The DtypeOverrider hook (pt.py:273-279) runs every LayerNorm in float32, which
# torch's autocast does for layer_norm already. mix_prob, empty_cache, detect_anomaly and deterministic
# (pt.py:11, 13, 18, 20) are the published defaults, which pimm has no keys for
amp = dict(enabled=True, dtype="bfloat16")
find_unused_parameters = False  # pt.py:17
# pt.py:23-24: use_wandb=True, project "Pretraining-Sonata-PILArNet-M"; pimm logs to Weights & Biases with
# wandb.enabled=True (offline by default), project as given
wandb = dict(project="Pretraining-Sonata-PILArNet-M")

_grid_size = 0.001  # pt.py:26, in normalised units (NormalizeCoord below)
_warmup_ratio = 0.05  # pt.py:27
_scale = 768.0 * 3**0.5 / 2  # pt.py:125: NormalizeCoord's scale (detector units per normalised unit)
# pt.py:30-90, pasted verbatim but grid_size, pimm's: the views' coordinates are normalised (features="published")
# and the model voxelises them at the published grid_size (the published Update transform hands it to the model,
# pt.py:180). match_max_k is left at its default (pt.py does not set it): pimm matches the student's voxels to the
# teacher's by their origin cell of edge match_max_r (no k-nearest-neighbour query, no CUDA-only op)
model = dict(
    type="Sonata-v1m1",
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,  # [xyz, energy]
        order=("hilbert", "hilbert-trans", "z", "z-trans"),
        stride=(2, 2, 2, 2),
        enc_depths=(3, 3, 3, 9, 3),
        enc_channels=(48, 96, 192, 384, 512),
        enc_num_head=(3, 6, 12, 24, 32),
        enc_patch_size=(256, 256, 256, 256, 256),
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
        traceable=True,
        enc_mode=True,
        mask_token=True,
        cpe_first_layer_only=False,
        cpe_shared_weight=False,
    ),
    teacher_custom=dict(attn_drop=0.0, proj_drop=0.0, drop_path=0.0),
    head_in_channels=1088,  # up_cast_level 2: 192 + 384 + 512
    head_hidden_channels=4096,
    head_embed_channels=256,
    head_num_prototypes=4096,
    num_global_view=2,
    num_local_view=6,
    mask_size_start=0.01,
    mask_size_base=0.075,
    mask_size_warmup_ratio=_warmup_ratio,
    mask_ratio_start=0.5,
    mask_ratio_base=0.9,
    mask_ratio_warmup_ratio=_warmup_ratio,
    mask_jitter=_grid_size / 2,
    teacher_temp_start=0.04,
    teacher_temp_base=0.07,
    teacher_temp_warmup_ratio=_warmup_ratio,
    student_temp=0.10,
    mask_loss_weight=2 / 8,
    roll_mask_loss_weight=2 / 8,
    unmask_loss_weight=4 / 8,
    momentum_base=0.994,
    momentum_final=1.0,
    match_max_r=2 * _grid_size,
    up_cast_level=2,
    grid_size=_grid_size,
    # pimm's online linear probe of the motif classes, in place of the PretrainEvaluator hook (pt.py:299-305), which
    # fits a linear probe on 250 training events at each validation and scores it on 250 validation events
    # (hooks/evaluator.py:407). pimm's probe learns on every training event's global views, from the teacher's
    # detached features, and validation scores it (probe_miou); the published class weights (pt.py:254-255) are
    # not used
    probe_classes=5,
)
# the published model reads every option above itself (pt.py:30-90); in pimm the SelfDistillation task reads them:
# views, masks, Sinkhorn-Knopp teacher targets over the whole optimizer step on every rank, EMA after each step
task = dict(_delete_=True, type="SelfDistillation")

_base_lr = 0.0026  # pt.py:95
_lr_decay = 0.9  # pt.py:96
_base_wd = 0.04  # pt.py:98
optimizer = dict(type="AdamW", lr=_base_lr, weight_decay=_base_wd)  # pt.py:112
# final_wd = 0.2 (pt.py:99) is applied by the published recipe: its WeightDecayScheduler hook (pt.py:289-294)
# moves the weight decay of every decayed group from 0.04 to 0.2 on a half cosine over the whole run
# (hooks/misc.py WeightDecayScheduler, total_iters = total_steps x warmup_ratio 1.0); pimm's schedule is a
# function of the global step, where the published hook re-derives its position from the epoch
weight_decay_schedule = dict(final=0.2, ratio=1.0)  # pt.py:99, 289-294
# pt.py:113-120: one max_lr per group, the group's lr (pimm: max_lr x each group's lr_scale); total_steps = epochs
# x steps per epoch, as the published trainer sets it
scheduler = dict(type="OneCycleLR", max_lr=_base_lr, pct_start=_warmup_ratio, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=1000.0)

# pt.py:281-288, the WeightDecayExclusion hook: no weight decay for biases, names with "norm", "gamma" or "token",
# and every 1-d parameter; in this model the 1-d ones the names miss are the conditional position encoding's
# LayerNorm weights (cpe.2.weight)
_NO_DECAY = ("*.bias", "*norm*", "*gamma*", "*token*", "*cpe.2.weight")


def _block_groups(keyword, lr_scale):
    """A published param_dicts entry (a name keyword and its lr), its no-decay parameters first."""
    return [dict(params="|".join(f"*{keyword}{p}" for p in _NO_DECAY), lr_scale=lr_scale, weight_decay=0.0),
            dict(params=f"*{keyword}*", lr_scale=lr_scale)]


# pt.py:101-109, layer-wise lr decay: encoder block b of stage e at base_lr x lr_decay^exp, exp from 20
# (enc0.block0) down to 0 (enc4.block2). The published keywords match the teacher's blocks too, which receive no
# gradient there (the EMA moves them); pimm's groups hold trainable parameters only
_enc_depths = (3, 3, 3, 9, 3)  # pt.py:38
param_groups = []
for _e in range(len(_enc_depths)):
    for _b in range(_enc_depths[_e]):
        _exp = sum(_enc_depths) - sum(_enc_depths[:_e]) - _b - 1
        param_groups += _block_groups(f"enc{_e}.block{_b}.", _lr_decay**_exp)
# the default group at base_lr (embedding, mask token, pooling, prototype heads, pimm's probe), split by the same rule
param_groups.append(dict(params="|".join(_NO_DECAY), weight_decay=0.0))

# pt.py:124-199. features="published": NormalizeCoord (centre 384, scale _scale, pt.py:125) and LogTransform(0.01,
# 20, pt.py:126-132) (pimm.data.transforms.feature_columns). GridSample at 0.001 normalised units (pt.py:133) is
# 0.665 voxel: every voxel is kept, one of its points drawn at random as published mode="train" does.
# Copy coord -> origin_coord (pt.py:134) and MultiViewGenerator (pt.py:135-178): the task cuts each event's views
# from its feature columns (x, y, z as coordinates, the log energy as energy), the published values
# (pimm.data.multi_view.MultiViewSettings: 2 global views of 40-100 %, 6 local of 10-40 % of min(30,000, N) points,
# the shared energy jitter (sigma 0.05, clip 0.05, p 0.8), per view CenterShift, rotations about z, x, y with p 0.8,
# flips with p 0.5 per axis, a coordinate jitter of sigma grid_size / 4 cut at grid_size), each event's draws keyed
# by (seed, step, event), not by the loader worker's global RNG. ToTensor / Update / Collect (pt.py:179-198): the
# views' features are their x, y, z and energy, as published
_grid = dict(type="GridSample", grid_size=_grid_size * _scale, mode="random")
# pt.py:205-215 and 222-250: v1 shards; point data.*.path at the download root (<root>/*train/*.h5 ...)
_pilarnet = dict(type="PILArNetDataset", path="data/pilarnet", revision="v1", label="motif", min_points=1024,
                 energy_threshold=0.13, remove_low_energy_scatters=False, features="published", volume_size=768.0,
                 augment=False, transforms=[_grid])
data = dict(
    num_classes=5,  # pt.py:202
    names=["shower", "track", "michel", "delta", "led"],  # pt.py:203
    train=dict(_pilarnet, split="train", max_len=1_000_000),  # pt.py:204-216 (loop=1: one pass per epoch)
    # pt.py:217-251: max_len=-1 reads every event, of which the PretrainEvaluator scores 250 (max_test_events,
    # hooks/evaluator.py:407). pimm validates the first 250: each event's self-distillation loss (fixed draws, every
    # schedule at its final value, targets per event) and the probe's mIoU
    val=dict(_pilarnet, split="val", max_len=250),
)
# pt.py:303: validate every 1000 steps; pt.py:297: CheckpointSaverIteration every 1000 steps
eval_every_n_steps = 1000
checkpoint_every_n_steps = 1000
# pt.py:257-318, the other hooks: WandbNamer (run name from config values), ParameterCounter (pimm logs the
# parameter counts at start), IterationTimer / InformationWriter (pimm's log lines and metrics.jsonl),
# GradientNormLogger, PrototypeUsageLogger and FeatureStdMonitor (monitoring only, not in pimm)
