from llmesh.server import run_service
from llmesh.settings import TokenizerServiceSettings
from services.tokenizer.servicer import TokenizerApp

run_service(TokenizerServiceSettings, TokenizerApp)
