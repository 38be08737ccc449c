"""Federation: peer daemons that know each other, and moving a job between them exactly once.

The parts, each usable on its own:

- `pki`: the lab CA, node keys and certificates, join tokens (files private to root).
- `join`: the join RPC that turns a token and a CSR into a node certificate.
- `tls`: mutual-TLS credentials, keepalive settings and the node-name check on both sides.
- `peer`: the peer gRPC server (mTLS, health checking) and client channels to named peers.
- `membership`: who the peers are and how they are doing (pure), `heartbeat` drives it.
- `handoff` (vocabulary in `handoff_messages`): the pure two-phase hand-off of a job's ownership,
  with epochs and fencing; `hosting` decides what a target can take; `driver` runs it all.
- `transfer`: resumable, checksummed streaming of a checkpoint directory to a peer
  (`transfer_grpc` carries it over the peer service).
"""

import os

# gRPC fork support is client-side only and hangs processes that fork; children here always exec.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
