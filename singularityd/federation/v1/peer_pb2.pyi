from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandoffStep(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_STEP_UNSPECIFIED: _ClassVar[HandoffStep]
    PREPARE: _ClassVar[HandoffStep]
    RESTORE: _ClassVar[HandoffStep]
    COMMIT: _ClassVar[HandoffStep]
    ABORT: _ClassVar[HandoffStep]
HANDOFF_STEP_UNSPECIFIED: HandoffStep
PREPARE: HandoffStep
RESTORE: HandoffStep
COMMIT: HandoffStep
ABORT: HandoffStep

class JoinRequest(_message.Message):
    __slots__ = ("token", "csr_pem")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    token: str
    csr_pem: bytes
    def __init__(self, token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("certificate_pem", "ca_pem", "peer_address")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    ca_pem: bytes
    peer_address: str
    def __init__(self, certificate_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ..., peer_address: _Optional[str] = ...) -> None: ...

class ListPeerJobsRequest(_message.Message):
    __slots__ = ("all",)
    ALL_FIELD_NUMBER: _ClassVar[int]
    all: bool
    def __init__(self, all: _Optional[bool] = ...) -> None: ...

class PeerJob(_message.Message):
    __slots__ = ("id", "name", "user", "uid", "state", "reason", "pending_reason", "priority", "gpus", "ranks", "devices", "command", "submitted_at", "started_at", "ended_at", "exit_code", "signal", "cwd", "attempt", "tier")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PENDING_REASON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    user: str
    uid: int
    state: str
    reason: str
    pending_reason: str
    priority: int
    gpus: int
    ranks: int
    devices: _containers.RepeatedScalarFieldContainer[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    submitted_at: float
    started_at: float
    ended_at: float
    exit_code: int
    signal: int
    cwd: str
    attempt: int
    tier: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., user: _Optional[str] = ..., uid: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., pending_reason: _Optional[str] = ..., priority: _Optional[int] = ..., gpus: _Optional[int] = ..., ranks: _Optional[int] = ..., devices: _Optional[_Iterable[int]] = ..., command: _Optional[_Iterable[str]] = ..., submitted_at: _Optional[float] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., cwd: _Optional[str] = ..., attempt: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class ListPeerJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[PeerJob]
    def __init__(self, jobs: _Optional[_Iterable[_Union[PeerJob, _Mapping]]] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "kind", "name", "memory_total", "free")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: str
    name: str
    memory_total: int
    free: bool
    def __init__(self, index: _Optional[int] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., memory_total: _Optional[int] = ..., free: _Optional[bool] = ...) -> None: ...

class PeerAddress(_message.Message):
    __slots__ = ("node", "address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "address", "version", "devices", "free_devices", "draining", "running_jobs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    FREE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    version: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    free_devices: int
    draining: bool
    running_jobs: int
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., free_devices: _Optional[int] = ..., draining: _Optional[bool] = ..., running_jobs: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("sender", "known")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    sender: NodeStatus
    known: _containers.RepeatedCompositeFieldContainer[PeerAddress]
    def __init__(self, sender: _Optional[_Union[NodeStatus, _Mapping]] = ..., known: _Optional[_Iterable[_Union[PeerAddress, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("status", "known")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    status: NodeStatus
    known: _containers.RepeatedCompositeFieldContainer[PeerAddress]
    def __init__(self, status: _Optional[_Union[NodeStatus, _Mapping]] = ..., known: _Optional[_Iterable[_Union[PeerAddress, _Mapping]]] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "step", "spec_json", "hold_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    step: HandoffStep
    spec_json: bytes
    hold_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[_Union[HandoffStep, str]] = ..., spec_json: _Optional[bytes] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class HandoffReply(_message.Message):
    __slots__ = ("ok", "reason", "discarded", "epoch")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    discarded: bool
    epoch: int
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., discarded: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("path", "size", "mode", "link")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    mode: int
    link: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., link: _Optional[str] = ...) -> None: ...

class BeginTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "job_id", "epoch", "chunk_size", "files")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    job_id: str
    epoch: int
    chunk_size: int
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    def __init__(self, transfer_id: _Optional[str] = ..., job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., chunk_size: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ...) -> None: ...

class ChunkRef(_message.Message):
    __slots__ = ("file", "index", "sha256")
    FILE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    file: int
    index: int
    sha256: bytes
    def __init__(self, file: _Optional[int] = ..., index: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class TransferState(_message.Message):
    __slots__ = ("have", "bytes_held")
    HAVE_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    have: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    bytes_held: int
    def __init__(self, have: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ..., bytes_held: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("transfer_id", "file", "index", "sha256", "data")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    file: int
    index: int
    sha256: bytes
    data: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., file: _Optional[int] = ..., index: _Optional[int] = ..., sha256: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class FinishTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "manifest", "reread")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    REREAD_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    manifest: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    reread: bool
    def __init__(self, transfer_id: _Optional[str] = ..., manifest: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ..., reread: _Optional[bool] = ...) -> None: ...

class TransferVerdict(_message.Message):
    __slots__ = ("ok", "problems")
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...
