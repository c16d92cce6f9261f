"""Who may share cached work: the salt of a request's prefix KV blocks, encoded images / audio and cascade transcripts.

A cache shared by every caller is a timing side channel: a hit answers far sooner, so one tenant could learn whether
another sent a given prompt, image or clip. Each request's cache entries are therefore salted with its caller (the
API key's id or the client certificate's name, services/grpc_api/auth.py) plus the request's own `cache_salt` field, which
narrows sharing further (vLLM's semantics: the same salt may share, another never does). The engine puts the salt
into the first KV block's hash only (engine/kv_manager.py: every later hash chains from it) and into the encoder
cache's entry names (engine/encoder_cache.py `salted_key`).

A server without API keys or mTLS has no callers to tell apart: a request without `cache_salt` gets the empty salt,
i.e. the one shared cache, with the same hashes as before salts existed.
"""

from __future__ import annotations

import hashlib
import json

from omnivox.services import errors
from omnivox.services.call_record import current_call
from omnivox.services.errors import FieldViolation

MAX_CACHE_SALT_CHARS = 256


def request_salt(cache_salt: str, field: str = "cache_salt") -> str:
    """The running RPC's salt: "" when it has neither caller nor `cache_salt`, else a digest of both (fixed length,
    and no caller name kept in the caches). INVALID_ARGUMENT on `field` when `cache_salt` is too long."""
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise errors.invalid_argument(
            [FieldViolation(field, f"{len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")]
        )
    caller = current_call().caller
    if not caller and not cache_salt:
        return ""
    return hashlib.sha256(json.dumps([caller, cache_salt]).encode()).hexdigest()[:32]
