"""The builtin inference engine (see core.py for the loop, and one module per concern:
config, model, kv_manager (blocks, block tables, prefix cache), kv (the block tensors), runner
(forwards over blocks, CUDA graphs), llama (the own forward of Llama
models on CPU; transformers' forward otherwise), sampling, scheduler, stream)."""

from services.inference.engine.config import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_STOP_SEQUENCE,
    EngineConfig,
)
from services.inference.engine.core import Engine
from services.inference.engine.kv import PagedKVCache
from services.inference.engine.kv_manager import BlockManager, BlockTable
from services.inference.engine.model import LoadedModel, ModelDescription, pick_device
from services.inference.engine.stream import (
    GenerationEvent,
    RequestStream,
    SequenceState,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "FINISH_CANCELLED",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "FINISH_STOP_SEQUENCE",
    "BlockManager",
    "BlockTable",
    "Engine",
    "EngineConfig",
    "GenerationEvent",
    "LoadedModel",
    "ModelDescription",
    "PagedKVCache",
    "RequestStream",
    "SequenceState",
    "TokenLogprob",
    "TopLogprob",
    "pick_device",
]
