"""The five llmesh services. Each is started with `python -m services.<name>`; they never
import one another and meet only through the stubs in llmesh.v1."""
