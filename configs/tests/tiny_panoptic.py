# Tiny particle detector for tests: the published detector-v1m1 (configs/panda/panseg/detector-v1m1-pt-v3m2-ft-
# pid-dec.py) on a ~40k-parameter PT-v3m2 encoder, reading v2 PILArNet-layout shards under data/tests/pilarnet
# (make them with `pimm data synth --layout pilarnet --revision v2 --out data/tests/pilarnet --events 32
# --split train`, and --split val), particles as instances, their pid as class, "none" as stuff.
_base_ = ["../_base_/default_runtime.py"]

seed = 7
epochs = 2
batch_size = 4
batch_size_val = 4
num_worker = 0
log_every = 1
clip_grad = 1.0

model = dict(
    type="detector-v1m1",
    num_classes=6,  # photon, electron, muon, pion, proton, none (pid-dec.py:28)
    use_stuff_head=True,
    stuff_classes=[5],
    num_queries=8,
    full_in_channels=48,  # the encoder's 16 + 32 channels, up-cast and concatenated
    mlp_point_proj=True,
    hidden_channels=32,
    num_heads=4,
    depth=2,
    qkv_bias=True,
    query_type="learned",  # as published; the test runs override it with pimm's "anchored"
    anchor_length=0.0625,  # pimm's: the anchored queries' length unit (the default, 8 voxels)
    connect_radius=None,  # pimm's post-processing after the published one (off, the default); the test runs set it
    connect_min_points=20,
    connect_collinear=None,  # pimm's too: joins touching collinear instances after the pieces; the test runs set it
    conf_threshold=0.5,  # post-processing (the published Detector's defaults), here to be overridden
    mask_threshold=0.5,
    stuff_threshold=0.5,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2,),
        enc_depths=(1, 1),
        enc_channels=(16, 32),
        enc_num_head=(2, 4),
        enc_patch_size=(32, 32),
        mlp_ratio=2,
        enc_mode=True,
        shuffle_orders=True,
    ),
)
# the Panoptic task's options at their defaults (pimm.tasks.panoptic); _delete_: the base sets SemanticSegmentation's
task = dict(_delete_=True, type="Panoptic", label="particle", stuff_classes=None, best_metric="ari_all_labelled",
            iou_threshold=0.5, loss=None, stuff_loss_weight=1.0)
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.01)

_pilarnet = dict(type="PILArNetDataset", path="data/tests/pilarnet", revision="v2", label="pid", instances=True,
                 min_points=10)
data = dict(
    num_classes=6,
    names=["photon", "electron", "muon", "pion", "proton", "none"],
    train=dict(_pilarnet, split="train"),
    val=dict(_pilarnet, split="val"),
)
