from llmesh.server import run_service
from llmesh.settings import GatewayServiceSettings
from services.gateway.servicer import GatewayApp

run_service(GatewayServiceSettings, GatewayApp)
