"""The loaded model: device and dtype choice, weights, tokenizer and what the service reports.

Moved unchanged from the single-file engine (services/inference/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from llmesh.models import VerifiedModel


def pick_device(preference: str) -> tuple[torch.device, torch.dtype]:
    """auto/cuda: CUDA with bf16 (fp16 where bf16 is unsupported); otherwise CPU float32."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("LLMESH_DEVICE=cuda but CUDA is not available")
    if preference in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda"), (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    return torch.device("cpu"), torch.float32


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

    def __init__(self, verified: VerifiedModel, device_preference: str = "auto") -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.verified = verified
        self.device, self.dtype = pick_device(device_preference)
        model = AutoModelForCausalLM.from_pretrained(
            verified.path, use_safetensors=True, dtype=self.dtype, trust_remote_code=False, local_files_only=True
        )
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.config = model.config
        self.tokenizer = Tokenizer.from_file(str(verified.path / "tokenizer.json"))
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
