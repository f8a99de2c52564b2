# Tiny Sonata-style self-distillation for tests: the published Sonata-v1m1 (configs/panda/pretrain/
# pretrain-sonata-v1m1-pilarnet-smallmask.py) on an 86k-parameter PT-v3m2 encoder, reading PILArNet-layout
# shards under data/tests/pilarnet (make them with `pimm data synth --layout pilarnet --out data/tests/pilarnet
# --events 32 --split train`, and --split val). Views are cut in the feature coordinates (pimm features: the
# 768-voxel volume spans [-1, 1], one voxel is 2/768 = 0.0026).
_base_ = ["../_base_/default_runtime.py"]

seed = 7
epochs = 2
batch_size = 4
batch_size_val = 4
num_worker = 0
log_every = 1
clip_grad = 3.0

_grid = 0.006  # about two detector voxels
model = dict(
    type="Sonata-v1m1",
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
        mask_token=True,
        shuffle_orders=True,
        drop_path=0.1,
    ),
    teacher_custom=dict(drop_path=0.0),
    head_in_channels=64,  # up_cast_level 1: the last two stages' 32 + 32 channels
    head_hidden_channels=64,
    head_embed_channels=16,
    head_num_prototypes=32,
    num_global_view=2,
    num_local_view=2,
    mask_size_start=0.02,
    mask_size_base=0.05,
    mask_ratio_start=0.5,
    mask_ratio_base=0.9,
    mask_jitter=_grid / 2,
    teacher_temp_start=0.04,
    teacher_temp_base=0.07,
    student_temp=0.1,
    momentum_base=0.994,
    momentum_final=1.0,
    match_max_r=2 * _grid,
    up_cast_level=1,
    grid_size=_grid,
    probe_classes=5,  # pimm's online linear probe of the motif classes (data.num_classes)
)
task = dict(_delete_=True, type="SelfDistillation")
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.04)
weight_decay_schedule = dict(final=0.2, ratio=1.0)  # as the published recipe: 0.04 -> 0.2 over the run

_pilarnet = dict(type="PILArNetDataset", path="data/tests/pilarnet", revision="v2", label="motif", min_points=10)
data = dict(
    num_classes=5,
    names=["shower", "track", "michel", "delta", "low_energy"],
    train=dict(_pilarnet, split="train"),
    val=dict(_pilarnet, split="val"),
)
