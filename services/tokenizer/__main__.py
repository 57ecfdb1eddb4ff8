from llmesh.server import run_service
from services.tokenizer.servicer import TokenizerApp

run_service("tokenizer", TokenizerApp)
