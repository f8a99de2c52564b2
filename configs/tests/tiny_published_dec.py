# The published dec recipe (configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec.py: data, transforms,
# losses, frozen encoder, layer-wise lr decay, weight-decay rule) at a test-sized width: the same five
# stages and decoder depths (so its param_groups match), 8-32 channels. tests/test_published_recipes.py
# fine-tunes it from a Sonata-layout checkpoint at 2 ranks.
_base_ = ["../panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-dec.py"]

batch_size = 4
batch_size_val = 4
num_worker = 2
epochs = 1
eval_every_n_steps = None
model = dict(
    backbone_out_channels=8,
    backbone=dict(enc_depths=(1, 1, 1, 1, 1), enc_channels=(8, 16, 16, 32, 32), enc_num_head=(1, 2, 2, 4, 4),
                  enc_patch_size=(64, 64, 64, 64, 64), dec_channels=(8, 16, 16, 32), dec_num_head=(1, 2, 2, 4),
                  dec_patch_size=(64, 64, 64, 64)),
)
