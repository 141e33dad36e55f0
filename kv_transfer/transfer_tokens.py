"""One-time KV transfer tokens: a decode worker takes a request's KV cache only from whoever it told to send it.

The KV receivers listen on open ports, and a KV stream names its request; without a token anyone
who guessed or saw a request id could feed that request a cache of their choosing, or fail it.
A token's life:

1. issued by the decode worker once it admits the request, and sent to the coordinator in `accepted`; bound to
   the LoRA adapter the request runs under (its identity), which the stream's header must name;
2. handed by the coordinator to the prefill worker in PrefillRequest, which puts it in the KvHeader;
3. redeemed once, when a receiver opens the stream: a stream with a missing, wrong or spent token is
   refused without touching the request, and a wrong guess does not spend the real token;
4. revoked when the request ends, whichever way, so it dies with the request.
"""

from __future__ import annotations

import hmac
import secrets
import threading


class KvTransferTokens:
    """The decode worker's outstanding tokens, by request id; safe to use from the TCP receiver's threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, bytes]] = {}

    def issue(self, request_id: str, lora_digest: bytes = b"") -> str:
        """A new token for `request_id` (whose cache must be computed under the adapter `lora_digest` names; b"":
        the base model), replacing any earlier one."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[request_id] = token, lora_digest
        return token

    def redeem_for(self, request_id: str, token: str) -> bytes | None:
        """Once, for the token issued for `request_id` (then spent): the adapter identity it was bound to; None for
        anything else."""
        with self._lock:
            expected, lora_digest = self._tokens.get(request_id, (None, b""))
            if expected is None or not token or not hmac.compare_digest(expected.encode(), token.encode()):
                return None
            del self._tokens[request_id]
            return lora_digest

    def redeem(self, request_id: str, token: str) -> bool:
        """True once for the token issued for `request_id`, which is then spent; False for anything else."""
        return self.redeem_for(request_id, token) is not None

    def revoke(self, request_id: str) -> None:
        """Forget the request's token, if it still has one."""
        with self._lock:
            self._tokens.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)
