"""Checkpoint manifests and the decisions made from them, with no I/O.

A manifest lists every file of a checkpoint with its size and sha256; it is written last, so a
checkpoint without one is incomplete. Whether a checkpoint may be restored, which one is the
latest usable one, and which ones to prune are decided here from facts gathered by the store.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from singularityd.units import first_few

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
IMAGES_DIR = "images"

FileKind = Literal["file", "dir", "symlink", "other", "missing"]

_KIND_WORDS: dict[FileKind, str] = {
    "file": "a regular file",
    "dir": "a directory",
    "symlink": "a symbolic link",
    "other": "a special file (a device, socket or pipe)",
    "missing": "missing",
}


class ManifestError(ValueError):
    """A manifest that cannot be parsed or does not have the expected shape."""


@dataclass(frozen=True)
class FileRecord:
    """Size and sha256 of one file of a checkpoint, by path relative to the checkpoint."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds and how it was taken."""

    job_id: str
    seq: int
    created_at: float
    owner_uid: int
    leave_running: bool
    criu_version: str
    files: Mapping[str, FileRecord]
    links: Mapping[str, str] = field(default_factory=dict)
    images_dir: str = IMAGES_DIR
    pre_dumps: Sequence[str] = ()
    external_unix_inodes: Sequence[int] = ()
    rewind_sizes: Mapping[str, int] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    external_mounts: Mapping[str, str] | None = None

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of the checkpoint's files."""
        return sum(r.size for r in self.files.values())

    @property
    def pause_s(self) -> float:
        """How long the final dump froze the job, as CRIU measured it (0 when not recorded)."""
        dump = self.stats.get("dump", {})
        return float(dump.get("frozen_us", 0)) / 1e6 if isinstance(dump, dict) else 0.0

    def to_json(self) -> str:
        """Serialise to the on-disk form (stable key order, so equal manifests are equal bytes)."""
        body = {
            "format": FORMAT_VERSION,
            "job_id": self.job_id,
            "seq": self.seq,
            "created_at": self.created_at,
            "owner_uid": self.owner_uid,
            "leave_running": self.leave_running,
            "criu_version": self.criu_version,
            "images_dir": self.images_dir,
            "pre_dumps": list(self.pre_dumps),
            "external_unix_inodes": list(self.external_unix_inodes),
            "external_mounts": None if self.external_mounts is None else dict(self.external_mounts),
            "rewind_sizes": dict(self.rewind_sizes),
            "stats": dict(self.stats),
            "extra": dict(self.extra),
            "total_bytes": self.total_bytes,
            "links": dict(self.links),
            "files": {p: {"size": r.size, "sha256": r.sha256} for p, r in self.files.items()},
        }
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str) -> Manifest:
        """Parse a manifest; raise ManifestError with the reason when it is malformed."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"manifest is not valid JSON ({e.msg} at line {e.lineno})") from e
        if not isinstance(raw, dict):
            raise ManifestError("manifest is not a JSON object")
        if raw.get("format") != FORMAT_VERSION:
            raise ManifestError(f"unknown manifest format {raw.get('format')!r}")
        try:
            files = {
                str(p): FileRecord(size=int(r["size"]), sha256=str(r["sha256"]))
                for p, r in raw["files"].items()
            }
            return Manifest(
                job_id=str(raw["job_id"]),
                seq=int(raw["seq"]),
                created_at=float(raw["created_at"]),
                owner_uid=int(raw["owner_uid"]),
                leave_running=bool(raw["leave_running"]),
                criu_version=str(raw["criu_version"]),
                files=files,
                links={str(k): str(v) for k, v in raw.get("links", {}).items()},
                images_dir=str(raw.get("images_dir", IMAGES_DIR)),
                pre_dumps=tuple(str(p) for p in raw.get("pre_dumps", ())),
                external_unix_inodes=tuple(int(i) for i in raw.get("external_unix_inodes", ())),
                external_mounts=_external_mounts(raw.get("external_mounts")),
                rewind_sizes={str(k): int(v) for k, v in raw.get("rewind_sizes", {}).items()},
                stats=dict(raw.get("stats", {})),
                extra=dict(raw.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"manifest is missing or has a bad field: {e}") from e


def _external_mounts(raw: Any) -> dict[str, str] | None:
    """The manifest's external mounts (name -> mount point), or None for a job without its own."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ManifestError("external_mounts is not an object")
    return {str(name): str(point) for name, point in raw.items()}


@dataclass(frozen=True)
class FileFact:
    """What lstat says about one path of a checkpoint (gathered by the store)."""

    kind: FileKind
    uid: int = 0
    size: int = 0
    link_target: str | None = None


