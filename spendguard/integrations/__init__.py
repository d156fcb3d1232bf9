"""What spendguard knows about particular gateways, beyond ASGI (each imports nothing of its
gateway: the middleware recognises a gateway's app among the modules already loaded).

:mod:`.litellm`: the LiteLLM proxy's ``model_list`` prices its aliases, and its response headers
name the deployment that served each inference.
"""
