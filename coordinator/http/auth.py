"""API keys on the predict port: a gate every request passes before it takes a slot or its body is read."""

from __future__ import annotations

import logging

from aiohttp import web

from coordinator.config import ConfigError
from coordinator.http.error_response import error_response
from coordinator.errors import ApiError
from coordinator.tenancy.admission import KEY_TERMS
from security.api_keys import INVALID, MALFORMED, MISSING, ApiKeyFileError, ApiKeyStore
from security.settings import AuthConfig

logger = logging.getLogger(__name__)

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="pdserve"'}
MESSAGES = {
    MISSING: "missing API key: send Authorization: Bearer <key>",
    MALFORMED: "malformed Authorization header: send Authorization: Bearer <key>",
    INVALID: "invalid API key",
}

# The predict app's key store, None when auth_config.api_keys_file is empty; reloaded on SIGHUP.
API_KEYS = web.AppKey("api_keys", ApiKeyStore | None)


def load_api_keys(auth: AuthConfig) -> ApiKeyStore | None:
    """The store of auth_config.api_keys_file, None when it is empty; ConfigError naming the key and the file."""
    if not auth.api_keys_file:
        return None
    try:
        store = ApiKeyStore.load(auth.api_keys_file)
    except ApiKeyFileError as exc:
        raise ConfigError(f"auth_config.api_keys_file: {exc}") from None
    if store.num_keys == 0:
        logger.warning("auth_config.api_keys_file %s holds no keys: every request will be refused", store.path)
    return store


class ApiKeyGate:
    """Refuses a request without an accepted key with a 401 in its API's error format, unknown paths included
    (so the routes do not show); GET /health (and /health/live) and GET /metrics may be left open."""

    def __init__(self, store: ApiKeyStore, metrics, open_health: bool = True, open_metrics: bool = True):
        self.store = store
        self.metrics = metrics
        self.open_paths = frozenset(p for p, is_open in (("/health", open_health), ("/health/live", open_health),
                                                         ("/metrics", open_metrics)) if is_open)

    def refusal(self, request: web.Request) -> web.Response | None:
        """The 401 for a request without an accepted key; None lets it through."""
        if request.method in ("GET", "HEAD") and request.path in self.open_paths:
            return None
        headers = request.headers.getall("Authorization", [])
        # Two Authorization headers are ambiguous: a proxy and the gate could each read a different one.
        reason, tenant = (MALFORMED, None) if len(headers) > 1 else self.store.identify(headers[0] if headers else None)
        if reason is None:
            request[KEY_TERMS] = tenant  # the key's tenant, for the admission (tenancy/admission.py)
            return None
        self.metrics.auth_failed(reason)
        return error_response(request, ApiError(401, MESSAGES[reason], error_type="authentication_error"),
                              headers=CHALLENGE)
