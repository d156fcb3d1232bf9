"""The ASGI adapter: routes, request bodies, identity resolvers, error bodies, lifespan."""

from __future__ import annotations

from .admin import admin_app
from .dependency import spendguard_guard
from .identity import IdentityResolver, from_auth_state, from_user
from .middleware import HEADER_INFERENCE_ID, SpendGuardMiddleware

__all__ = [
    "HEADER_INFERENCE_ID",
    "IdentityResolver",
    "SpendGuardMiddleware",
    "admin_app",
    "from_auth_state",
    "from_user",
    "spendguard_guard",
]
