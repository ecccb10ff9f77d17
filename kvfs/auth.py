"""Who may call what: one rule per gRPC method, enforced in front of every handler.

The caller's identity is its verified client certificate (kvfs.tls). A call with
no identity is UNAUTHENTICATED, one whose roles the method's rule does not list is
PERMISSION_DENIED, and a method without a rule is refused whoever calls it (a
unit test keeps every method of every service in the table). Every refusal is
logged with who called what. docs/security.md explains each rule.
"""

from __future__ import annotations

import inspect
import logging

import grpc

from kvfs import wire
from kvfs.errors import InvalidArgument, PermissionDenied
from kvfs.tls import ADMIN, SERVER, WORKER, Identity, is_plaintext, peer_identity

log = logging.getLogger("kvfs.auth")

_META = "/kvfs.meta.MetaService/"
_CHUNK = "/kvfs.chunk.ChunkService/"
_HEALTH = "/grpc.health.v1.Health/"
_REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/"

RULES: dict[str, frozenset[str]] = {
    # membership: chunkservers only, each as the id its certificate names
    _META + "Register": frozenset({SERVER}),
    _META + "Heartbeat": frozenset({SERVER}),
    # the data path's metadata: workers, each for the tenants its certificate names
    _META + "AllocateBlocks": frozenset({WORKER}),
    _META + "CommitBlocks": frozenset({WORKER}),
    _META + "MatchPrefix": frozenset({WORKER}),
    _META + "TenantKey": frozenset({WORKER}),
    _META + "ShardMap": frozenset({WORKER, ADMIN}),
    # cluster-wide counts and server addresses, nothing per tenant (the SDK's status())
    _META + "Status": frozenset({WORKER, ADMIN, SERVER}),
    # per-tenant usage (`kvfs usage`): workers for the tenants their certificate names, admins all
    _META + "Usage": frozenset({WORKER, ADMIN}),
    # operator commands (`kvfs rebuild`, `kvfs gc`)
    _META + "Rebuild": frozenset({ADMIN, SERVER}),
    _META + "RunLifecycle": frozenset({ADMIN, SERVER}),
    # chunk bytes: workers write (each chunk under its write grant, kvfs.grants) and restore;
    # servers read a source chunk for CopyChunk
    _CHUNK + "WriteChunk": frozenset({WORKER}),
    _CHUNK + "ReadChunks": frozenset({WORKER, SERVER}),
    # inventory and removal: the metaserver (GC, eviction, rebuild) and operators
    _CHUNK + "DeleteChunks": frozenset({ADMIN, SERVER}),
    _CHUNK + "ListChunks": frozenset({ADMIN, SERVER}),
    _CHUNK + "Stat": frozenset({ADMIN, SERVER}),
    # re-replication, ordered by the metaserver
    _CHUNK + "CopyChunk": frozenset({SERVER}),
    # liveness, for every authenticated caller (launchers, probes with a certificate)
    _HEALTH + "Check": frozenset({SERVER, WORKER, ADMIN}),
    _HEALTH + "Watch": frozenset({SERVER, WORKER, ADMIN}),
    _HEALTH + "List": frozenset({SERVER, WORKER, ADMIN}),
    # server reflection: every authenticated caller, as for health. It describes only the
    # services and messages published in proto/ (and health's, reflection's own): no
    # tenant, block, chunk or server of this cluster; what a caller may then call is
    # still each method's own rule. Callers without a certificate of the CA get nothing.
    _REFLECTION + "ServerReflectionInfo": frozenset({SERVER, WORKER, ADMIN}),
}

# The chunkserver's data port (kvfs/wire.py): over TCP, mutual TLS with the cluster's
# CA as on gRPC, any role (the handshake refuses everyone else); the tenant's
# authority is the read grant the metaserver minted with the lookup (kvfs/grants.py),
# checked against each chunk's owner record. The local socket is the kernel's:
# SO_PEERCRED says who is calling, nothing on it leaves the host.
DATA_PORT_RULES: dict[int, tuple[str, str]] = {
    wire.READ: ("READ", "over TCP: a caller with a certificate of the cluster's CA (worker, admin or server); "
                        "on the local socket: a local process; either way with a read grant for the namespace "
                        "each chunk's owner record names"),
    wire.READ_SHM: ("READ_SHM", "as READ, from a local process; into buffers it registered"),
    wire.WRITE: ("WRITE", "over TCP: a caller with a certificate of the cluster's CA; on the local socket: a local "
                          "process; either way with the owner record the metaserver sealed for the chunk id at "
                          "allocation, checked (with the announced size) before any of the chunk's bytes are read"),
    wire.WRITE_SHM: ("WRITE_SHM", "as WRITE, from a local process, of bytes in a mapping it registered; "
                                  "copied out of it before they are checked"),
    wire.SHM_REGISTER: ("SHM_REGISTER", "a local process on the port's local socket, for a memory file it passes "
                                        "by descriptor, sealed against shrinking; never by name, never over TCP"),
}


