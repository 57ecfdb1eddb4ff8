"""Inference service: the causal LM with continuous batching, streamed over gRPC."""

from llmesh.server import run_service
from llmesh.settings import InferenceServiceSettings
from services.inference.servicer import InferenceApp

run_service(InferenceServiceSettings, InferenceApp)
