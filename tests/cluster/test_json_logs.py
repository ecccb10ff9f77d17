"""--log-format json on real servers: every line either server writes, from start-up
to shutdown and a refused request between, is one JSON object with the fields log
shippers index on."""

from __future__ import annotations

import json

import grpc

from kvfs import tls

from helpers import credentials

FIELDS = {"time", "level", "logger", "message"}


def json_lines(text: str) -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines()]  # a line that is not JSON fails here
    for line in lines:
        assert FIELDS <= set(line) <= FIELDS | {"exc_info", "stack_info"}, line
        assert all(isinstance(line[k], str) and line[k] for k in FIELDS), line
    return lines


def test_both_servers_write_one_json_object_per_line(local_cluster):
    json_logs = ["--log-format", "json"]
    cluster = local_cluster(chunkservers=1, replicas=1, meta_extra=json_logs, chunk_extra=json_logs)
    with tls.channel(cluster.meta_address, credentials()) as channel:  # bad input: a warning line
        try:
            channel.unary_unary("/kvfs.meta.MetaService/MatchPrefix")(b"\xff\xff\xff", timeout=10)
            raise AssertionError("a body that does not parse was answered")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    meta, cs = cluster.meta, cluster.chunkservers[0]
    cluster.stop()
    meta_lines, cs_lines = json_lines(meta.log_path.read_text()), json_lines(cs.log_path.read_text())
    assert any(line["logger"] == "kvfs.metaserver" and line["level"] == "INFO" and "serving on" in line["message"]
               for line in meta_lines)
    assert any(line["logger"] == "kvfs.rpc" and line["level"] == "WARNING" and "MatchPrefix" in line["message"]
               and "does not parse" in line["message"] for line in meta_lines)
    assert any(line["message"] == "metaserver stopping" for line in meta_lines)
    assert any(line["logger"] == "kvfs.chunkserver.membership" and "registered with metaserver" in line["message"]
               for line in cs_lines)
    assert any(line["message"] == "chunkserver cs-0 stopping" for line in cs_lines)
