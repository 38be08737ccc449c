"""Checkpoint transfer: chunked, checksummed, resumable; in-process and over the mTLS peer service."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from singularityd.checkpoint import ImageStore
from singularityd.federation.peer import PeerChannels, PeerServer, PeerService, Refused
from singularityd.federation.transfer import (
    JOURNAL,
    Destination,
    Entry,
    MiB,
    Progress,
    Source,
    TransferError,
    adopt_digests,
    copy_locally,
    digest,
    missing,
    scan,
)
from singularityd.federation.transfer_grpc import Receivers, Sending, entries_to_pb, held_from_pb
from singularityd.federation.v1 import peer_pb2 as pb
from tests.federation.conftest import Lab
from tests.helpers import invert_bytes


def make_checkpoint(root: Path, sizes: dict[str, int]) -> Path:
    """A directory shaped like a checkpoint: images, device state, a link, an empty file."""
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        path.chmod(0o600)
    (root / "images" / "parent").symlink_to("../pre-1")
    (root / "pre-1").mkdir(exist_ok=True)
    (root / "pre-1" / "pages-1.img").write_bytes(b"p" * 1000)
    (root / "empty.log").write_bytes(b"")
    return root


def same_tree(a: Path, b: Path) -> None:
    """Assert two directories hold the same entries with the same bytes and modes."""
    assert scan(a) == scan(b)
    for entry in scan(a):
        if not entry.link:
            assert (a / entry.path).read_bytes() == (b / entry.path).read_bytes(), entry.path


SIZES = {"images/pages-1.img": 5 * MiB + 17, "images/core-1.img": 3000, "proxy/dev-0.state": 2 * MiB}


def test_a_directory_arrives_byte_identical(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", SIZES)
    source = Source(src, MiB)
    assert [e.path for e in source.entries if e.link] == ["images/parent"]
    assert source.total == sum(SIZES.values()) + 1000
    reports: list[Progress] = []
    dest = Destination(tmp_path / "dst", source.entries, MiB)
    assert copy_locally(source, dest, reports.append) == []
    same_tree(src, tmp_path / "dst")
    assert not (tmp_path / "dst" / JOURNAL).exists()
    assert reports[-1].moved == reports[-1].total == source.total


def test_an_interrupted_transfer_resumes_without_resending_what_arrived(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", SIZES)
    source = Source(src, MiB)
    first = Destination(tmp_path / "dst", source.entries, MiB)
    keys = list(source.chunks)
    for key in keys[:4]:
        first.put(key, *source.read(key))
    first.close()  # the link broke; the receiver restarts
    again = Destination(tmp_path / "dst", source.entries, MiB)
    assert set(again.held) == set(keys[:4])
    reports: list[Progress] = []
    assert copy_locally(Source(src, MiB), again, reports.append) == []
    resent = reports[-1].sent
    assert resent == source.total - sum(source.chunks[k][1] for k in keys[:4])
    same_tree(src, tmp_path / "dst")


def test_a_pre_copied_prefix_of_append_only_files_is_not_sent_again(tmp_path: Path) -> None:
    """A move sends the device state pre-copied while the job runs, then, under the same transfer,
    the whole checkpoint: the receiver keeps the chunks of the prefix, the sender neither reads
    nor hashes them again, and only the rest crosses."""
    state = "proxy/dev-0.state"
    early = tmp_path / "early"
    (early / "proxy").mkdir(parents=True)
    (early / state).write_bytes(os.urandom(3 * MiB + 100))
    (early / state).chmod(0o600)
    pre = Source(early, MiB)
    seeded = Destination(tmp_path / "dst", pre.entries, MiB)
    for key in pre.chunks:
        seeded.put(key, *pre.read(key))
    seeded.close()  # never finished: the job is stopped and the rest is added
    full = make_checkpoint(tmp_path / "full", {"images/pages-1.img": 2 * MiB})
    (full / "proxy").mkdir()
    (full / state).write_bytes((early / state).read_bytes() + os.urandom(2 * MiB))
    (full / state).chmod(0o600)
    source = Source(full, MiB)
    assert adopt_digests(source, pre) == 3 * MiB  # the last, partial chunk of the prefix changes
    final = Destination(tmp_path / "dst", source.entries, MiB)
    assert sum(final.chunks[key][1] for key in final.held) == 3 * MiB
    reports: list[Progress] = []
    assert copy_locally(source, final, reports.append) == []
    assert reports[-1].sent == source.total - 3 * MiB
    same_tree(full, tmp_path / "dst")


def sha256_of(path: Path) -> str:
    """The sha256 (hex) of a file, read now."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_receiver_hashes_each_file_as_written_across_the_pre_copy_and_out_of_order(
    tmp_path: Path,
) -> None:
    """The pre-copy's running hashes carry over to the transfer after the stop; chunks that come
    out of order are hashed once their turn comes; nothing is read back from disk."""
    state = "proxy/dev-0.state"
    early = tmp_path / "early"
    (early / "proxy").mkdir(parents=True)
    (early / state).write_bytes(os.urandom(3 * MiB + 100))
    pre = Source(early, MiB)
    seeded = Destination(tmp_path / "dst", pre.entries, MiB)
    for key in reversed(list(pre.chunks)):  # all out of order
        seeded.put(key, *pre.read(key))
    seeded.close()
    full = make_checkpoint(tmp_path / "full", {"images/pages-1.img": 5 * MiB + 3})
    (full / "proxy").mkdir()
    (full / state).write_bytes((early / state).read_bytes() + os.urandom(2 * MiB))
    source = Source(full, MiB)
    final = Destination(tmp_path / "dst", source.entries, MiB, seeded.hashes)
    todo = missing(source, final.held)
    for first, second in zip(todo[::2], todo[1::2], strict=False):  # pairs swapped
        final.put(second, *source.read(second))
        final.put(first, *source.read(first))
    if len(todo) % 2:
        final.put(todo[-1], *source.read(todo[-1]))
    assert final.finish(source.manifest()) == []
    files = [e.path for e in source.entries if not e.link]
    assert final.file_digests == {path: sha256_of(full / path) for path in files}
    assert final.reread_bytes == 0


