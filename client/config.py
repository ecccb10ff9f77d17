"""ClientConfig: how the SDK proves who it is (KVFS_CLIENT_*, [client] in TOML).

Used when a Client is given no credentials: the same variables serve every worker
process on a host, as DOCKER_CERT_PATH or ETCDCTL_CACERT do for their tools.
"""

from __future__ import annotations

import dataclasses
import logging

from kvfs import tls
from kvfs.config import load, option
from kvfs.errors import InvalidArgument

log = logging.getLogger("kvfs.client")
_warned = False  # the insecure warning, once per process


@dataclasses.dataclass(frozen=True, slots=True)
class ClientConfig:
    tls_ca: str = option("", "CA certificate (PEM) of the cluster: servers must present a certificate it signed")
    tls_cert: str = option("", "this worker's certificate (PEM; role worker, the tenants it may act for)")
    tls_key: str = option("", "the certificate's private key (PEM)")
    insecure: bool = option(False, "plaintext gRPC to a cluster started with --insecure (a trusted lab only)")


def resolve_credentials(credentials: tls.Credentials | None, insecure: bool) -> tls.Credentials | None:
    """What a client connects with: `credentials` if given, plaintext if `insecure`,
    else the ClientConfig (environment, then KVFS_CONFIG's [client] table)."""
    if credentials is not None:
        return credentials
    if not insecure:
        try:
            cfg = load(ClientConfig, "client")
        except (ValueError, OSError) as err:
            raise InvalidArgument(f"client configuration: {err}") from None
        if not cfg.insecure:
            try:
                return tls.from_config(cfg)
            except (ValueError, OSError) as err:
                raise InvalidArgument(f"no client credentials: pass credentials=Credentials.from_files(ca, cert, "
                                      f"key), or set KVFS_CLIENT_TLS_CA / _CERT / _KEY ({err}); insecure=True "
                                      f"only for a cluster started with --insecure") from None
    global _warned
    if not _warned:
        _warned = True
        log.warning("kvfs client with insecure: plaintext gRPC, no certificate; only a cluster started with "
                    "--insecure will answer")
    return None
