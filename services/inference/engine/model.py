"""The loaded model: device and dtype choice (llmesh.hardware, through the perplexity guard of
services.inference.engine.quality), weights, tokenizer and what the service reports."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from llmesh.hardware import DtypeChoice, choose_dtype, dtype_name
from llmesh.models import VerifiedModel
from services.inference.engine.llama import serving_logits
from services.inference.engine.quality import load_guarded
from services.inference.engine.quantize import QUANTIZE_AUTO, auto_quantization

log = logging.getLogger("llmesh.inference.engine")


def pick_device(preference: str, dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """auto/cuda: CUDA if available. The dtype: LLMESH_DTYPE, or by hardware (llmesh.hardware:
    CUDA bf16, fp16 without bf16; CPU bf16 with native bf16, else float32)."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("LLMESH_DEVICE=cuda but CUDA is not available")
    device = torch.device("cuda" if preference in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    choice = choose_dtype(device, dtype)
    log.info("dtype %s on %s: %s", choice.name, device, choice.reason)
    return device, choice.dtype


@dataclass(frozen=True)
class ModelDescription:
    model_id: str
    version: str
    digest: str
    path: Path
    device: str
    dtype: str
    max_context_tokens: int
    max_batch_size: int


class LoadedModel:
    """A verified model directory loaded for serving: safetensors weights only, no remote code."""

    def __init__(
        self, verified: VerifiedModel, device_preference: str = "auto", dtype: str = "auto", quantize: str = "none"
    ) -> None:
        from transformers import GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.verified = verified
        self.device, chosen = pick_device(device_preference, dtype)
        self.tokenizer = Tokenizer.from_file(str(verified.path / "tokenizer.json"))
        # The perplexity guard (services.inference.engine.quality) may refuse the dtype: float32 then.
        choice = DtypeChoice(chosen, dtype != "auto", f"LLMESH_DTYPE={dtype}")
        # The guard measures the forward that serves: the own Llama forward where it applies.
        # LLMESH_QUANTIZE=auto: int4 for weights shipped in 4 bits, dropped if the guard refuses it.
        method = auto_quantization(verified.manifest, self.device) if quantize == QUANTIZE_AUTO else quantize
        self.model, self.dtype, self.quality, self.quantize = load_guarded(
            verified,
            self.device,
            choice,
            method,
            self.tokenizer,
            1024,
            serving_logits,
            quantize_explicit=quantize != QUANTIZE_AUTO,
        )
        #: ModelInfo.dtype and the gateway's cache scope: "bfloat16", "bfloat16+int8"...
        self.dtype_name = dtype_name(self.dtype) + ("" if self.quantize == "none" else f"+{self.quantize}")
        self.config = self.model.config
        eos: Any = self.config.eos_token_id
        if (verified.path / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(verified.path, local_files_only=True).eos_token_id or eos
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        pad = self.config.pad_token_id
        self.pad_id = int(pad if pad is not None else (eos_ids[0] if eos_ids else 0))
        self.max_context_tokens = int(getattr(self.config, "max_position_embeddings", 2048))
        self.vocab_size = int(self.config.vocab_size)
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    def encode(self, text: str) -> list[int]:
        """Tokens of an already chat-templated prompt (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
