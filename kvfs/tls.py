"""Mutual TLS for every kvfs gRPC link: a small certificate authority, certificates
that say who holds them, and the gRPC credentials built from them.

Every caller and every server presents a certificate signed by the cluster's CA.
Who the holder is travels in the certificate's subject alternative names, as URIs:

    kvfs://role/<server|worker|admin>   what it may call (docs/security.md); one or more
    kvfs://name/<name>                  a server's id (a chunkserver registers as it) or a label
    kvfs://tenant/<tenant>              workers: a tenant it may act for, one per tenant;
                                        "*" is any tenant (a gateway, a local dev cluster)

Server certificates also carry the DNS names and IP addresses they serve on, which
every client checks, so a worker's or admin's certificate cannot pose as a server.
The CA is whatever signed the files a server is given: `kvfs tls` makes one for a
real cluster, the local launcher one per cluster folder (LocalCA).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
import pathlib
import ssl
import tempfile
import threading
from collections.abc import Iterable, Sequence
from urllib.parse import quote, unquote

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER, WORKER, ADMIN = "server", "worker", "admin"
ROLES = (SERVER, WORKER, ADMIN)
ANY_TENANT = "*"
_SCHEME = "kvfs://"
_DAY = datetime.timedelta(days=1)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """Who a verified certificate says its holder is."""

    name: str
    roles: frozenset[str]
    tenants: frozenset[str]

    def may_act_for(self, tenant: str) -> bool:
        return ANY_TENANT in self.tenants or tenant in self.tenants

    def __str__(self) -> str:
        tenants = f" tenants {','.join(sorted(self.tenants))}" if self.tenants else ""
        return f"{self.name!r} ({'+'.join(sorted(self.roles)) or 'no role'}{tenants})"


@functools.lru_cache(maxsize=4096)
def identity_from_pem(pem: bytes) -> Identity:
    """The identity a certificate carries (kvfs:// SAN URIs); no role if it has none."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    fields: dict[str, set[str]] = {"role": set(), "name": set(), "tenant": set()}
    for uri in uris:
        if uri.startswith(_SCHEME):
            kind, _, value = uri[len(_SCHEME):].partition("/")
            if kind in fields and value:
                fields[kind].add(unquote(value))
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = min(fields["name"]) if fields["name"] else (str(cn[0].value) if cn else "")
    return Identity(name, frozenset(fields["role"] & set(ROLES)), frozenset(fields["tenant"]))


def peer_identity(context) -> Identity | None:
    """The verified identity of a gRPC call's peer; None on a plaintext (--insecure)
    link or without a client certificate."""
    pem = context.auth_context().get("x509_pem_cert")
    return identity_from_pem(pem[0]) if pem else None


def socket_identity(sock: ssl.SSLSocket) -> Identity | None:
    """The verified identity of a TLS socket's peer (None without a certificate)."""
    der = sock.getpeercert(binary_form=True)
    return identity_from_pem(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None


def is_plaintext(context) -> bool:
    """True when the call came over a link without TLS (a server started --insecure)."""
    return context.auth_context().get("transport_security_type") != [b"ssl"]


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """One holder's certificate and key, and the CA it trusts, all PEM."""

    ca: bytes
    cert: bytes
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def from_files(cls, ca: str | os.PathLike, cert: str | os.PathLike, key: str | os.PathLike) -> Credentials:
        paths = {"CA certificate": ca, "certificate": cert, "key": key}
        missing = [f"{what} ({p or 'not set'})" for what, p in paths.items() if not p or not os.path.isfile(p)]
        if missing:
            raise ValueError(f"TLS files missing: {', '.join(missing)}; make them with `kvfs tls` or run with "
                             f"--insecure in a trusted lab")
        return cls(*(pathlib.Path(p).read_bytes() for p in (ca, cert, key)))

    @property
    def identity(self) -> Identity:
        return identity_from_pem(self.cert)

    def server(self) -> grpc.ServerCredentials:
        """A server's side: present our certificate, demand and verify the caller's."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel(self) -> grpc.ChannelCredentials:
        """A caller's side: present our certificate, verify the server's against the CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        """The same mutual TLS for a socket of our own (the chunkserver's data port):
        TLS 1.3, our certificate presented, the peer's demanded and verified against
        the CA; a client also checks the server's host name."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=self.ca.decode())
        with tempfile.TemporaryDirectory(prefix="kvfs-tls-") as folder:  # ssl loads a key from files only
            cert, key = pathlib.Path(folder, "cert.pem"), pathlib.Path(folder, "key.pem")
            _write(cert, self.cert)
            _write(key, self.key, private=True)
            ctx.load_cert_chain(cert, key)
        return ctx

    def write(self, folder: str | os.PathLike, name: str) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
        """Writes <folder>/ca.pem, <name>.pem and <name>.key (owner-only); returns the three paths."""
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        ca, cert, key = folder / "ca.pem", folder / f"{name}.pem", folder / f"{name}.key"
        _write(ca, self.ca)
        _write(cert, self.cert)
        _write(key, self.key, private=True)
        return ca, cert, key


def from_config(cfg) -> Credentials | None:
    """The credentials a config's tls_ca / tls_cert / tls_key name; None when it says
    `insecure`. Raises ValueError (naming what is missing) when neither."""
    if cfg.insecure:
        return None
    return Credentials.from_files(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)


# ---- the cluster key: seals the servers give each other ----------------------

CLUSTER_KEY = "cluster.key"  # beside the CA in a LocalCA folder and in what `kvfs tls ca` writes
SEAL_BYTES = 16
# what a seal vouches for: a stored copy; an owner record; the right to read a namespace's chunks
RECEIPT, OWNER, READ = b"kvfs-receipt", b"kvfs-owner", b"kvfs-read"
TENANT_KEY = b"kvfs-tenant-key"  # not a seal: the secret a tenant's block keys chain under (kvfs/keys.py)


def make_cluster_key(path: str | os.PathLike) -> None:
    """A fresh secret shared by the metaserver and the chunkservers (hex, 0600)."""
    _write(pathlib.Path(path), secrets.token_hex(32).encode() + b"\n", private=True)


def load_cluster_key(path: str | os.PathLike) -> bytes:
    key = bytes.fromhex(pathlib.Path(path).read_text().strip())
    if len(key) < 16:
        raise ValueError(f"{path}: a cluster key needs at least 16 bytes")
    return key


def seal(key: bytes, kind: bytes, *parts: bytes | int | str) -> bytes:
    """An HMAC-SHA256 (first SEAL_BYTES) of `kind` and the parts, each length-prefixed:
    what one kvfs server vouches for to another (an owner record the metaserver
    issued; a chunk a chunkserver stored)."""
    mac = hmac.new(key, kind, hashlib.sha256)
    for p in parts:
        raw = p.to_bytes(8, "little") if isinstance(p, int) else p.encode() if isinstance(p, str) else p
        mac.update(len(raw).to_bytes(4, "little") + raw)
    return mac.digest()[:SEAL_BYTES]


def aio_channel(address: str, credentials: Credentials | None, options: Sequence = ()) -> grpc.aio.Channel:
    """An asyncio channel: TLS with `credentials`, plaintext when None (--insecure)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials.channel(), options=list(options))


def channel(address: str, credentials: Credentials | None, options: Sequence = ()) -> grpc.Channel:
    """A blocking channel, as aio_channel."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials.channel(), options=list(options))


def add_port(server, listen: str, credentials: Credentials | None) -> int:
    """Binds `listen` with mutual TLS (plaintext when None); returns the port (0: failed)."""
    if credentials is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, credentials.server())


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> None:
    # a name of its own: two launcher threads may write the same file (the CA's ca.pem) at once
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


@dataclasses.dataclass(frozen=True, slots=True)
class Authority:
    """A certificate authority: its certificate and key (PEM). Keep the key off the
    cluster's machines once the certificates are issued."""

    cert: bytes
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def create(cls, name: str = "kvfs CA", days: int = 3650) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - _DAY).not_valid_after(now + days * _DAY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Authority:
        folder = pathlib.Path(folder)
        return cls((folder / "ca.pem").read_bytes(), (folder / "ca.key").read_bytes())

    def save(self, folder: str | os.PathLike) -> None:
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / "ca.key", self.key, private=True)
        _write(folder / "ca.pem", self.cert)

    def issue(self, name: str, roles: Iterable[str], *, tenants: Iterable[str] = (), hosts: Iterable[str] = (),
              days: int = 365) -> Credentials:
        """A certificate for `name` with `roles`, the `tenants` a worker may act for and,
        for servers, the `hosts` (names or IPs) clients reach it by."""
        roles, tenants, hosts = sorted(set(roles)), sorted(set(tenants)), list(dict.fromkeys(hosts))
        if not roles or set(roles) - set(ROLES):
            raise ValueError(f"roles must be some of {', '.join(ROLES)}, got {roles}")
        if SERVER in roles and not hosts:
            raise ValueError("a server certificate needs the hosts it serves on (e.g. 127.0.0.1, localhost)")
        if WORKER in roles and not tenants:
            raise ValueError("a worker certificate needs at least one tenant ('*' for any)")
        ca_cert = x509.load_pem_x509_certificate(self.cert)
        ca_key = serialization.load_pem_private_key(self.key, None)
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(f"{_SCHEME}name/{quote(name, safe='')}")]
        names += [x509.UniformResourceIdentifier(f"{_SCHEME}role/{r}") for r in roles]
        names += [x509.UniformResourceIdentifier(f"{_SCHEME}tenant/{quote(t, safe='*')}") for t in tenants]
        names += [_host_name(h) for h in hosts]
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if SERVER in roles else [])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64] or "kvfs")]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _DAY).not_valid_after(now + days * _DAY)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        return Credentials(self.cert, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class LocalCA:
    """A CA kept in a folder (ca.pem, ca.key, and the certificates it issued as
    <name>.pem / <name>.key), made on first use: what the local launcher uses."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        if (self.folder / "ca.pem").exists() and (self.folder / "ca.key").exists():
            self.authority = Authority.load(self.folder)
        else:
            self.authority = Authority.create(f"kvfs local CA ({self.folder.name})")
            self.authority.save(self.folder)
        if not self.key_path.exists():
            make_cluster_key(self.key_path)

    @property
    def key_path(self) -> pathlib.Path:
        return self.folder / CLUSTER_KEY

    def issue_files(self, name: str, roles: Iterable[str], *, tenants: Iterable[str] = (),
                    hosts: Iterable[str] = ()) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
        """Issues (or re-issues) <name>.pem / <name>.key here; returns (ca, cert, key) paths."""
        creds = self.authority.issue(name, roles, tenants=tenants, hosts=hosts)
        return creds.write(self.folder, name)

    def credentials(self, name: str, roles: Iterable[str], **kw) -> Credentials:
        """Loads <name>'s credentials from the folder, issuing them first if absent."""
        ca, cert, key = self.folder / "ca.pem", self.folder / f"{name}.pem", self.folder / f"{name}.key"
        if not (cert.exists() and key.exists()):
            ca, cert, key = self.issue_files(name, roles, **kw)
        return Credentials.from_files(ca, cert, key)
