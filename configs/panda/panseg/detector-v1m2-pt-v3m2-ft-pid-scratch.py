# PILArNet-M particles, their pid and their momentum, the published momentum detector "scratch" recipe: the fft
# recipe from randomly initialised weights. Source: DeepLearnPhysics/pimm configs/panda/panseg/
# detector-v1m2-pt-v3m2-ft-pid-scratch.py, which inherits the v1m2 fft file and changes only its Weights & Biases
# run name (v1m2-pid-scratch.py:1-2), as the v1m1 scratch file does.
_base_ = ["detector-v1m2-pt-v3m2-ft-pid-fft.py"]

pretrained = dict(path=None, key_map=[], strict=True)  # no checkpoint: the model's own initialisation
