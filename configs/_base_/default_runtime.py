# Defaults every pimm config inherits. Batch sizes and workers are GLOBAL totals:
# each of W ranks gets batch_size / W events and num_worker // W loader workers.
seed = 0
epochs = 1
max_steps = None  # stop after this many optimizer steps (None: run all epochs)
batch_size = 16  # global events per optimizer step; must be divisible by world size x grad_accum_steps
grad_accum_steps = 1  # micro-batches per rank per optimizer step (1: none); the global batch stays batch_size
batch_size_val = None  # None: one event per rank
batch_size_test = None  # None: one event per rank
num_worker = 0  # global loader workers

# used when world size > 1: "ddp" (replicas) or "fsdp2" (fully_shard each wrap_classes module, then
# the root; reshard_after_forward frees gathered parameters after forward; mixed_precision: bf16
# compute with fp32 reduction, CUDA only)
parallel = dict(strategy="ddp", wrap_classes=["Block"], reshard_after_forward=True, mixed_precision=False)
find_unused_parameters = False
sync_bn = False  # converts BatchNorm only when distributed on CUDA

amp = dict(enabled=True, dtype="bfloat16")  # autocast on CUDA only
clip_grad = None  # max gradient norm (None: no clipping)

optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.01)  # more keys pass to torch.optim; fused=True by default
scheduler = None  # None: constant learning rate
# dict(final=0.2, ratio=1.0): every group's weight decay goes from its own value to `final` on a half cosine
# over ratio x the schedule's steps, a function of the global step (the published WeightDecayScheduler);
# groups without weight decay keep none. None: constant
weight_decay_schedule = None

log_every = 10  # optimizer steps between train log lines / metrics records
eval_every_epochs = 1
eval_every_n_steps = None  # also validate (then checkpoint) after every N-th optimizer step, mid-epoch
log_event_ids = False  # write the event ids of every step to logs/event_ids_rank*.jsonl
test_after_training = True  # a finished run with data.test set ends with `pimm test` of model_best (RUN/eval/)
validate_only = False  # True: evaluate the --train.weight weights once; no training, no checkpoint
tensorboard = dict(enabled=False)  # True: rank 0 also writes the metrics records as scalars to RUN_DIR/tensorboard/
# True: rank 0 also logs them to Weights & Biases, offline, in RUN_DIR/wandb/ (upload later: wandb sync)
wandb = dict(enabled=False, mode="offline", project="pimm", entity=None, group=None, tags=None, system_metrics=True)

# what is learned: per-point classes. ignore_index: the label that counts in neither loss nor metrics
# (PILArNet's -1); class_weights: one loss weight per class (None: equal); best_metric picks model_best.pth;
# loss: terms summed with their weights, per event (CrossEntropy, Lovasz, Focal with gamma=2.0; pimm.tasks.losses);
# None: the published model.criteria of a DefaultSegmentorV2 when it has them, else CrossEntropy alone
task = dict(type="SemanticSegmentation", class_weights=None, ignore_index=-1, best_metric="miou", loss=None)
data = dict(num_classes=5, names=["shower", "track", "michel", "delta", "low_energy"], train=None, val=None, test=None)
# fine-tuning. pretrained: weights to start from (--train.weight PATH sets path): a .pth/.safetensors
# file (a bare state_dict, or one under 'state_dict'/'model'; a DDP 'module.' prefix is removed), a
# checkpoint directory or a `pimm export` directory. key_map: ordered [old_prefix, new_prefix] renames
# (the first that applies); skip: fnmatch patterns of (renamed) keys not loaded; strict=False loads
# only the names and shapes that match the model (the others keep their initial values)
pretrained = dict(path=None, key_map=[], strict=True, skip=[])
freeze = []  # fnmatch patterns of parameter names kept fixed (not trained), e.g. ["stem.*", "blocks.0.*"]
# optimizer groups: each parameter joins the first entry whose params pattern ('|' separates
# alternatives) matches its name, else the default group; lr = optimizer.lr x lr_scale, e.g.
# [dict(params="blocks.*", lr_scale=0.1), dict(params="*norm*|*bias", weight_decay=0.0)]
param_groups = []
debug = dict(  # fault injection, used by the tests
    nonfinite_loss_at_step=None, interrupt_at_step=None, kill_during_checkpoint_at_step=None,
    kill_after_checkpoint_manifest_at_step=None,  # rank 0 dies between a checkpoint's manifest and its rename
    desync_rank_params=None,  # True: perturb rank 1's parameters after the strategy wrap (replicas differ)
)

# checkpoints: model/last/{weights.pth, trainer.dcp/, .complete}, older ones as model/step_<8-digit step>/
# (e.g. model/step_00000450/)

checkpoint_every_n_steps = None  # also at the end of every epoch and on SIGTERM/SIGUSR1
checkpoint_async = True  # training blocks only for the in-memory copy
checkpoint_keep_last = 2  # complete checkpoints kept (the older ones are resume fallbacks)
save_iter_snapshots = False  # also keep model/iter_<step>.pth weights at every checkpoint
resume_strict_state = True  # False: best effort, load what matches and restart the saved epoch
