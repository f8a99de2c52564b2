# pimm's own PILArNet-M fine-tuning example, NOT a published recipe: start from someone else's PointSegNet
# backbone, train it at a tenth of the head's learning rate without weight decay on norms and biases, with
# cross-entropy + Lovasz-softmax (weight 1), rotations about z, flips and 2-voxel grid sampling, on the
# published readers' defaults and feature normalisation (configs/pilarnet/semseg.py). The published recipes
# (PT-v3m2 from the Sonata-pretrained Panda-Base weights, Lovasz weight 1/20, every voxel kept, rotations
# about z, x and y, layer-wise lr decay, their epochs, batch, lr and schedule) are
# configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-{lin,dec,fft,scratch}.py.
# Point pretrained.path at the checkpoint and data.*.path at the data:
#   pimm launch --train.config pilarnet/finetune --resources.nproc-per-node 4 -- pretrained.path=/scratch/backbone.pth
#     data.train.path=/scratch/pilarnet data.val.path=/scratch/pilarnet data.test.path=/scratch/pilarnet
# key_map renames the checkpoint's prefixes (Pointcept-style "module.backbone." or "backbone.") onto this
# model's names; skip leaves its head out (its classes are not these); strict=False loads every name and
# shape that matches and reports the rest. To keep the backbone fixed instead: freeze = ["stem.*", "blocks.*"]
# (and drop its param_groups entries).
_base_ = ["semseg.py"]

epochs = 10
pretrained = dict(path=None, key_map=[["module.backbone.", ""], ["backbone.", ""]], strict=False,
                  skip=["head.*"])
freeze = []
param_groups = [
    dict(params="stem.*norm*|stem.*bias|blocks.*norm*|blocks.*bias", lr_scale=0.1, weight_decay=0.0),
    dict(params="stem.*|blocks.*", lr_scale=0.1),  # the backbone: a tenth of the learning rate
    dict(params="*norm*|*bias", weight_decay=0.0),  # the head's norms and biases
]
task = dict(loss=[dict(type="CrossEntropy", weight=1.0), dict(type="Lovasz", weight=1.0)])
data = dict(
    train=dict(augment=False, transforms=[
        dict(type="RandomRotate", axis="z"),  # about the volume centre, angle in [-180, 180] degrees
        dict(type="RandomFlip", axes=["x", "y"]),
        dict(type="GridSample", grid_size=2.0),  # one point per 2x2x2 voxels
    ]),
)
