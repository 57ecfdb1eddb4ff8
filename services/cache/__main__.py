"""Cache service: exact and semantic answer cache over gRPC."""

from llmesh.server import run_service
from services.cache.servicer import CacheApp

run_service("cache", CacheApp)
