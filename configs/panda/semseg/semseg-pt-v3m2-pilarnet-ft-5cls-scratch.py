# PILArNet-M 5-class semantic segmentation, the published "scratch" recipe: the fft recipe from randomly
# initialised weights. Source: DeepLearnPhysics/pimm configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-scratch.py,
# which inherits the fft file and changes only its Weights & Biases run name (scratch.py:1-2); its launch script
# (scripts/slurm/semseg/pilarnet_sonata_scratch.sh) passes no weights.
_base_ = ["semseg-pt-v3m2-pilarnet-ft-5cls-fft.py"]

pretrained = dict(path=None)  # no checkpoint: PT-v3m2's own initialisation
