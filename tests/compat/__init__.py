"""Real gateways from PyPI (LiteLLM proxy, openai-forward) and a FastAPI gateway, each wrapped
with spendguard exactly as ``docs/integrations/`` shows, in front of the fake provider."""
