"""Regenerate the committed gRPC stubs from the .protos: `python -m singularityd.api.generate`."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("singularityd/api/v1/singularity.proto")
PEER_PROTO = Path("singularityd/federation/v1/peer.proto")
PROTOS = (PROTO, PEER_PROTO)


def generate(out_dir: Path, proto: Path = PROTO) -> None:
    """Write <name>_pb2.py, .pyi and _pb2_grpc.py for one proto (a path under the repo) under out_dir."""
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / proto),
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with {code}")


if __name__ == "__main__":
    for each in PROTOS:
        generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT, each)
