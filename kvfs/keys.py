"""Namespaces and chained block keys.

key_i = blake2b(key_{i-1} || token ids of block i as little-endian int32,
                key = namespace digest, digest_size = 16)
with key_{-1} derived from the namespace, the tenant's secret and the salt. A key
names the whole prefix up to and including its block, so a match is exact from
token 0. The hash is keyed and cryptographic on purpose: a shared cache keyed by
a fast non-cryptographic hash can be poisoned with crafted collisions (vLLM
advisory GHSA-rm76-4mrf-v9r8). The tenant's secret (the metaserver's TenantKey,
given only to the tenant's workers) makes keys unpredictable to everyone else:
block keys appear in owner records and listings, and without the secret nobody
can compute a guessed prompt's keys to compare.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    """Whose cache a block belongs to: blocks of two namespaces never match."""

    tenant: str
    model: str
    cache_format: str = "mla-bf16"
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvfs-namespace")
        for part in (self.tenant, self.model, self.cache_format):
            raw = part.encode()
            h.update(len(raw).to_bytes(4, "little"))  # length-prefixed: ("ab","c") != ("a","bc")
            h.update(raw)
        object.__setattr__(self, "digest", h.digest())

    def root_key(self, salt: str | bytes | None = None, secret: bytes = b"") -> bytes:
        """key_{-1}: the chain's starting point in this namespace, under `salt` and
        the tenant's `secret` (at most 48 bytes; none on an --insecure cluster).

        A salt (vLLM's per-request `cache_salt`) isolates users who share a tenant:
        the same prompt under another salt has keys of its own, so it can neither
        hit nor probe the other's blocks. No salt and an empty one are the same."""
        if len(secret) > 64 - KEY_BYTES:
            raise ValueError(f"a tenant secret is at most {64 - KEY_BYTES} bytes, got {len(secret)}")
        raw = salt.encode() if isinstance(salt, str) else bytes(salt or b"")
        tag = b"kvfs-root" + (b"/salt/" + len(raw).to_bytes(4, "little") + raw if raw else b"")
        return hashlib.blake2b(tag, key=self.digest + bytes(secret), digest_size=KEY_BYTES).digest()


def block_keys(namespace: Namespace, token_ids: Sequence[int], block_tokens: int,
               salt: str | bytes | None = None, secret: bytes = b"") -> list[bytes]:
    """Keys of every full block of `token_ids` (a trailing partial block has none),
    chained from the namespace's root under `salt` and the tenant's `secret`
    (Namespace.root_key)."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    try:
        tokens = array.array("i", token_ids)
    except OverflowError as err:
        raise ValueError(f"token ids must fit in int32: {err}") from None
    if sys.byteorder != "little":
        tokens.byteswap()
    raw = tokens.tobytes()
    step = block_tokens * 4
    keys: list[bytes] = []
    prev = namespace.root_key(salt, secret)
    for start in range(0, len(raw) - step + 1, step):
        prev = hashlib.blake2b(prev + raw[start : start + step], key=namespace.digest,
                               digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
