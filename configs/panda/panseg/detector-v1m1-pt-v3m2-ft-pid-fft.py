# PILArNet-M particles and their pid, the published detector "fft" recipe (full fine-tuning): the dec recipe with
# the Sonata-pretrained encoder trained too, each encoder block at the decayed learning rate (backbone_mult 1).
# Source: DeepLearnPhysics/pimm configs/panda/panseg/detector-v1m1-pt-v3m2-ft-pid-fft.py ("pid-fft.py:N" below).
# Everything not set here equals the published dec file line for line (data, transforms, model but
# freeze_encoder, optimizer, schedule, weight-decay rule, gradient clip): see detector-v1m1-pt-v3m2-ft-pid-dec.py.
_base_ = ["detector-v1m1-pt-v3m2-ft-pid-dec.py"]

model = dict(backbone=dict(freeze_encoder=False))  # pid-fft.py:64; the rest of pid-fft.py:26-106 is pid-dec's

_lr_decay = 0.97  # pid-fft.py:108
_backbone_mult = 1.0  # pid-fft.py:111
_NO_DECAY = ("*.bias", "*norm*", "*gamma*", "*token*", "*cpe.2.weight")


def _block_groups(keyword, lr_scale):
    """As in the dec recipe: a published param_dicts entry, its no-decay parameters first."""
    return [dict(params="|".join(f"*{keyword}{p}" for p in _NO_DECAY), lr_scale=lr_scale, weight_decay=0.0),
            dict(params=f"*{keyword}*", lr_scale=lr_scale)]


# pid-fft.py:114-129: encoder block b of stage e at base_lr x lr_decay^exp x backbone_mult, exp from 23
# (enc0.block0) down to 3 (enc4.block2): below every decoder block. The encoder's embedding matches no published
# keyword: it learns at base_lr in the default group, published and here alike
_enc_depths, _depth = (3, 3, 3, 9, 3), 3  # pid-fft.py:114-115: the model's enc_depths and decoder depth
param_groups = []
for _e in range(len(_enc_depths)):
    for _b in range(_enc_depths[_e]):
        _exp = (sum(_enc_depths) - sum(_enc_depths[:_e]) - _b - 1) + _depth
        param_groups += _block_groups(f"enc{_e}.block{_b}.", _lr_decay**_exp * _backbone_mult)
# pid-fft.py:133-140: the decoder blocks as in the dec recipe
for _b in range(_depth):
    param_groups += _block_groups(f"decoder.blocks.{_b}.", _lr_decay ** (_depth - _b - 1))
param_groups.append(dict(params="|".join(_NO_DECAY), weight_decay=0.0))  # the rest: the default group's split
