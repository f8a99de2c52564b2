# Semantic segmentation (5 motif classes) of PILArNet-M shards as published, with the demo's model and
# schedule: point data.*.path at the download root (shards <root>/*train/*.h5, <root>/*val/*.h5,
# <root>/*test/*.h5), e.g. `-- data.train.path=/scratch/pilarnet data.val.path=/scratch/pilarnet
# data.test.path=/scratch/pilarnet`; the test split is evaluated with model_best when training ends
# (pimm test; `data.test=null` to leave it out). For the 6 particle classes set
# label="pid" in both splits and data.num_classes=6, model.num_classes=6, data.names=None.
# energy_threshold=0.13 (MeV; points at or below it are dropped) and min_points=1024 (counted after that cut)
# are the values of the published PILArNet-M studies; remove_low_energy_scatters=True drops each event's
# low-energy-scatter cluster as well.
_base_ = ["../demo/semseg.py"]

num_worker = 4

_pilarnet = dict(_delete_=True, type="PILArNetDataset", path="data/pilarnet", revision="v2", label="motif",
                 min_points=1024, energy_threshold=0.13, remove_low_energy_scatters=False, volume_size=768.0,
                 skip_nonfinite=False, transforms=None)
data = dict(
    train=dict(_pilarnet, split="train", augment=True),
    val=dict(_pilarnet, split="val"),
    test=dict(_pilarnet, split="test"),  # tested with model_best when training ends (test_after_training)
)
