# PILArNet-M particles and their pid, the published detector "scratch" recipe: the fft recipe from randomly
# initialised weights. Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-scratch.py,
# which inherits the fft file and changes only its Weights & Biases run name (pid-scratch.py:1-2); its launch
# script (scripts/slurm/panseg/pilarnet_detector_v1m1_pid_scratch.sh) passes no weights.
_base_ = ["detector-v1m1-pt-v3m2-ft-pid-fft.py"]

pretrained = dict(path=None, key_map=[], strict=True)  # no checkpoint: the model's own initialisation
