# PILArNet-M interactions, the published detector "fft" recipe for vertices (full fine-tuning): the vtx dec recipe
# with the Sonata-pretrained encoder trained too, each encoder block at the decayed learning rate (backbone_mult 1).
# Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m1-pt-v3m2-ft-vtx-fft.py ("vtx-fft.py:N" below).
# Everything not set here equals the published vtx dec file line for line; its parameter groups are the pid fft
# recipe's (the same encoder, decoder depth, decay and backbone_mult): see detector-v1m1-pt-v3m2-ft-pid-fft.py.
_base_ = ["detector-v1m1-pt-v3m2-ft-vtx-dec.py"]

model = dict(backbone=dict(freeze_encoder=False))  # vtx-fft.py:58

_lr_decay = 0.97  # vtx-fft.py:101
_backbone_mult = 1.0  # vtx-fft.py:104
_NO_DECAY = ("*.bias", "*norm*", "*gamma*", "*token*", "*cpe.2.weight")


def _block_groups(keyword, lr_scale):
    """As in the dec recipe: a published param_dicts entry, its no-decay parameters first."""
    return [dict(params="|".join(f"*{keyword}{p}" for p in _NO_DECAY), lr_scale=lr_scale, weight_decay=0.0),
            dict(params=f"*{keyword}*", lr_scale=lr_scale)]


# vtx-fft.py:115-123 (encoder, exp from 23 down to 3) and 127-134 (decoder blocks, as in the dec recipe)
_enc_depths, _depth = (3, 3, 3, 9, 3), 3  # vtx-fft.py:108-109: the model's enc_depths and decoder depth
param_groups = []
for _e in range(len(_enc_depths)):
    for _b in range(_enc_depths[_e]):
        _exp = (sum(_enc_depths) - sum(_enc_depths[:_e]) - _b - 1) + _depth
        param_groups += _block_groups(f"enc{_e}.block{_b}.", _lr_decay**_exp * _backbone_mult)
for _b in range(_depth):
    param_groups += _block_groups(f"decoder.blocks.{_b}.", _lr_decay ** (_depth - _b - 1))
param_groups.append(dict(params="|".join(_NO_DECAY), weight_decay=0.0))  # the rest: the default group's split
