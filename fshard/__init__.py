"""fshard: immutable sharded arrays for PyTorch, moved by pure functions and cached plans."""

from fshard import backends as backends
from fshard._api import operators as _operators
from fshard._api.accumulate import discard_kept_aside as discard_kept_aside
from fshard._api.backward import backward as backward
from fshard._api.creation import empty as empty
from fshard._api.creation import empty_like as empty_like
from fshard._api.creation import full as full
from fshard._api.creation import full_like as full_like
from fshard._api.creation import ones as ones
from fshard._api.creation import ones_like as ones_like
from fshard._api.creation import rand as rand
from fshard._api.creation import rand_like as rand_like
from fshard._api.creation import randn as randn
from fshard._api.creation import randn_like as randn_like
from fshard._api.creation import zeros as zeros
from fshard._api.creation import zeros_like as zeros_like
from fshard._api.dist import from_local_shards as from_local_shards
from fshard._api.dist import from_local_tensor as from_local_tensor
from fshard._api.map import map_local as map_local
from fshard._api.map import shard_map as shard_map
from fshard._api.module_apply import apply_module as apply_module
from fshard._api.module_rules import fully_sharded as fully_sharded
from fshard._api.module_rules import replicated as replicated
from fshard._api.module_rules import shard_module as shard_module
from fshard._api.module_tp import TensorParallel as TensorParallel
from fshard._api.module_tp import tensor_parallel as tensor_parallel
from fshard._api.modules import load_state_dict as load_state_dict
from fshard._api.modules import shard_params as shard_params
from fshard._api.move import allclose as allclose
from fshard._api.move import equal as equal
from fshard._api.move import from_local_shards_and_layout as from_local_shards_and_layout
from fshard._api.move import gather as gather
from fshard._api.move import reshard as reshard
from fshard._api.optim import load_optimizer_state as load_optimizer_state
from fshard._api.optim import optimizer_state as optimizer_state
from fshard._api.prefetch import Prefetch as Prefetch
from fshard._api.prefetch import prefetch as prefetch
from fshard._api.psum import pmean as pmean
from fshard._api.psum import psum as psum
from fshard._api.shard import shard as shard
from fshard._api.tree import check_replicas as check_replicas
from fshard._api.tree import clip_grad_norm as clip_grad_norm
from fshard._api.tree import global_norm as global_norm
from fshard._array.array import Shard as Shard
from fshard._array.array import ShardedArray as ShardedArray
from fshard._base.cache import clear_caches as clear_caches
from fshard._checkpoint import Concat as Concat
from fshard._checkpoint import Split as Split
from fshard._checkpoint import checkpoint_info as checkpoint_info
from fshard._checkpoint import load as load
from fshard._checkpoint import save as save
from fshard._checkpoint import save_safetensors as save_safetensors
from fshard._config import config as config
from fshard._errors import CheckpointError as CheckpointError
from fshard._errors import CollectiveMismatchError as CollectiveMismatchError
from fshard._errors import FShardError as FShardError
from fshard._errors import LayoutError as LayoutError
from fshard._errors import ReplicaMismatchError as ReplicaMismatchError
from fshard._errors import SpecError as SpecError
from fshard._exec.accumulate import no_sync as no_sync
from fshard._interop.torch_objects import from_dtensor as from_dtensor
from fshard._interop.torch_objects import from_sharded_tensor as from_sharded_tensor
from fshard._interop.torch_objects import to_dtensor as to_dtensor
from fshard._interop.torch_objects import to_sharded_tensor as to_sharded_tensor
from fshard._layout.layout import Layout as Layout
from fshard._layout.layout import ShardMeta as ShardMeta
from fshard._layout.placement import Placement as Placement
from fshard._layout.precision import Precision as Precision
from fshard._layout.specs import Chunk as Chunk
from fshard._layout.specs import Explicit as Explicit
from fshard._layout.specs import Mesh as Mesh
from fshard._layout.specs import Named as Named
from fshard._layout.specs import Partial as Partial
from fshard._layout.specs import Replicated as Replicated
from fshard._layout.specs import Single as Single
from fshard._log import logger as _logger  # noqa: F401  # pyright: ignore[reportUnusedImport]  # gives the 'fshard' logger its NullHandler
from fshard._plan import plan as plan
from fshard._plan.direct import Plan as Plan
from fshard._plan.direct import Transfer as Transfer
from fshard._plan.schedule import RankSchedule as RankSchedule

__version__ = "0.1.0"

_operators.install()  # ShardedArray's operators and sum(), declared on the class for type checkers

__all__ = [
    "CheckpointError",
    "Chunk",
    "CollectiveMismatchError",
    "Concat",
    "Explicit",
    "FShardError",
    "Layout",
    "LayoutError",
    "Mesh",
    "Named",
    "Partial",
    "Placement",
    "Plan",
    "Precision",
    "Prefetch",
    "RankSchedule",
    "ReplicaMismatchError",
    "Replicated",
    "Shard",
    "ShardMeta",
    "ShardedArray",
    "Single",
    "SpecError",
    "Split",
    "TensorParallel",
    "Transfer",
    "allclose",
    "apply_module",
    "backends",
    "backward",
    "check_replicas",
    "checkpoint_info",
    "clear_caches",
    "clip_grad_norm",
    "config",
    "discard_kept_aside",
    "empty",
    "empty_like",
    "equal",
    "from_dtensor",
    "from_local_shards",
    "from_local_shards_and_layout",
    "from_local_tensor",
    "from_sharded_tensor",
    "full",
    "full_like",
    "fully_sharded",
    "gather",
    "global_norm",
    "load",
    "load_optimizer_state",
    "load_state_dict",
    "map_local",
    "no_sync",
    "ones",
    "ones_like",
    "optimizer_state",
    "plan",
    "pmean",
    "prefetch",
    "psum",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "replicated",
    "reshard",
    "save",
    "save_safetensors",
    "shard",
    "shard_map",
    "shard_module",
    "shard_params",
    "tensor_parallel",
    "to_dtensor",
    "to_sharded_tensor",
    "zeros",
    "zeros_like",
]
