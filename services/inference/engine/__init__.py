"""The builtin inference engine (see core.py for the loop, and one module per concern:
config, model, kv (slots), runner (decode step, CUDA graphs), llama (the own forward of Llama
models on CPU; transformers' forward otherwise), sampling, scheduler, stream)."""

from services.inference.engine.config import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_STOP_SEQUENCE,
    EngineConfig,
)
from services.inference.engine.core import Engine
from services.inference.engine.kv import SlotKVCache
from services.inference.engine.model import LoadedModel, ModelDescription, pick_device
from services.inference.engine.stream import GenerationEvent, RequestStream, SequenceState

__all__ = [
    "FINISH_CANCELLED",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "FINISH_STOP_SEQUENCE",
    "Engine",
    "EngineConfig",
    "GenerationEvent",
    "LoadedModel",
    "ModelDescription",
    "RequestStream",
    "SequenceState",
    "SlotKVCache",
    "pick_device",
]
