"""Cache service: exact and semantic answer cache over gRPC."""

from llmesh.server import run_service
from llmesh.settings import CacheServiceSettings
from services.cache.servicer import CacheApp

run_service(CacheServiceSettings, CacheApp)