def caller_of(context) -> Identity | None:
    """The caller's identity, or None on a plaintext (--insecure) server."""
    return peer_identity(context)


def check_tenant(context, tenant: str) -> None:
    """Raises PermissionDenied unless the caller may act for `tenant`. A plaintext
    (--insecure) server has no identities and allows every tenant; a TLS call
    reaching here always has one (the interceptor refused the others)."""
    if is_plaintext(context):
        return
    who = peer_identity(context)
    if who is None or not who.may_act_for(tenant):
        allowed = ", ".join(sorted(who.tenants)) if who and who.tenants else "none"
        raise PermissionDenied(f"{who or 'an unidentified caller'} may not act for tenant {tenant!r} "
                               f"(its certificate allows: {allowed})")


def tenants_visible(context):
    """Which tenants' figures the caller may see: every tenant for an admin (or on a
    plaintext server), else those its certificate lets it act for."""
    if is_plaintext(context):
        return lambda tenant: True
    who = peer_identity(context)
    if who is None:
        return lambda tenant: False
    if ADMIN in who.roles:
        return lambda tenant: True
    return who.may_act_for


def check_server_id(context, server_id: str) -> None:
    """Raises PermissionDenied unless the caller's certificate names `server_id`: a
    server registers and heartbeats only as itself, so no one can take over another
    server's id (and its address in every lookup) or report its chunks lost."""
    if not server_id:
        raise InvalidArgument("server_id is required")
    if is_plaintext(context):
        return
    who = peer_identity(context)
    if who is None or who.name != server_id:
        raise PermissionDenied(f"{who or 'an unidentified caller'} may not act as server {server_id!r}: a "
                               f"server certificate names the one id it registers as")


class Authorizer(grpc.aio.ServerInterceptor):
    """Checks every call's identity against RULES before its handler runs."""

    def __init__(self, server: str, rules: dict[str, frozenset[str]] = RULES):
        self.server = server
        self.rules = rules

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None  # unknown to this server: gRPC answers UNIMPLEMENTED
        return _guarded(handler, details.method, self.rules.get(details.method), self.server)


async def _refusal(context, method: str, allowed: frozenset[str] | None, server: str) -> tuple | None:
    """(code, message) when the call may not proceed, else None; logs each refusal."""
    if is_plaintext(context):
        return None  # --insecure: no identities to check (warned at start-up)
    who = peer_identity(context)
    if who is None:
        code, msg = grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a client certificate signed by the cluster CA"
    elif allowed is None:
        code, msg = grpc.StatusCode.PERMISSION_DENIED, f"{method} has no access rule on {server}: refused to all"
    elif not who.roles & allowed:
        code, msg = (grpc.StatusCode.PERMISSION_DENIED,
                     f"{who} may not call {method} (allowed: {', '.join(sorted(allowed))})")
    else:
        return None
    log.warning("%s refused %s from %s at %s: %s", server, method, who or "an unidentified caller",
                context.peer(), code.name)
    return code, msg


def _guarded(handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[str] | None, server: str):
    """`handler` with the rule checked first, for each of the four call shapes."""
    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
           ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)

    if inspect.isasyncgenfunction(behavior):
        async def guarded(request, context):
            refusal = await _refusal(context, method, allowed, server)
            if refusal:
                await context.abort(*refusal)
            async for reply in behavior(request, context):
                yield reply
    else:
        async def guarded(request, context):
            refusal = await _refusal(context, method, allowed, server)
            if refusal:
                await context.abort(*refusal)
            return await behavior(request, context)

    return handler._replace(**{kind: guarded})
