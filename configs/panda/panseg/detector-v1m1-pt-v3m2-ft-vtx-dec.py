# PILArNet-M interactions, the published detector "dec" recipe for vertices: the pid dec recipe's frozen
# Sonata-pretrained encoder, data, transforms, optimizer and weight-decay rule, with 12 queries finding the
# interactions (points of no interaction are stuff) and a longer warm-up.
# Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m1-pt-v3m2-ft-vtx-dec.py ("vtx-dec.py:N" below).
# Everything not set here equals the published pid-dec file line for line: see detector-v1m1-pt-v3m2-ft-pid-dec.py.
_base_ = ["detector-v1m1-pt-v3m2-ft-pid-dec.py"]

_scale = 768.0 * 3**0.5 / 2  # vtx-dec.py:135: NormalizeCoord's scale
# vtx-dec.py:25-98, pasted verbatim (grid_size and grid_origin are pimm's, as in the pid recipe); against pid-dec:
# 2 classes, stuff class 0, 12 queries, Linear (not MLP) point projection and class head (mlp_point_proj left at
# the published default False), no momentum_loss_weight (there is no momentum head), no decoder keys in the
# backbone (enc_mode=True has no decoder)
model = dict(
    _delete_=True,
    type="detector-v1m1",
    num_classes=2,  # stuff, thing
    query_type="learned",
    use_stuff_head=True,
    stuff_classes=[0],
    supervise_attn_mask=True,
    num_queries=12,
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
        traceable=False,
        mask_token=False,
        enc_mode=True,  # encoder only
        freeze_encoder=True,
    ),
    full_in_channels=1232,
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
# Interactions are the instances (the published instance_interaction, vtx-dec.py:150); the classes are
# (stuff, interaction), a point of no interaction is stuff (segment_interaction 0, stuff_classes [0],
# vtx-dec.py:30, 249), as the task's label="interaction" makes them
task = dict(label="interaction", stuff_classes=[0])
# vtx-dec.py:123-130: as pid-dec's but a warm-up of 5%
scheduler = dict(pct_start=0.05)
# vtx-dec.py:180, 182 set data.num_classes=2, names ["stuff", "thing"]: in pimm data.num_classes and names are the
# reader's labels (pid, 6 classes; they are checked against the files) and the model's two classes come from
# task.label. The published vtx-dec.py:136 LogTransform has no keys: its default is ("energy",), as pid-dec's
