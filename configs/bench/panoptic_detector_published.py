# The step-time comparison of benchmarks/panoptic.py (--timing-pairs) at the published size: the published particle
# detector with its encoder trained (configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-fft.py: a 5-level PT-v3m2
# encoder, 1232 channels per point, a 3-layer decoder of width 256 with 32 queries, the recipe's data options and
# transforms), on the benchmark's generated events, 4 per batch. configs/bench/panoptic_semseg_published.py is the
# semantic model on the same encoder.
_base_ = ["../panda/panseg/detector-v1m1-pt-v3m2-ft-pid-fft.py"]

batch_size = 4
