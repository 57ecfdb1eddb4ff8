from llmesh.server import run_service
from services.gateway.servicer import GatewayApp

run_service("gateway", GatewayApp)
