"""Joining a lab over the join RPC: fingerprint check first, token and CSR over TLS, key kept local."""

from __future__ import annotations

import json
import logging
import time

import pytest

from singularityd.federation.join import JoinError, discover_ca, join, start_join_server
from tests.federation.conftest import Lab


async def test_a_new_node_joins_with_the_token_and_the_ca_fingerprint(lab: Lab) -> None:
    server, port = await start_join_server(lab.pki, lab.pki.identity(time.time()), "127.0.0.1:0")
    try:
        joiner = lab.node_pki("node-b")
        identity = await join(joiner, "node-b", f"127.0.0.1:{port}", lab.token, lab.fingerprint)
        assert identity.node_name == "node-b" and identity.ca_pem == lab.pki.ca_cert_path.read_bytes()
        assert joiner.identity(time.time()) == identity
        issued = json.loads((lab.pki.root / "issued.json").read_text())
        assert set(issued) == {"node-a", "node-b"}
    finally:
        await server.stop(None)


async def test_a_join_port_presenting_another_ca_is_refused_before_anything_is_sent(
    lab: Lab, foreign_lab: Lab
) -> None:
    server, port = await start_join_server(
        foreign_lab.pki, foreign_lab.pki.identity(time.time()), "127.0.0.1:0"
    )
    try:
        with pytest.raises(JoinError, match="does not present a CA with fingerprint"):
            await join(lab.node_pki("node-b"), "node-b", f"127.0.0.1:{port}", lab.token, lab.fingerprint)
        assert "node-b" not in json.loads((foreign_lab.pki.root / "issued.json").read_text())
        assert not (lab.root / "node-b" / "node.crt").exists()
    finally:
        await server.stop(None)


async def test_a_bad_token_is_refused_and_logged_by_the_ca_node(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    server, port = await start_join_server(lab.pki, lab.pki.identity(time.time()), "127.0.0.1:0")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(JoinError, match="not one this CA issued"):
            bad = lab.token.split(".")[0] + ".0000000000000000"
            await join(lab.node_pki("node-b"), "node-b", f"127.0.0.1:{port}", bad, lab.fingerprint)
        assert any("refused a join" in r.message for r in caplog.records)
    finally:
        await server.stop(None)


async def test_discovery_reports_the_ca_node_name(lab: Lab) -> None:
    server, port = await start_join_server(lab.pki, lab.pki.identity(time.time()), "127.0.0.1:0")
    try:
        ca_pem, node = discover_ca(f"127.0.0.1:{port}", lab.fingerprint.upper().replace("SHA256:", "sha256:"))
        assert node == "node-a" and ca_pem == lab.pki.ca_cert_path.read_bytes()
    finally:
        await server.stop(None)


def test_an_unreachable_join_port_is_a_clear_error() -> None:
    with pytest.raises(JoinError, match="cannot reach the join port"):
        discover_ca("127.0.0.1:1", "sha256:00", timeout_s=2)
    with pytest.raises(JoinError, match="not host:port"):
        discover_ca("localhost", "sha256:00")
