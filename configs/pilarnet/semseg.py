# Semantic segmentation (5 motif classes) of PILArNet-M shards as published, with the demo's model and
# schedule: point data.*.path at the download root (shards <root>/*train/*.h5, <root>/*val/*.h5,
# <root>/*test/*.h5), e.g. `-- data.train.path=/scratch/pilarnet data.val.path=/scratch/pilarnet
# data.test.path=/scratch/pilarnet`; the test split is evaluated with model_best when training ends
# (pimm test; `data.test=null` to leave it out). For the 6 particle classes set label="pid" in every
# split and data.num_classes=6, model.num_classes=6, data.names=None (pid -1, the low-energy deposits,
# is class 5 "none" as in the published readers; pid_unlabelled_as_none=False leaves it unlabelled).
# The reader settings are the published studies': energy_threshold=0.13 (MeV; points at or below it
# are dropped), min_points=1024 (counted over the stored points; min_points_after_cut=True counts
# what the cut leaves), and features="published" (coordinates in the unit ball around the volume
# centre, energies log10-mapped from [0.01, 20] MeV onto [-1, 1]; pimm export records it).
# remove_low_energy_scatters=True drops each event's low-energy-scatter cluster as well.
_base_ = ["../demo/semseg.py"]

num_worker = 4

_pilarnet = dict(_delete_=True, type="PILArNetDataset", path="data/pilarnet", revision="v2", label="motif",
                 min_points=1024, energy_threshold=0.13, remove_low_energy_scatters=False, volume_size=768.0,
                 skip_nonfinite=False, transforms=None, features="published", min_points_after_cut=False,
                 pid_unlabelled_as_none=True)
data = dict(
    train=dict(_pilarnet, split="train", augment=True),
    val=dict(_pilarnet, split="val"),
    test=dict(_pilarnet, split="test"),  # tested with model_best when training ends (test_after_training)
)
