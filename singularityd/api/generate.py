"""Regenerate the committed gRPC stubs from the .proto: `python -m singularityd.api.generate`."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("singularityd/api/v1/singularity.proto")


def generate(out_dir: Path) -> None:
    """Write singularity_pb2.py, .pyi and _pb2_grpc.py for the proto under out_dir."""
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / PROTO),
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with {code}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
