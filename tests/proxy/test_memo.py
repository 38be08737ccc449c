"""Squashing's memo (memo.py): how long a recorded operation is kept and what it keeps meanwhile.

Pure bookkeeping on sessions and a device's accounting in this process, nothing run: an entry
goes once every other session of its job used it, once every session passed a collective after
it, with its job, or as the oldest past the limit; a session that made two entries under one key
leaves both, taken oldest first; a storage a kept entry names stays on the device after its
producer lets it go, until no kept entry names it (but for one the last user is about to hold).
"""

from __future__ import annotations

import os

import pytest
import torch

from singularity.proxy.server import memo as memo_module
from singularity.proxy.server.device_memory import DeviceMemory
from singularity.proxy.server.memo import Entry, Key, Memo
from singularity.proxy.server.session import Session

OPERATOR = 7
"""The id the test's keys give their operator."""


def memo_of_sessions(
    ranks: int = 3, jobs: tuple[str, ...] = ("job",)
) -> tuple[Memo, DeviceMemory[Session], list[Session]]:
    memory: DeviceMemory[Session] = DeviceMemory(0, 1 << 30)
    sessions = [Session(job, rank, os.getuid(), memory) for job in jobs for rank in range(ranks)]
    return Memo(memory, lambda job: [s for s in sessions if s.job_id == job]), memory, sessions


def key(number: int) -> Key:
    """An exact key of the test's operator ((coarse key, value ids, sharing))."""
    return ((OPERATOR, number), (number,), (0,))


def entry(producer: Session, round_: int = 0, made: int | None = None) -> Entry:
    """An entry of the producer's that made a new storage `made` (else returned its input)."""
    output = ("alias", 0) if made is None else ("new", made, 1, (4,), (1,), 0, torch.float32)
    return Entry(producer.job_id, producer, round_, ((1, 1),), {}, output)


def used(memo: Memo, number: int, made: Entry, session: Session) -> None:
    """The session was squashed onto the entry (as Squash.reuse marks it), which may retire it."""
    made.consumed.add(session)
    made.used = True
    memo.retire(key(number), made, set())


def test_an_entry_goes_once_every_other_session_of_its_job_used_it() -> None:
    memo, _memory, (first, second, third) = memo_of_sessions()
    made = entry(first)
    memo.add(key(1), key(1)[0], made, keeps=False)
    assert memo.awaited(key(1), second) is made
    used(memo, 1, made, second)
    assert len(memo) == 1, "rank 2 has still to use it"
    used(memo, 1, made, third)
    assert len(memo) == 0 and memo.near == {} and memo.unused == {}


def test_two_entries_a_session_made_under_one_key_are_taken_oldest_first() -> None:
    memo, _memory, (first, second, third) = memo_of_sessions()
    older, newer = entry(first), entry(first)
    memo.add(key(1), key(1)[0], older, keeps=False)
    memo.add(key(1), key(1)[0], newer, keeps=False)
    assert memo.awaited(key(1), second) is older
    used(memo, 1, older, second)
    assert memo.awaited(key(1), second) is newer, "rank 1 used the older one"
    assert memo.awaited(key(1), third) is older
    used(memo, 1, older, third)
    assert memo.earlier == {} and memo.awaited(key(1), third) is newer


def test_an_entry_another_session_replaces_is_forgotten() -> None:
    memo, _memory, (first, second, _third) = memo_of_sessions()
    memo.add(key(1), key(1)[0], entry(first), keeps=False)
    replacing = entry(second)
    memo.add(key(1), key(1)[0], replacing, keeps=False)
    assert memo.earlier == {} and memo.awaited(key(1), first) is replacing
    assert memo.near == {key(1)[0]: [key(1)]}


def test_entries_made_before_a_collective_every_session_passed_go_with_their_job_only() -> None:
    memo, _memory, sessions = memo_of_sessions(2, ("a", "b"))
    a0, _a1, b0, _b1 = sessions
    memo.add(key(1), key(1)[0], entry(a0, round_=0), keeps=False)
    memo.add(key(2), key(2)[0], entry(a0, round_=1), keeps=False)
    memo.add(key(3), key(3)[0], entry(b0, round_=0), keeps=False)
    memo.drop_before("a", 1)
    assert list(memo.entries) == [key(2), key(3)]
    assert memo.unused == {OPERATOR: 1}, "dropped without another session using it"
    memo.drop_job("b")
    assert list(memo.entries) == [key(2)]


def test_the_oldest_entries_go_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memo_module, "MAX_ENTRIES", 2)
    memo, _memory, (first, _second, _third) = memo_of_sessions()
    for number in (1, 2, 3):
        memo.add(key(number), key(number)[0], entry(first), keeps=False)
    assert list(memo.entries) == [key(2), key(3)]
    assert key(1)[0] not in memo.near


def test_a_kept_entry_keeps_what_it_made_until_no_kept_entry_names_it() -> None:
    memo, memory, (first, second, third) = memo_of_sessions()
    made = torch.zeros(1024)
    storage = made.untyped_storage()
    first.add(5, made)
    recorded = entry(first, made=storage._cdata)
    memo.add(key(1), key(1)[0], recorded, keeps=True)
    first.free(5)
    assert storage._cdata in memory.kept, "its producer let it go before the others used it"
    recorded.consumed.add(second)
    memo.retire(key(1), recorded, {storage._cdata})
    assert storage._cdata in memory.kept
    recorded.consumed.add(third)
    memo.retire(key(1), recorded, {storage._cdata})
    assert len(memo) == 0 and memo.referenced == {}
    assert storage._cdata in memory.kept, "the last user is about to hold it: not let go here"

    other = torch.zeros(1024)
    second.add(6, other)
    memo.add(key(2), key(2)[0], entry(second, made=other.untyped_storage()._cdata), keeps=True)
    second.free(6)
    assert other.untyped_storage()._cdata in memory.kept
    memo.drop_job("job")
    assert other.untyped_storage()._cdata not in memory.kept


def test_value_ids_of_an_operation_are_the_same_while_its_entry_is_kept() -> None:
    memo, _memory, (first, _second, _third) = memo_of_sessions()
    made = memo.derive(key(1), 0)
    assert memo.derive(key(1), 0) == made and memo.derive(key(1), 1) != made
    memo.add(key(1), key(1)[0], entry(first, made=99), keeps=False)
    memo.drop_job("job")
    assert memo.derive(key(1), 0) != made, "its entry went: a later run is a new value"