def test_bytes_changed_under_the_hash_or_arriving_from_another_daemon_are_read_back(tmp_path: Path) -> None:
    """What the running hash cannot vouch for (a pre-copied chunk written again with other bytes,
    chunks a restarted receiver holds from before) is hashed from disk: the digests stay right."""
    src = make_checkpoint(tmp_path / "src", {"images/pages-1.img": 3 * MiB, "proxy/dev-0.state": 2 * MiB})
    source = Source(src, MiB)
    first = Destination(tmp_path / "dst", source.entries, MiB)
    for key in source.chunks:
        first.put(key, *source.read(key))
    first.close()
    with open(src / "images" / "pages-1.img", "r+b") as handle:  # not append-only after all
        handle.write(b"changed")
    changed = Source(src, MiB)
    again = Destination(tmp_path / "dst", changed.entries, MiB, first.hashes)
    for key in missing(changed, again.held):
        again.put(key, *changed.read(key))
    assert again.finish(changed.manifest()) == []
    assert again.file_digests["images/pages-1.img"] == sha256_of(src / "images" / "pages-1.img")
    assert again.reread_bytes == 3 * MiB
    restarted = Destination(tmp_path / "dst2", changed.entries, MiB)
    keys = list(changed.chunks)
    for key in keys[:2]:
        restarted.put(key, *changed.read(key))
    restarted.close()  # the daemon restarts: its running hashes are gone
    resumed = Destination(tmp_path / "dst2", changed.entries, MiB)
    assert copy_locally(changed, resumed) == []
    files = [e.path for e in changed.entries if not e.link]
    assert resumed.file_digests == {path: sha256_of(src / path) for path in files}
    assert 0 < resumed.reread_bytes < changed.total


