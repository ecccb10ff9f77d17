"""Every gRPC method a kvfs server serves has exactly one access rule, and every
data-port operation is listed; identities read from certificates as issued."""

import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvfs import auth, tls, wire
from kvfs.proto import chunk_pb2, meta_pb2

SERVED = [meta_pb2, chunk_pb2, health_pb2, reflection_pb2]  # the services our servers register


def served_methods() -> set[str]:
    return {f"/{service.full_name}/{method.name}"
            for module in SERVED for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods}


def test_every_method_of_every_service_has_a_rule():
    methods = served_methods()
    assert len(methods) >= 18  # 8 meta + 6 chunk + 3 health + 1 reflection: the walk found them
    missing = sorted(methods - set(auth.RULES))
    assert not missing, f"methods without an access rule in kvfs/auth.py RULES: {missing}"


def test_no_rule_names_a_method_that_does_not_exist():
    assert not set(auth.RULES) - served_methods()


def test_every_rule_names_known_roles_only():
    for method, roles in auth.RULES.items():
        assert roles and roles <= set(tls.ROLES), method


def test_every_data_port_operation_is_listed():
    assert set(auth.DATA_PORT_RULES) == set(wire.REQUEST_KINDS)


@pytest.mark.parametrize("method,role,allowed", [
    ("/kvfs.meta.MetaService/Register", tls.WORKER, False),
    ("/kvfs.meta.MetaService/Register", tls.SERVER, True),
    ("/kvfs.meta.MetaService/Heartbeat", tls.ADMIN, False),
    ("/kvfs.meta.MetaService/MatchPrefix", tls.WORKER, True),
    ("/kvfs.meta.MetaService/MatchPrefix", tls.ADMIN, False),
    ("/kvfs.meta.MetaService/Rebuild", tls.WORKER, False),
    ("/kvfs.meta.MetaService/RunLifecycle", tls.ADMIN, True),
    ("/kvfs.chunk.ChunkService/ListChunks", tls.WORKER, False),
    ("/kvfs.chunk.ChunkService/DeleteChunks", tls.WORKER, False),
    ("/kvfs.chunk.ChunkService/CopyChunk", tls.ADMIN, False),
    ("/kvfs.chunk.ChunkService/CopyChunk", tls.SERVER, True),
    ("/kvfs.chunk.ChunkService/ReadChunks", tls.SERVER, True),
    ("/kvfs.chunk.ChunkService/WriteChunk", tls.ADMIN, False),
])
def test_the_rules_the_issue_asks_for(method, role, allowed):
    assert (role in auth.RULES[method]) == allowed


def test_a_certificate_carries_name_roles_and_tenants():
    ca = tls.Authority.create()
    worker = ca.issue("gateway-1", [tls.WORKER], tenants=["acme", "b c/d"]).identity
    assert worker == tls.Identity("gateway-1", frozenset({tls.WORKER}), frozenset({"acme", "b c/d"}))
    assert worker.may_act_for("b c/d") and not worker.may_act_for("other")
    assert ca.issue("gw", [tls.WORKER], tenants=["*"]).identity.may_act_for("anyone")
    server = ca.issue("cs-7", [tls.SERVER], hosts=["10.0.0.7", "cs-7.kvfs"]).identity
    assert (server.name, server.roles, server.tenants) == ("cs-7", {tls.SERVER}, frozenset())


@pytest.mark.parametrize("roles,kw,text", [
    ([tls.SERVER], {}, "hosts"),
    ([tls.WORKER], {}, "tenant"),
    (["root"], {}, "roles"),
    ([], {}, "roles"),
])
def test_issuing_refuses_incomplete_certificates(roles, kw, text):
    with pytest.raises(ValueError, match=text):
        tls.Authority.create().issue("x", roles, **kw)


def test_local_ca_keeps_its_key_and_reuses_it(tmp_path):
    first = tls.LocalCA(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o077 == 0
    assert tls.LocalCA(tmp_path / "ca").authority == first.authority
    ca, cert, key = first.issue_files("cs-0", [tls.SERVER], hosts=tls.LOCAL_HOSTS)
    assert key.stat().st_mode & 0o077 == 0
    assert tls.Credentials.from_files(ca, cert, key).identity.name == "cs-0"


def test_missing_files_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="kvfs tls.*--insecure"):
        tls.Credentials.from_files(tmp_path / "ca.pem", "", tmp_path / "k")


def test_kvfs_tls_makes_a_ca_and_the_certificates_of_a_real_cluster(tmp_path, capsys):
    from kvfs.cli.main import main

    ca = tmp_path / "ca"
    assert main(["tls", "ca", "--dir", str(ca)]) == 0
    assert main(["tls", "ca", "--dir", str(ca)]) == 1  # never silently replaces a CA
    assert "exists" in capsys.readouterr().out
    assert main(["tls", "issue", "server", "cs-1", "--host", "10.0.0.1", "--dir", str(ca), "--out",
                 str(tmp_path / "cs-1")]) == 0
    assert main(["tls", "issue", "worker", "gw", "--tenant", "acme", "--dir", str(ca)]) == 0
    assert main(["tls", "issue", "worker", "gw2", "--dir", str(ca)]) == 1  # a worker needs a tenant
    server = tls.Credentials.from_files(tmp_path / "cs-1" / "ca.pem", tmp_path / "cs-1" / "cs-1.pem",
                                        tmp_path / "cs-1" / "cs-1.key")
    assert server.ca == (ca / "ca.pem").read_bytes()
    assert server.identity == tls.Identity("cs-1", frozenset({tls.SERVER}), frozenset())
    worker = tls.identity_from_pem((ca / "gw.pem").read_bytes())
    assert worker.roles == {tls.WORKER} and worker.tenants == {"acme"}
