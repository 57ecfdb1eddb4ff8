"""The builtin inference engine, one owner per piece of state: front (the asyncio front,
`Engine`), sequence (a request's state and events), messages (the typed messages between the
threads), engine_core (the worker loop, fed by its inbox), scheduler (the queues, the step
plan, preemption, the stop check, applying a step's output), executor (runs a plan on the
runner), kv_manager (blocks, block tables, prefix cache), output (detokenization, stop strings,
metrics, spans), kv (the block tensors), runner (forwards over blocks, CUDA graphs), llama (the
own forward of Llama models on CPU; transformers' forward otherwise), sampling, grammar,
decoding (request validation, detokenizing), metrics, model, quality and quantize (loading
under the perplexity guard), config, load. It imports nothing of its host service."""

from services.inference.engine.config import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_STOP_SEQUENCE,
    EngineConfig,
)
from services.inference.engine.front import Engine, RequestStream
from services.inference.engine.kv import PagedKVCache
from services.inference.engine.kv_manager import BlockManager, BlockTable
from services.inference.engine.model import LoadedModel, ModelDescription, pick_device
from services.inference.engine.sequence import GenerationEvent, SequenceState, TokenLogprob, TopLogprob

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