def test_a_damaged_chunk_is_refused_and_a_wrong_manifest_fails_the_transfer(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", SIZES)
    source = Source(src, MiB)
    dest = Destination(tmp_path / "dst", source.entries, MiB)
    key = next(iter(source.chunks))
    chunk_digest, data = source.read(key)
    with pytest.raises(TransferError, match="fails its checksum"):
        dest.put(key, chunk_digest, b"x" + data[1:])
    with pytest.raises(TransferError, match="bytes, expected"):
        dest.put(key, chunk_digest, data[:-1])
    assert key not in dest.held
    for k in source.chunks:
        dest.put(k, *source.read(k))
    manifest = source.manifest()
    manifest[key] = digest(b"something else")
    assert dest.finish(manifest) == [f"chunk 0 of {source.entries[key[0]].path} is different"]


def test_reread_catches_a_file_damaged_on_disk_after_arrival(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", {"images/pages-1.img": 3 * MiB})
    source = Source(src, MiB)
    dest = Destination(tmp_path / "dst", source.entries, MiB)
    for k in source.chunks:
        dest.put(k, *source.read(k))
    invert_bytes(tmp_path / "dst" / "images" / "pages-1.img", MiB + 5)
    assert dest.finish(source.manifest(), reread=True) == ["chunk 1 of images/pages-1.img differs on disk"]


def test_entries_that_would_escape_the_directory_are_refused(tmp_path: Path) -> None:
    for bad, why in [
        (Entry("../x", 1, 0o600), "unsafe path"),
        (Entry("/etc/x", 1, 0o600), "unsafe path"),
        (Entry("a/link", 0, 0o777, "../../etc"), "leaves the transfer"),
        (Entry("link", 0, 0o777, "/etc/passwd"), "leaves the transfer"),
        (Entry(JOURNAL, 1, 0o600), "unsafe path"),
    ]:
        with pytest.raises(TransferError, match=why):
            Destination(tmp_path / "dst", [bad], MiB)
    with pytest.raises(TransferError, match="outside"):
        Source(tmp_path, 8 * MiB)


# Over the peer service (mutual TLS on loopback).


async def test_a_transfer_over_the_peer_service_resumes_after_the_receiver_restarts(
    lab: Lab, tmp_path: Path
) -> None:
    src = make_checkpoint(tmp_path / "src", {"images/pages-1.img": 24 * MiB, "proxy/dev-0.state": 3 * MiB})
    incoming = tmp_path / "incoming"

    def authorize(node: str, job_id: str, epoch: int) -> Path:
        if (node, job_id, epoch) != ("node-a", "job-7", 3):
            raise Refused(f"not expecting job {job_id} epoch {epoch} from {node}")
        return incoming / f"{job_id}@{epoch}"

    b = lab.identity("node-b")
    server = PeerServer(b, "127.0.0.1:0", PeerService(transfers=Receivers(authorize)))
    port = await server.start()
    cut = asyncio.Event()
    reports: list[Progress] = []

    def progress(p: Progress) -> None:
        reports.append(p)
        if p.phase == "sending" and p.moved > 10 * MiB:
            cut.set()

    async def restart_receiver() -> None:
        """Kill the receiver's server mid-stream; a new one (fresh handler state) takes its port."""
        nonlocal server
        await cut.wait()
        await server.stop(0)
        server = PeerServer(b, f"127.0.0.1:{port}", PeerService(transfers=Receivers(authorize)))
        await server.start()

    channels = PeerChannels(lab.identity("node-a"))
    source = Source(src, MiB)
    sending = Sending(channels.stub("node-b", f"127.0.0.1:{port}"), source, "job-7@3", "job-7", 3, progress)
    try:
        await asyncio.wait_for(asyncio.gather(sending.run(pause_s=0.2), restart_receiver()), timeout=120)
        same_tree(src, incoming / "job-7@3")
        comparing = [i for i, p in enumerate(reports) if p.phase == "comparing"]
        assert len(comparing) == 2  # one interruption, one resume
        sent_before_cut = reports[comparing[1]].sent
        held_at_resume = reports[comparing[1] + 1].moved
        assert 0 < held_at_resume < source.total
        # The second attempt sent exactly what the receiver did not hold.
        assert sending.sent - sent_before_cut == source.total - held_at_resume
        assert reports[-1] == Progress("done", source.total, source.total, sending.sent)
        wrong = Sending(channels.stub("node-b", f"127.0.0.1:{port}"), Source(src, MiB), "job-7@4", "job-7", 4)
        with pytest.raises(TransferError, match="not expecting job job-7 epoch 4"):
            await wrong.run()
    finally:
        await channels.close()
        await server.stop(0)


async def test_receivers_keep_a_reopened_transfer_and_refuse_chunks_once_cancelled(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", {"images/pages-1.img": 4 * MiB})
    source = Source(src, MiB)
    receivers = Receivers(lambda node, job, epoch: tmp_path / "in" / f"{job}@{epoch}")
    request = pb.BeginTransferRequest(
        transfer_id="j@2", job_id="j", epoch=2, chunk_size=MiB, files=entries_to_pb(source.entries)
    )
    keys = list(source.chunks)

    async def chunks(some: list[tuple[int, int]]) -> AsyncIterator[pb.Chunk]:
        for key in some:
            chunk_digest, data = source.read(key)
            yield pb.Chunk(transfer_id="j@2", file=key[0], index=key[1], sha256=chunk_digest, data=data)

    await receivers.begin("node-a", request)
    opened = receivers.open["j@2"]
    state = await receivers.receive("node-a", chunks(keys[:2]))
    assert state.bytes_held == 2 * MiB
    assert (await receivers.begin("node-a", request)).bytes_held == 2 * MiB and receivers.open[
        "j@2"
    ] is opened
    with pytest.raises(Refused, match="no open transfer"):
        await receivers.receive("node-c", chunks(keys[2:]))
    receivers.cancel("j", 2)
    with pytest.raises(Refused, match="no open transfer"):
        await receivers.receive("node-a", chunks(keys[2:]))
    with pytest.raises(TransferError, match="closed"):
        opened.destination.write(keys[3], *source.read(keys[3]))


async def test_receivers_keep_running_hashes_from_the_pre_copy_to_the_finished_transfer(
    tmp_path: Path,
) -> None:
    """The pre-copy's transfer and the one after the stop (same id, more files) hash each file as
    it is written; the finished transfer's digests are handed over once, and dropped on cancel."""
    state = "proxy/dev-0.state"
    early = tmp_path / "early"
    (early / "proxy").mkdir(parents=True)
    (early / state).write_bytes(os.urandom(2 * MiB + 5))
    full = make_checkpoint(tmp_path / "full", {"images/pages-1.img": 3 * MiB})
    (full / "proxy").mkdir()
    (full / state).write_bytes((early / state).read_bytes() + os.urandom(MiB))
    receivers = Receivers(lambda node, job, epoch: tmp_path / "in" / f"{job}@{epoch}")

    async def send(source: Source) -> None:
        request = pb.BeginTransferRequest(
            transfer_id="j@2", job_id="j", epoch=2, chunk_size=MiB, files=entries_to_pb(source.entries)
        )
        held = held_from_pb(await receivers.begin("node-a", request))

        async def chunks() -> AsyncIterator[pb.Chunk]:
            for key in missing(source, held):
                chunk_digest, data = source.read(key)
                yield pb.Chunk(transfer_id="j@2", file=key[0], index=key[1], sha256=chunk_digest, data=data)

        await receivers.receive("node-a", chunks())

    await send(Source(early, MiB))
    source = Source(full, MiB)
    await send(source)
    manifest = [pb.ChunkRef(file=f, index=i, sha256=d) for (f, i), d in source.manifest().items()]
    verdict = await receivers.finish("node-a", pb.FinishTransferRequest(transfer_id="j@2", manifest=manifest))
    assert verdict.ok, verdict.problems
    files = [e.path for e in source.entries if not e.link]
    assert receivers.take_digests("j", 2) == {path: sha256_of(full / path) for path in files}
    assert receivers.take_digests("j", 2) == {}
    receivers.digests[("j", 3)] = {"x": "y"}
    receivers.cancel("j", 3)
    assert receivers.digests == {}


def test_a_received_file_unlike_its_manifest_fails_the_restore_check_without_being_read(
    tmp_path: Path,
) -> None:
    """The digests the receiver took as the files were written are what the restore compares
    with the checkpoint's manifest: a file whose bytes differ from those the manifest describes
    (each chunk intact on the link) fails the check; intact, nothing is read again."""
    source_store, target_store = ImageStore(tmp_path / "a"), ImageStore(tmp_path / "b")
    pending = source_store.begin("5", owner_uid=os.getuid(), owner_gid=os.getgid())
    (pending.path / "images" / "pages-1.img").write_bytes(os.urandom(3 * MiB + 9))
    (pending.path / "images" / "core-1.img").write_bytes(b"core")
    source_store.finish(pending, leave_running=False, criu_version="4.2")
    for damaged in (False, True):
        staging = tmp_path / f"staging-{damaged}" / "checkpoint" / str(pending.seq)
        shutil.copytree(pending.path, staging)
        if damaged:
            invert_bytes(staging / "images" / "pages-1.img", 2 * MiB + 1)
        source = Source(staging.parents[1], MiB)
        incoming = tmp_path / f"incoming-{damaged}"
        destination = Destination(incoming, source.entries, MiB)
        assert copy_locally(source, destination) == []
        prefix = f"checkpoint/{pending.seq}/"
        known = {p.removeprefix(prefix): d for p, d in destination.file_digests.items()}
        target_store.job_dir("5").mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target_store.checkpoint_dir("5", pending.seq), ignore_errors=True)
        os.replace(incoming / prefix, target_store.checkpoint_dir("5", pending.seq))
        if damaged:  # the check goes by what was received: mending the disk now does not help
            original = (pending.path / "images" / "pages-1.img").read_bytes()
            (target_store.checkpoint_dir("5", pending.seq) / "images" / "pages-1.img").write_bytes(original)
        verdict = target_store.verify("5", pending.seq, known=known)
        if damaged:
            assert not verdict.ok and verdict.reason == "images/pages-1.img fails its sha256 check"
            assert target_store.verify("5", pending.seq).ok
        else:
            assert verdict.ok and verdict.hashed_bytes == 0, verdict


async def test_a_sender_gives_up_on_a_receiver_silent_longer_than_its_patience(
    lab: Lab, tmp_path: Path
) -> None:
    """Nothing listens where the receiver was: with patience, the sender stops retrying after it
    (a move then lets its job run at home again instead of waiting out every attempt)."""
    src = make_checkpoint(tmp_path / "src", {"images/pages-1.img": MiB})
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    channels = PeerChannels(lab.identity("node-a"))
    sending = Sending(channels.stub("node-b", f"127.0.0.1:{port}"), Source(src, MiB), "job-7@3", "job-7", 3)
    began = time.monotonic()
    try:
        with pytest.raises(TransferError, match=r"the receiver has not answered for 1s \(UNAVAILABLE"):
            await sending.run(attempts=1000, pause_s=0.1, patience_s=1.0)
    finally:
        await channels.close()
    assert time.monotonic() - began < 10