def path_is_safe(rel: str) -> bool:
    """Whether a manifest path stays inside the checkpoint (relative, no `..`, no empty parts)."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def structural_problems(
    manifest: Manifest,
    facts: Mapping[str, FileFact],
    *,
    expected_job: str,
    expected_seq: int,
    trusted_uid: int,
) -> list[str]:
    """Problems visible without reading file contents: identity, types, owners, sizes, links.

    `facts` holds an entry for every path named in the manifest (files and links) and for the
    directories that contain them. Files must be regular files owned by `trusted_uid` (the daemon),
    so that the job's user, who owns the checkpoint directory, cannot substitute images.
    """
    problems: list[str] = []
    if manifest.job_id != expected_job or manifest.seq != expected_seq:
        problems.append(
            f"manifest is for job {manifest.job_id} checkpoint {manifest.seq}, "
            f"found in job {expected_job} checkpoint {expected_seq}"
        )
    if not manifest.files:
        problems.append("manifest lists no files")
    if not any(p.startswith(manifest.images_dir + "/") for p in manifest.files):
        problems.append(f"manifest lists no files in {manifest.images_dir}/")
    for rel, rec in sorted(manifest.files.items()):
        if not path_is_safe(rel):
            problems.append(f"unsafe path {rel!r} in manifest")
            continue
        fact = facts.get(rel, FileFact("missing"))
        if fact.kind == "missing":
            problems.append(f"{rel} is missing")
        elif fact.kind != "file":
            problems.append(f"{rel} is {_KIND_WORDS[fact.kind]}, not a regular file")
        elif fact.uid != trusted_uid:
            problems.append(f"{rel} is owned by uid {fact.uid}, not {trusted_uid}")
        elif fact.size != rec.size:
            problems.append(f"{rel} has {fact.size} bytes, manifest says {rec.size}")
    for rel, target in sorted(manifest.links.items()):
        fact = facts.get(rel, FileFact("missing"))
        if not path_is_safe(rel):
            problems.append(f"unsafe path {rel!r} in manifest")
        elif fact.kind != "symlink" or fact.link_target != target:
            problems.append(f"{rel} is not the link to {target} that the manifest names")
    for rel, fact in sorted(facts.items()):
        if fact.kind == "dir" and fact.uid != trusted_uid:
            problems.append(f"directory {rel} is owned by uid {fact.uid}, not {trusted_uid}")
    return problems


def digest_problems(
    manifest: Manifest, digests: Mapping[str, str], files: Collection[str] | None = None
) -> list[str]:
    """Files whose sha256 differs from the manifest's (each named once, in path order), among
    `files` when given (else all the manifest names)."""
    return [
        f"{rel} fails its sha256 check"
        for rel, rec in sorted(manifest.files.items())
        if (files is None or rel in files) and digests.get(rel) != rec.sha256
    ]


@dataclass(frozen=True)
class Verdict:
    """Whether one checkpoint may be restored, and if not, why."""

    seq: int
    ok: bool
    reason: str = ""
    hashed_bytes: int = 0
    """Bytes read from disk and hashed to reach it."""

    @staticmethod
    def good(seq: int, hashed_bytes: int = 0) -> Verdict:
        """A checkpoint that passed verification (after reading and hashing `hashed_bytes`)."""
        return Verdict(seq, True, hashed_bytes=hashed_bytes)

    @staticmethod
    def bad(seq: int, problems: Sequence[str]) -> Verdict:
        """A checkpoint that failed, with its problems joined into one line."""
        return Verdict(seq, False, first_few(problems))


@dataclass(frozen=True)
class Skipped:
    """A checkpoint newer than the one chosen, and why it was not used."""

    seq: int
    reason: str


@dataclass(frozen=True)
class Choice:
    """The newest usable checkpoint (None when there is none) and the newer ones passed over."""

    seq: int | None
    skipped: tuple[Skipped, ...]


def choose_latest(verdicts: Sequence[Verdict]) -> Choice:
    """Pick the newest good checkpoint; every newer bad one is reported with its reason."""
    skipped: list[Skipped] = []
    for v in sorted(verdicts, key=lambda v: v.seq, reverse=True):
        if v.ok:
            return Choice(v.seq, tuple(skipped))
        skipped.append(Skipped(v.seq, v.reason))
    return Choice(None, tuple(skipped))


def plan_prune(verdicts: Sequence[Verdict], keep: int) -> list[int]:
    """Sequence numbers to delete: good ones beyond the newest `keep`, and every bad one.

    Nothing is deleted while no checkpoint is good (the bad ones stay as evidence), and the newest
    good checkpoint is never deleted whatever `keep` says.
    """
    good = sorted((v.seq for v in verdicts if v.ok), reverse=True)
    if not good:
        return []
    kept = set(good[: max(keep, 1)])
    return sorted(v.seq for v in verdicts if v.seq not in kept)


def next_seq(existing: Sequence[int]) -> int:
    """The sequence number of a job's next checkpoint: one more than the highest present."""
    return max(existing, default=0) + 1


def seq_dir_name(seq: int) -> str:
    """Directory name of checkpoint `seq` (zero-padded so names sort like numbers)."""
    return f"{seq:08d}"


def parse_seq_dir_name(name: str) -> int | None:
    """The sequence number a directory name stands for, or None for any other name."""
    if len(name) == 8 and name.isdigit():
        return int(name)
    return None
