"""The committed peer-protocol stubs match peer.proto."""

from __future__ import annotations

from pathlib import Path

from singularityd.api.generate import PEER_PROTO, generate
from tests.helpers import REPO


def test_committed_peer_stubs_match_the_proto(tmp_path: Path) -> None:
    generate(tmp_path, PEER_PROTO)
    for name in ("peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py"):
        fresh = (tmp_path / PEER_PROTO.parent / name).read_text()
        committed = (REPO / PEER_PROTO.parent / name).read_text()
        assert fresh == committed, f"{name} is stale: run python -m singularityd.api.generate"
