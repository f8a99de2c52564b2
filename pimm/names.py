"""The names a config may give in `type=...` and similar keys, without importing torch.

The registries (pimm.engine.optim, pimm.models, pimm.tasks, pimm.data.dataset,
pimm.distributed.strategy) register exactly these names, and the launcher's config check
(pimm.config.validate) accepts exactly these, so a name is added in one place.
"""

OPTIMIZERS = ("SGD", "Adam", "AdamW")  # torch.optim classes of the same name
SCHEDULERS = ("OneCycleLR", "CosineAnnealingLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR")
MODELS = ("PointSegNet", "PointTransformer")  # their options: pimm.config.validate.MODEL_OPTIONS
# the `feat` columns every dataset gives a point (pimm.data.dataset): a model's in_channels must match
FEATURE_COLUMNS = ("x", "y", "z", "log_energy")
TASKS = ("SemanticSegmentation",)  # pimm.tasks
SERIALIZATION_ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")  # PointTransformer orders=...
DATASETS = ("LArTPCDataset", "PILArNetDataset")
PILARNET_REVISIONS = ("v1", "v2", "v3")  # PILArNetDataset revision=...; cluster columns in pimm.data.pilarnet_file
PILARNET_LABELS = ("motif", "pid")  # PILArNetDataset label=...
PARALLEL_STRATEGIES = ("ddp", "fsdp2")  # used when the world size is > 1
NOT_IMPLEMENTED_STRATEGIES = ("tp", "tensor", "tensor_parallel", "pp", "pipeline", "pipeline_parallel", "fsdp",
                              "deepspeed", "zero")
AMP_DTYPES = ("bfloat16", "float32")  # float16 needs a GradScaler, which pimm does not use
