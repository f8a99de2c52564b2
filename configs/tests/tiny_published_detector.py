# The published particle detector dec recipe (configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-dec.py: data,
# transforms, task and losses, frozen encoder, decoder-block lr decay, weight-decay rule) at a test-sized width:
# the same five encoder stages and decoder depth (so its param_groups match), 8-32 channels, 8 queries.
# tests/test_published_detector.py fine-tunes it from a Sonata-layout checkpoint.
_base_ = ["../panda/panseg/detector-v1m1-pt-v3m2-ft-pid-dec.py"]

batch_size = 4
batch_size_val = 4
num_worker = 0
log_every = 1
epochs = 1
eval_every_n_steps = None
model = dict(
    num_queries=8,
    full_in_channels=104,  # the sum of enc_channels
    hidden_channels=32,
    num_heads=4,
    backbone=dict(enc_depths=(1, 1, 1, 1, 1), enc_channels=(8, 16, 16, 32, 32), enc_num_head=(1, 2, 2, 4, 4),
                  enc_patch_size=(64, 64, 64, 64, 64), dec_channels=(8, 16, 16, 32), dec_num_head=(1, 2, 2, 4),
                  dec_patch_size=(64, 64, 64, 64)),
)
