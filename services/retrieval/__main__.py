"""Retrieval service: document store and search for RAG over gRPC."""

from llmesh.server import run_service
from llmesh.settings import RetrievalServiceSettings
from services.retrieval.servicer import RetrievalApp

run_service(RetrievalServiceSettings, RetrievalApp)
