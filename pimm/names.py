"""The names a config may give in `type=...` and similar keys, without importing torch.

The registries (pimm.engine.optim, pimm.models, pimm.tasks, pimm.data.dataset,
pimm.distributed.strategy) register exactly these names, and the launcher's config check
(pimm.config.validate) accepts exactly these, so a name is added in one place.
"""

OPTIMIZERS = ("SGD", "Adam", "AdamW")  # torch.optim classes of the same name
SCHEDULERS = ("OneCycleLR", "CosineAnnealingLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR")
# their options: pimm.config.validate.MODEL_OPTIONS
MODELS = ("PointSegNet", "PointTransformer", "DefaultSegmentorV2", "detector-v1m1", "detector-v1m2", "Sonata-v1m1")
DETECTORS = ("detector-v1m1", "detector-v1m2")  # the query detectors (pimm.models.detector): the Panoptic task's models
BACKBONES = ("PT-v3m2",)  # DefaultSegmentorV2(backbone=dict(type=...)): pimm.config.validate.BACKBONE_OPTIONS
# weight_init=... of PT-v3m2 and the detectors: how their linear layers start (pimm.models.weight_init)
WEIGHT_INITS = ("trunc_normal", "fan_in")
# how a query detector's queries start (pimm.models.query_detector): "learned" is the published, "anchored" pimm's
QUERY_TYPES = ("learned", "anchored")
# the `feat` columns every dataset gives a point (pimm.data.dataset): a model's in_channels must match
FEATURE_COLUMNS = ("x", "y", "z", "log_energy")
# how a dataset computes them (features=...): pimm.data.transforms.feature_columns
FEATURE_MODES = ("pimm", "published")
TASKS = ("SemanticSegmentation", "Panoptic", "SelfDistillation")  # pimm.tasks
PANOPTIC_LABELS = ("particle", "interaction")  # Panoptic label=...: what an instance is
# the per-event metrics of a Panoptic evaluation (pimm.panoptic_metrics); each may be task.best_metric
PANOPTIC_EVENT_METRICS = ("ari_all_labelled", "ari_predicted_things", "ami_all_labelled", "purity", "efficiency",
                          "dice", "detection_precision", "detection_recall", "detection_f1", "matched_iou", "pq", "sq",
                          "rq")
# Panoptic task.loss: DetectorLossWeights fields (pimm.tasks.panoptic_loss), and the published criterion's names
PANOPTIC_LOSS_WEIGHTS = ("cost_class", "cost_mask", "cost_dice", "match_points", "focal", "dice", "class_matched",
                         "class_no_object", "momentum", "vertex", "iou", "focal_alpha", "focal_gamma", "aux")
PUBLISHED_INSTANCE_LOSS = {
    "cost_mask": "cost_mask", "cost_dice": "cost_dice", "cost_class": "cost_class", "loss_weight_focal": "focal",
    "loss_weight_dice": "dice", "cls_weight_matched": "class_matched", "cls_weight_noobj": "class_no_object",
    "momentum_loss_weight": "momentum", "iou_loss_weight": "iou", "focal_alpha": "focal_alpha",
    "focal_gamma": "focal_gamma", "aux_loss_weight": "aux", "num_points": "match_points",
}
LOSSES = ("CrossEntropy", "Lovasz", "Focal")  # task.loss=[dict(type=..., weight=...)]: pimm.tasks.losses
SERIALIZATION_ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")  # PointTransformer orders=...
DATASETS = ("LArTPCDataset", "PILArNetDataset")
PILARNET_REVISIONS = ("v1", "v2", "v3")  # PILArNetDataset revision=...; cluster columns in pimm.data.pilarnet_file
PILARNET_LABELS = ("motif", "pid")  # PILArNetDataset label=...
PARALLEL_STRATEGIES = ("ddp", "fsdp2")  # used when the world size is > 1
NOT_IMPLEMENTED_STRATEGIES = ("tp", "tensor", "tensor_parallel", "pp", "pipeline", "pipeline_parallel", "fsdp",
                              "deepspeed", "zero")
SPARSE_CONV_BACKENDS = ("auto", "torch", "spconv")  # backends.sparse_conv; pimm.models.sparse_conv
AMP_DTYPES = ("bfloat16", "float32")  # float16 needs a GradScaler, which pimm does not use
# data.<split>.transforms=[dict(type=..., ...)]: name -> its arguments and their defaults (pimm.data.transforms;
# the launcher's check of the values is pimm.config.validate.check_transforms)
TRANSFORMS = {
    "RandomRotate": {"axis": "z", "angle": (-180.0, 180.0), "p": 1.0},  # degrees, about the volume centre, with p
    "RandomFlip": {"axes": ("x", "y", "z"), "p": 0.5},  # each axis mirrored about the volume centre with p
    "Jitter": {"sigma": 0.01, "clip": None},  # Gaussian noise on every coordinate (coordinate units), cut at +-clip
    "RandomScale": {"scale": (0.9, 1.1)},  # one factor for all axes, about the volume centre
    # one point per voxel: "first", "sum" (of the energies) or "random"; return_grid_coord: later transforms move
    # only the x, y, z feature columns
    "GridSample": {"grid_size": 1.0, "mode": "first", "return_grid_coord": False},
    "NormalizeCoord": {},  # feature x, y, z: centred on the event's mean, divided by its largest radius
    "LogEnergy": {"scale": None},  # feature log_energy = log1p(energy / scale); None: the dataset's energy_scale
    "RandomCrop": {"max_points": 100000},  # the max_points points nearest to a random point of the event
    "CenterShift": {},  # move the event's bounding-box centre to the volume centre
    "MomentumTransform": {"keys": ("momentum",)},  # each key's positive values p -> log10(p) (detector-v1m2 recipes)
}
# the transforms that draw random numbers (GridSample with mode="random" only)
RANDOM_TRANSFORMS = ("RandomRotate", "RandomFlip", "Jitter", "RandomScale", "RandomCrop", "GridSample")
