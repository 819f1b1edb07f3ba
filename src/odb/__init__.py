"""odb: Online Dynamic Batching for PyTorch.

Example:
    >>> import torch, odb
    >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 3, 8, 2)]
    >>> loader = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
    >>> info = odb.pop_step_info(next(iter(loader)))
    >>> info.loss_scale
    1.0
"""

from odb.loader.apply import ODBHandle, apply
from odb.data.bucket_collate import PadToBucket
from odb.plan.costs.buckets import bucket_length, fit_buckets, geometric_buckets
from odb.config import ODBConfig
from odb.data.lengths import count_loss_tokens, default_length, seq2seq_lengths
from odb.loader.dataloader import ODBDataLoader
from odb.train.loss import scale_loss
from odb.packed.collate import PackedCollate
from odb.packed.context import context_shard
from odb.packed.models import PackedLayoutError, check_packed_model
from odb.data.sampling import ShardSampler
from odb.data.batch_shard import BatchShardSampler
from odb.plan.costs.schedule import linear_budget_ramp
from odb.step_info import ODBStepInfo, attach_step_info, pop_step_info
from odb.integrations.enable import enable_odb
from odb.packed.attention import register_varlen_attention, varlen_causal_attention

__all__ = [
    "ODBConfig", "ODBDataLoader", "ODBHandle", "ODBStepInfo", "PackedCollate", "PackedLayoutError",
    "check_packed_model", "apply", "attach_step_info", "count_loss_tokens", "enable_odb",
    "default_length", "pop_step_info", "BatchShardSampler", "register_varlen_attention", "scale_loss",
    "seq2seq_lengths", "ShardSampler",
    "linear_budget_ramp", "varlen_causal_attention", "PadToBucket", "bucket_length", "fit_buckets",
    "geometric_buckets", "context_shard",
]
__version__ = "0.1.0"
