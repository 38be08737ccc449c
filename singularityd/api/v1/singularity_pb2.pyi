from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("command", "cwd", "env", "gpus", "name", "priority", "ranks")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    COMMAND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    name: str
    gpus: int
    priority: int
    ranks: int
    cwd: str
    env: _containers.ScalarMap[str, str]
    def __init__(
        self,
        command: _Iterable[str] | None = ...,
        name: str | None = ...,
        gpus: int | None = ...,
        priority: int | None = ...,
        ranks: int | None = ...,
        cwd: str | None = ...,
        env: _Mapping[str, str] | None = ...,
    ) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: Job | _Mapping | None = ...) -> None: ...

class Job(_message.Message):
    __slots__ = (
        "attempt",
        "command",
        "cpu_seconds",
        "cwd",
        "devices",
        "ended_at",
        "exit_code",
        "gpus",
        "id",
        "name",
        "pending_reason",
        "priority",
        "ranks",
        "reason",
        "rss_bytes",
        "signal",
        "started_at",
        "state",
        "submitted_at",
        "uid",
        "user",
    )
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
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
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
    cpu_seconds: float
    rss_bytes: int
    cwd: str
    attempt: int
    def __init__(
        self,
        id: int | None = ...,
        name: str | None = ...,
        user: str | None = ...,
        uid: int | None = ...,
        state: str | None = ...,
        reason: str | None = ...,
        pending_reason: str | None = ...,
        priority: int | None = ...,
        gpus: int | None = ...,
        ranks: int | None = ...,
        devices: _Iterable[int] | None = ...,
        command: _Iterable[str] | None = ...,
        submitted_at: float | None = ...,
        started_at: float | None = ...,
        ended_at: float | None = ...,
        exit_code: int | None = ...,
        signal: int | None = ...,
        cpu_seconds: float | None = ...,
        rss_bytes: int | None = ...,
        cwd: str | None = ...,
        attempt: int | None = ...,
    ) -> None: ...

class Event(_message.Message):
    __slots__ = ("at", "from_state", "reason", "to_state")
    AT_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at: float
    from_state: str
    to_state: str
    reason: str
    def __init__(
        self,
        at: float | None = ...,
        from_state: str | None = ...,
        to_state: str | None = ...,
        reason: str | None = ...,
    ) -> None: ...

class JobDetail(_message.Message):
    __slots__ = ("env", "events", "job", "log_path")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    JOB_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    job: Job
    env: _containers.ScalarMap[str, str]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    log_path: str
    def __init__(
        self,
        job: Job | _Mapping | None = ...,
        env: _Mapping[str, str] | None = ...,
        events: _Iterable[Event | _Mapping] | None = ...,
        log_path: str | None = ...,
    ) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: int | None = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("all", "user")
    ALL_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    all: bool
    user: str
    def __init__(self, all: bool | None = ..., user: str | None = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Iterable[Job | _Mapping] | None = ...) -> None: ...

class JobUpdate(_message.Message):
    __slots__ = ("is_change", "jobs")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    IS_CHANGE_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    is_change: bool
    def __init__(
        self, jobs: _Iterable[Job | _Mapping] | None = ..., is_change: bool | None = ...
    ) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("follow", "id", "rank", "tail")
    ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    id: int
    follow: bool
    tail: int
    rank: int
    def __init__(
        self,
        id: int | None = ...,
        follow: bool | None = ...,
        tail: int | None = ...,
        rank: int | None = ...,
    ) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: bytes | None = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Iterable[int] | None = ...) -> None: ...

class CancelResult(_message.Message):
    __slots__ = ("code", "error", "id", "ok", "state")
    ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    id: int
    ok: bool
    error: str
    state: str
    code: int
    def __init__(
        self,
        id: int | None = ...,
        ok: bool | None = ...,
        error: str | None = ...,
        state: str | None = ...,
        code: int | None = ...,
    ) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CancelResult]
    def __init__(self, results: _Iterable[CancelResult | _Mapping] | None = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Device(_message.Message):
    __slots__ = (
        "index",
        "jobs",
        "kind",
        "memory_total",
        "memory_used",
        "name",
        "utilization_percent",
        "uuid",
    )
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: str
    name: str
    uuid: str
    memory_total: int
    memory_used: int
    utilization_percent: float
    jobs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(
        self,
        index: int | None = ...,
        kind: str | None = ...,
        name: str | None = ...,
        uuid: str | None = ...,
        memory_total: int | None = ...,
        memory_used: int | None = ...,
        utilization_percent: float | None = ...,
        jobs: _Iterable[int] | None = ...,
    ) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Iterable[Device | _Mapping] | None = ...) -> None: ...

class DaemonInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DaemonInfo(_message.Message):
    __slots__ = (
        "caller_is_admin",
        "caller_uid",
        "caller_user",
        "criu_path",
        "criu_unavailable_reason",
        "criu_version",
        "device_count",
        "device_kind",
        "mode",
        "nvml_status",
        "pid_namespaces",
        "socket",
        "started_at",
        "state_dir",
        "version",
    )
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    STATE_DIR_FIELD_NUMBER: _ClassVar[int]
    CALLER_UID_FIELD_NUMBER: _ClassVar[int]
    CALLER_USER_FIELD_NUMBER: _ClassVar[int]
    CALLER_IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    NVML_STATUS_FIELD_NUMBER: _ClassVar[int]
    CRIU_UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    CRIU_PATH_FIELD_NUMBER: _ClassVar[int]
    CRIU_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    version: str
    mode: str
    socket: str
    state_dir: str
    caller_uid: int
    caller_user: str
    caller_is_admin: bool
    device_kind: str
    device_count: int
    nvml_status: str
    criu_unavailable_reason: str
    criu_path: str
    criu_version: str
    started_at: float
    pid_namespaces: bool
    def __init__(
        self,
        version: str | None = ...,
        mode: str | None = ...,
        socket: str | None = ...,
        state_dir: str | None = ...,
        caller_uid: int | None = ...,
        caller_user: str | None = ...,
        caller_is_admin: bool | None = ...,
        device_kind: str | None = ...,
        device_count: int | None = ...,
        nvml_status: str | None = ...,
        criu_unavailable_reason: str | None = ...,
        criu_path: str | None = ...,
        criu_version: str | None = ...,
        started_at: float | None = ...,
        pid_namespaces: bool | None = ...,
    ) -> None: ...
