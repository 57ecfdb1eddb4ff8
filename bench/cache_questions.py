"""The questions the cache benches ask, and their OpenAI-API request body: shared by
`bench.cache` and its `--tenancy` run (`bench.tenancy`), so both load the same cache entries."""

from __future__ import annotations

from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "What is the largest planet in the solar system?",
    "What language is spoken in Brazil?",
    "How many days are there in a week?",
]


def chat_body(model: str, prompt: str) -> dict[str, Any]:
    """The OpenAI-API twin of `request(prompt)`: same prompt, sampling and tenant, so the same
    cache entry answers both."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "llmesh": {"use_retrieval": False},
    }
