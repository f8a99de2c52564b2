# Semantic segmentation (5 motif classes) of PILArNet-M shards as published, with the demo's model and
# schedule: point data.*.path at the download root (shards <root>/*train/*.h5, <root>/*val/*.h5), e.g.
# `-- data.train.path=/scratch/pilarnet data.val.path=/scratch/pilarnet`. For the 6 particle classes set
# label="pid" in both splits and data.num_classes=6, model.num_classes=6, data.names=None.
_base_ = ["../demo/semseg.py"]

num_worker = 4

_pilarnet = dict(_delete_=True, type="PILArNetDataset", path="data/pilarnet", revision="v2", label="motif",
                 min_points=1024, energy_threshold=0.0, volume_size=768.0)
data = dict(
    train=dict(_pilarnet, split="train", augment=True),
    val=dict(_pilarnet, split="val"),
)
