# PILArNet-M 5-class semantic segmentation, the published "fft" recipe (full fine-tuning): the dec recipe with
# the Sonata-pretrained encoder trained too, at backbone_mult x the decayed learning rate, and no gradient clip.
# Source: DeepLearnPhysics/pimm configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-fft.py ("fft.py:N" below).
# Everything not set here equals the published dec file line for line (data, transforms, model but
# freeze_encoder, optimizer, schedule, weight-decay rule): see semseg-pt-v3m2-pilarnet-ft-5cls-dec.py.
_base_ = ["semseg-pt-v3m2-pilarnet-ft-5cls-dec.py"]

clip_grad = None  # fft.py:7
model = dict(backbone=dict(freeze_encoder=False))  # fft.py:57; the rest of fft.py:24-66 is dec.py:24-66

_lr_decay = 0.9  # fft.py:72
_backbone_mult = 0.05  # fft.py:76
_NO_DECAY = ("*.bias", "*norm*", "*gamma*", "*token*", "*cpe.2.weight", "*up.proj.1.weight", "*up.proj_skip.1.weight")


def _block_groups(keyword, lr_scale):
    """As in the dec recipe: a published param_dicts entry, its no-decay parameters first."""
    return [dict(params="|".join(f"*{keyword}{p}" for p in _NO_DECAY), lr_scale=lr_scale, weight_decay=0.0),
            dict(params=f"*{keyword}*", lr_scale=lr_scale)]


# fft.py:77-105: encoder block b of stage e at base_lr x lr_decay^exp x backbone_mult, exp from 28 (enc0.block0)
# down to 8 (enc4.block2); then the decoder blocks as in the dec recipe, exp 7 (dec0.block0) down to 0
_enc_depths, _dec_depths = (3, 3, 3, 9, 3), (2, 2, 2, 2)  # fft.py:33 and fft.py:37
param_groups = []
for _e in range(len(_enc_depths)):
    for _b in range(_enc_depths[_e]):
        _exp = (sum(_enc_depths) - sum(_enc_depths[:_e]) - _b - 1) + sum(_dec_depths)
        param_groups += _block_groups(f"enc{_e}.block{_b}.", _lr_decay**_exp * _backbone_mult)
for _e in range(len(_dec_depths)):
    for _b in range(_dec_depths[_e]):
        _exp = sum(_dec_depths) - sum(_dec_depths[:_e]) - _b - 1
        param_groups += _block_groups(f"dec{_e}.block{_b}.", _lr_decay**_exp)
# the default group (embedding, pooling, unpooling, head) at base_lr, split by the weight-decay rule
# (fft.py:210-217, as dec.py:194-201)
param_groups.append(dict(params="|".join(_NO_DECAY), weight_decay=0.0))
