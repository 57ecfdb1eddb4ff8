"""Inference service: continuous batching over a transformers causal LM, streamed over gRPC."""
