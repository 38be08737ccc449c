"""`sing` verbs of a lab cluster: cluster init/token/join, peers, migrate, drain and undrain.

The daemon does all the work (making the CA, joining, moving jobs); these commands only ask it
and show the answer. `register(app)` adds them to the `sing` application.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import typer

from singularity.cli import output
from singularity.cli.client import connect
from singularity.cli.errors import EXIT_CONFLICT, EXIT_OK, CliError, warn
from singularity.cli.params import JobIdArgument, SocketOption, not_empty
from singularityd.api.v1 import singularity_pb2 as pb
from singularityd.units import human_bytes

BAR_WIDTH = 30
NodeNameOption = typer.Option(
    None, "--name", help="This node's name (default: node_name, else the host name).", callback=not_empty
)

cluster_app = typer.Typer(
    name="cluster",
    help="Make a lab cluster of peer daemons, or join one.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def _join_text(info: pb.ClusterJoinInfo) -> str:
    """What `cluster init` and `cluster token` print: the command another machine runs to join."""
    expires = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.token_expires_at))
    return (
        f"node {info.node_name} (number {info.node_number}); join token valid until {expires}\n"
        "on each machine to join, as root:\n"
        f"  sing cluster join {info.join_address} --token {info.token} --ca-hash {info.ca_fingerprint}"
    )


@cluster_app.command("init")
def cluster_init(
    name: str | None = NodeNameOption,
    cluster: str = typer.Option(
        "lab", "--cluster", help="The lab's name (in its CA certificate).", callback=not_empty
    ),
    socket: str = SocketOption,
) -> None:
    """Make the lab's CA on this machine and certify it; prints how other machines join."""
    with connect(socket) as stub:
        info = stub.ClusterInit(pb.ClusterInitRequest(node_name=name or "", cluster_name=cluster))
    print(_join_text(info))


@cluster_app.command("token")
def cluster_token(socket: str = SocketOption) -> None:
    """A fresh join token (on the machine that made the lab's CA)."""
    with connect(socket) as stub:
        info = stub.ClusterToken(pb.ClusterTokenRequest())
    print(_join_text(info))


@cluster_app.command("join")
def cluster_join(
    address: str = typer.Argument(..., help="The CA node's join service, host:port.", callback=not_empty),
    token: str = typer.Option(
        ..., "--token", help="A join token from `sing cluster init` or `token`.", callback=not_empty
    ),
    ca_hash: str = typer.Option(
        ..., "--ca-hash", help="The lab CA's fingerprint (sha256:...).", callback=not_empty
    ),
    name: str | None = NodeNameOption,
    socket: str = SocketOption,
) -> None:
    """Join a lab: the daemon checks the CA's fingerprint, then gets this node's certificate."""
    request = pb.ClusterJoinRequest(
        address=address, token=token, ca_fingerprint=ca_hash, node_name=name or ""
    )
    with connect(socket) as stub:
        reply = stub.ClusterJoin(request)
    print(f"joined as {reply.node_name} (number {reply.node_number}); first peer: {reply.ca_node or '-'}")


def peers_table(response: pb.ListPeersResponse, header: bool) -> str:
    """The `sing peers` table."""
    now = time.time()
    rows = [
        [
            p.node, p.address, p.state + (",draining" if p.draining else ""), str(p.devices), str(p.free),
            p.version or "-", output.ago(p.last_contact, now), p.error or "",
        ]
        for p in response.peers
    ]  # fmt: skip
    names = ("NODE", "ADDRESS", "STATE", "DEVICES", "FREE", "VERSION", "LAST-CONTACT", "ERROR")
    return output.table(rows, names if header else None)


def peers(
    output_format: str = typer.Option("table", "--output", "-o", help="table or json."),
    header: bool = typer.Option(True, "--header/--no-header", help="Print or omit the header line."),
    socket: str = SocketOption,
) -> None:
    """List this node's peers: state, devices, free capacity, version, last contact."""
    with connect(socket) as stub:
        response = stub.ListPeers(pb.ListPeersRequest())
    if not response.node:
        raise CliError(
            "this node is in no lab cluster: run `sing cluster init` or `sing cluster join`", EXIT_CONFLICT
        )
    if output_format == "json":
        peers_data = [
            {
                "node": p.node, "address": p.address, "state": p.state, "devices": p.devices,
                "free": p.free, "version": p.version, "last_contact": p.last_contact or None,
                "draining": p.draining, "error": p.error or None,
            }
            for p in response.peers
        ]  # fmt: skip
        data = {"node": response.node, "node_number": response.node_number}
        print(output.to_json({**data, "draining": response.draining, "peers": peers_data}))
        return
    text = peers_table(response, header)
    if text:
        print(text)


class MoveBar:
    """A move's progress drawn in place on stderr when it is a terminal (nothing otherwise)."""

    def __init__(self) -> None:
        self.active = sys.stderr.isatty()

    def draw(self, message: pb.MoveProgress) -> None:
        """Redraw the bar for one progress message."""
        if not self.active:
            return
        fraction = message.moved / message.total if message.total else 0.0
        filled = int(BAR_WIDTH * fraction) if message.phase in ("sending", "restoring", "committing") else 0
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        size = f" {human_bytes(message.moved)}/{human_bytes(message.total)}" if message.total else ""
        sys.stderr.write(f"\r\033[Kjob {message.id} [{bar}]{size} {message.phase} to {message.peer}")
        sys.stderr.flush()

    def clear(self) -> None:
        """Erase the bar."""
        if self.active:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _follow(messages: Iterable[pb.MoveProgress]) -> list[pb.MoveProgress]:
    """Draw each move's progress; return the last message of each move."""
    bar = MoveBar()
    ended: list[pb.MoveProgress] = []
    try:
        for message in messages:
            if message.done:
                bar.clear()
                ended.append(message)
            else:
                bar.draw(message)
    finally:
        bar.clear()
    return ended


def migrate(
    job_id: int = JobIdArgument,
    to: str = typer.Option(
        ..., "--to", help="The peer's node name (sing peers lists them).", callback=not_empty
    ),
    socket: str = SocketOption,
) -> None:
    """Move a running job to a peer; it resumes there exactly where it stopped."""
    with connect(socket) as stub:
        ended = _follow(stub.Migrate(pb.MigrateRequest(id=job_id, to=to)))
    for message in ended:
        print(f"job {message.id} moved to {message.peer}")


def drain(socket: str = SocketOption) -> None:
    """Refuse new jobs here and move every job to a peer with room."""
    status = EXIT_OK
    with connect(socket) as stub:
        ended = _follow(stub.Drain(pb.DrainRequest()))
    for message in ended:
        if message.ok:
            print(f"job {message.id} moved to {message.peer}")
        else:
            where = f" to {message.peer}" if message.peer else ""
            warn(f"job {message.id} did not move{where}: {message.detail}")
            status = EXIT_CONFLICT
    raise SystemExit(status)


def undrain(socket: str = SocketOption) -> None:
    """Take jobs again after a drain."""
    with connect(socket) as stub:
        stub.Undrain(pb.DrainRequest())
    print("taking jobs again")


def register(app: Any) -> None:
    """Add the cluster verbs to the `sing` application."""
    app.add_typer(cluster_app)
    app.command()(peers)
    app.command()(migrate)
    app.command()(drain)
    app.command()(undrain)
