# PILArNet-M interactions, the published detector "scratch" recipe for vertices: the vtx fft recipe from randomly
# initialised weights. Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m1-pt-v3m2-ft-vtx-scratch.py,
# which inherits the fft file and changes only its Weights & Biases run name (vtx-scratch.py:1-2); its launch
# script (scripts/slurm/panseg/pilarnet_detector_v1m1_vtx_scratch.sh) passes no weights.
_base_ = ["detector-v1m1-pt-v3m2-ft-vtx-fft.py"]

pretrained = dict(path=None, key_map=[], strict=True)  # no checkpoint: the model's own initialisation
