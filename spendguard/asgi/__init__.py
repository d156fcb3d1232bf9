"""The ASGI adapter: routes, request bodies, identity resolvers, error bodies, lifespan."""

from __future__ import annotations

from .admin import admin_app
from .dependency import spendguard_guard
from .identity import IdentityResolver, from_auth_state, from_user
from .keys import KEY_HEADERS, api_key_from_headers, from_api_key, hashed_key
from .middleware import HEADER_INFERENCE_ID, STATE_MODEL, SpendGuardMiddleware

__all__ = [
    "HEADER_INFERENCE_ID",
    "KEY_HEADERS",
    "STATE_MODEL",
    "IdentityResolver",
    "SpendGuardMiddleware",
    "admin_app",
    "api_key_from_headers",
    "from_api_key",
    "from_auth_state",
    "from_user",
    "hashed_key",
    "spendguard_guard",
]
