"""The proxy server of one device: holds the jobs' tensors and runs their operations in order.

Run as `python -m singularity.proxy.server --socket PATH --device-index N --memory-bytes B
[--cuda-device K]`. Without --cuda-device the device is virtual: tensors live in this
process's memory and operations run on its CPU. Jobs connect on --socket; the daemon
drives checkpoints through the control socket (see proxy/control.py).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import fcntl
import io
import json
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import wire

_DEV = "\x00sing-device"
_SIOCOUTQ = 0x5411
_SAFE_TORCH = (torch.dtype, torch.layout, torch.memory_format)


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles only plain data, slices and torch dtypes/layouts/devices: jobs are untrusted."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in ("slice", "set", "frozenset", "complex"):
            return getattr(builtins, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "torch" or module.startswith("torch."):
            obj: Any = torch
            for part in name.removeprefix("torch.").split("."):
                obj = getattr(obj, part, None)
            if obj is torch.device or isinstance(obj, _SAFE_TORCH):
                return obj
        raise pickle.UnpicklingError(f"proxy: refused to unpickle {module}.{name}")


def _loads(data: bytes) -> Any:
    return _SafeUnpickler(io.BytesIO(data)).load()


def recv_safe(sock: socket.socket) -> Any:
    """Receive one message from an untrusted peer."""
    (n,) = wire.LENGTH.unpack(wire.recv_exact(sock, wire.LENGTH.size))
    return _loads(wire.recv_exact(sock, n))


def _raw(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    c = torch.empty_like(t, device="cpu")
    c.copy_(t)
    flat = torch.empty(0, dtype=torch.uint8).set_(c.untyped_storage())
    return c, flat.numpy().tobytes()


def _from_raw(dtype: torch.dtype, shape: Any, stride: Any, raw: bytes) -> torch.Tensor:
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), 0, shape, stride)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


class Session:
    """Everything one job process (job id, rank) holds on this device."""

    def __init__(self, job_id: str, rank: int, uid: int) -> None:
        self.job_id = job_id
        self.rank = rank
        self.uid = uid
        self.tensors: dict[int, torch.Tensor] = {}
        self.where: dict[int, int] = {}  # handle -> storage pointer
        self.storages: dict[int, list[int]] = {}  # pointer -> [nbytes, references]
        self.ops: dict[int, Any] = {}
        self.op_names: dict[int, tuple[str, str, str]] = {}
        self.bytes = 0
        self.peak = 0
        self.sticky: tuple[str, str, str] | None = None
        self.conn: Connection | None = None
        self.parked = False
        self.waiting = False  # parked while the program waited on a value
        self.park_ev = threading.Event()


class Connection:
    """One client socket; replies and control messages share its send lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.lock:
            wire.send_msg(self.sock, msg)

    def outq(self) -> int:
        buf = fcntl.ioctl(self.sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", buf)[0])


class Server:
    """A proxy server for one device."""

    def __init__(
        self,
        device_index: int,
        memory_bytes: int,
        cuda_device: int | None,
        name: str | None = None,
        registry: Path | None = None,
    ) -> None:
        self.index = device_index
        self.capacity = memory_bytes
        self.registry = registry
        if cuda_device is None:
            self.device = torch.device("cpu")
            self.info: dict[str, Any] = {
                "name": name or "Singularity Virtual Device",
                "total_memory": memory_bytes,
                "major": 8,
                "minor": 0,
                "multi_processor_count": 1,
                "kind": "virtual",
                "index": device_index,
            }
        else:
            self.device = torch.device("cuda", cuda_device)
            p = torch.cuda.get_device_properties(self.device)
            self.info = {
                "name": name or p.name,
                "total_memory": memory_bytes,
                "major": p.major,
                "minor": p.minor,
                "multi_processor_count": p.multi_processor_count,
                "kind": "cuda",
                "index": device_index,
            }
        self.sessions: dict[tuple[str, int], Session] = {}
        self.total = 0
        self.exec_lock = threading.Lock()
        self.state_lock = threading.RLock()

    # -- memory ---------------------------------------------------------------------
    def _add(self, s: Session, h: int, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        s.tensors[h] = t
        s.where[h] = ptr
        ref = s.storages.get(ptr)
        if ref is not None:
            ref[1] += 1
            return 0
        nb = st.nbytes()
        s.storages[ptr] = [nb, 1]
        s.bytes += nb
        self.total += nb
        if s.bytes > s.peak:
            s.peak = s.bytes
        return nb

    def _free(self, s: Session, h: int) -> None:
        if s.tensors.pop(h, None) is None:
            return
        ptr = s.where.pop(h)
        ref = s.storages[ptr]
        ref[1] -= 1
        if ref[1] == 0:
            del s.storages[ptr]
            s.bytes -= ref[0]
            self.total -= ref[0]

    def _check(self, s: Session, new: list[int], asked: int) -> None:
        if self.total <= self.capacity:
            return
        for h in new:
            self._free(s, h)
        free = max(0, self.capacity - self.total)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_fmt(asked)}. GPU {self.index} has a "
            f"total capacity of {_fmt(self.capacity)} of which {_fmt(free)} is free. Of the "
            f"allocated memory {_fmt(s.bytes)} is allocated by PyTorch, and 0 bytes is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    # -- operations -----------------------------------------------------------------
    def _dec(self, s: Session, a: Any, ins: list[torch.Tensor]) -> Any:
        t = type(a)
        if t is slice:
            x = s.tensors[a.stop]
            ins.append(x)
            return x
        if t is list:
            return [self._dec(s, v, ins) for v in a]
        if t is tuple:
            return _from_raw(a[1], a[2], a[3], a[4]).to(self.device)
        if t is str and a == _DEV:
            return self.device
        return a

    def _place(self, s: Session, o: Any, ins: list[torch.Tensor], ctr: list[int], new: list[int]) -> Any:
        if isinstance(o, torch.Tensor):
            for i, x in enumerate(ins):
                if o is x:
                    return ("A", i)
            h = ctr[0]
            ctr[0] = h + 1
            nb = self._add(s, h, o)
            new.append(h)
            return ("T", (tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype), nb)
        if isinstance(o, list):
            return ("L", [self._place(s, v, ins, ctr, new) for v in o])
        if isinstance(o, tuple):
            return ("U", [self._place(s, v, ins, ctr, new) for v in o])
        if o is None:
            return ("N",)
        if isinstance(o, (bool, int, float, complex, str)):
            return ("V", o)
        return ("V", repr(o))

    def _call(self, s: Session, oid: int, base: int, args: Any, kwargs: Any) -> Any:
        func = s.ops[oid]
        ins: list[torch.Tensor] = []
        a = [self._dec(s, v, ins) for v in args]
        kw = {k: self._dec(s, v, ins) for k, v in kwargs.items()} if kwargs else {}
        out = func(*a, **kw)
        new: list[int] = []
        tpl = self._place(s, out, ins, [base], new)
        if new:
            self._check(s, new, sum(tpl_bytes(tpl)))
        return tpl

    def _run(self, s: Session, op: tuple[Any, ...]) -> None:
        k = op[0]
        if k == wire.OP_CALL:
            self._call(s, op[1], op[2], op[3], op[4])
        elif k == wire.OP_FREE:
            for h in op[1]:
                self._free(s, h)
        elif k == wire.OP_DEF:
            ns, name, overload = op[2]
            s.op_names[op[1]] = op[2]
            s.ops[op[1]] = getattr(getattr(getattr(torch.ops, ns), name), overload)
        elif k == wire.OP_UPLOAD:
            t = _from_raw(op[2], op[3], op[4], op[5])
            if self.device.type != "cpu":
                t = t.to(self.device)
            nb = self._add(s, op[1], t)
            self._check(s, [op[1]], nb)
        elif k == wire.OP_FILL:
            s.tensors[op[1]].copy_(_from_raw(op[2], op[3], op[4], op[5]))
        elif k == wire.OP_FACTORY:
            fname = op[2]
            if fname not in _FACTORIES:
                raise RuntimeError(f"proxy: factory {fname!r} not allowed")
            kw = {k2: (self.device if v == _DEV else v) for k2, v in op[4].items()}
            t = getattr(torch, fname)(*op[3], **kw)
            nb = self._add(s, op[1], t)
            self._check(s, [op[1]], nb)
        else:
            raise RuntimeError(f"proxy: unknown operation {k!r}")

    def _request(self, s: Session, req: tuple[Any, ...]) -> Any:
        k = req[0]
        if k == wire.REQ_CALL:
            return self._call(s, req[1], req[2], req[3], req[4])
        if k == wire.REQ_FETCH:
            t = s.tensors[req[1]]
            c, raw = _raw(t)
            return (c.dtype, tuple(c.shape), tuple(c.stride()), raw)
        if k == wire.REQ_SYNC:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        if k == wire.REQ_MEMORY:
            what = req[1]
            if what == "allocated":
                return s.bytes
            if what == "peak":
                return s.peak
            if what == "reset_peak":
                s.peak = s.bytes
                return None
            if what == "info":
                return (max(0, self.capacity - self.total), self.capacity)
            return {
                "allocated_bytes.all.current": s.bytes,
                "allocated_bytes.all.peak": s.peak,
                "reserved_bytes.all.current": s.bytes,
                "reserved_bytes.all.peak": s.peak,
                "active_bytes.all.current": s.bytes,
                "num_ooms": 0,
            }
        raise RuntimeError(f"proxy: unknown request {k!r}")

    def handle_batch(self, s: Session, ops: list[Any], req: Any) -> Any:
        """Run a batch in order; the reply (or None) for its request."""
        with self.exec_lock:
            for op in ops:
                try:
                    self._run(s, op)
                except Exception as e:
                    if s.sticky is None:
                        s.sticky = _exc_info(e)
            if req is None:
                return None
            if s.sticky is not None:
                err, s.sticky = s.sticky, None
                return (wire.ERROR, *err)
            try:
                return (wire.REPLY, self._request(s, req))
            except Exception as e:
                return (wire.ERROR, *_exc_info(e))

    # -- sessions and connections ---------------------------------------------------
    def drop(self, s: Session) -> None:
        with self.state_lock:
            for h in list(s.tensors):
                self._free(s, h)
            if self.sessions.get((s.job_id, s.rank)) is s:
                del self.sessions[(s.job_id, s.rank)]

    def admission_problem(self, job_id: str, uid: int) -> str:
        """Why a process of this uid may not open a session for this job ('' when it may).

        With a registry (the daemon's), a job's sessions can be opened only by the uid the
        daemon registered for it, so no user can claim, squat or disturb another user's job.
        """
        if self.registry is None or uid == 0:
            return ""
        if not job_id or not all(c.isalnum() or c in "._-" for c in job_id):
            return f"proxy: invalid job id {job_id!r}"
        try:
            admitted = json.loads((self.registry / job_id).read_text())
            owner, devices = int(admitted["uid"]), [int(d) for d in admitted["devices"]]
        except (OSError, ValueError, KeyError, TypeError):
            return f"proxy: job {job_id} is not admitted on this device"
        if owner != uid:
            return f"proxy: job {job_id} does not belong to uid {uid}"
        if self.index not in devices:
            return f"proxy: job {job_id} was not granted device {self.index}"
        return ""

    def serve(self, sock: socket.socket) -> None:
        """Serve one job connection until it closes."""
        conn = Connection(sock)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        s: Session | None = None
        try:
            hello = recv_safe(sock)
            if not isinstance(hello, tuple) or hello[0] != wire.HELLO:
                return
            _, job_id, rank, _index, resume = hello
            key = (str(job_id), int(rank))
            with self.state_lock:
                old = self.sessions.get(key)
                if resume:
                    if old is None or (uid != 0 and uid != os.getuid()):
                        conn.send(
                            (wire.ERROR, "builtins", "RuntimeError", f"proxy: no session to resume for {key}")
                        )
                        return
                    s = old
                else:
                    refusal = self.admission_problem(str(job_id), uid)
                    if refusal:
                        conn.send((wire.ERROR, "builtins", "PermissionError", refusal))
                        return
                    if old is not None and old.uid != uid and uid != 0:
                        conn.send(
                            (
                                wire.ERROR,
                                "builtins",
                                "PermissionError",
                                f"proxy: session {key} belongs to another user",
                            )
                        )
                        return
                    if old is not None:
                        self.drop(old)
                    s = Session(key[0], key[1], uid)
                    self.sessions[key] = s
                s.conn = conn
            conn.send((wire.WELCOME, self.info))
            torch.set_grad_enabled(True)  # some kernels (mkldnn RNN) keep state only then
            while True:
                msg = recv_safe(sock)
                kind = msg[0]
                if kind == wire.BATCH:
                    reply = self.handle_batch(s, msg[1], msg[2])
                    if reply is not None:
                        conn.send(reply)
                elif kind == wire.PARKED:
                    s.waiting = bool(msg[1]) if len(msg) > 1 else False
                    s.parked = True
                    s.park_ev.set()
        except (ConnectionError, OSError, EOFError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            if s is not None:
                s.park_ev.set()  # a quiesce waiting on this process must not wait forever
                with self.state_lock:
                    if s.conn is conn:
                        s.conn = None
                        if not s.parked:
                            self.drop(s)

    # -- checkpoint control ---------------------------------------------------------
    def job_sessions(self, job_id: str) -> list[Session]:
        with self.state_lock:
            return sorted((s for (j, _r), s in self.sessions.items() if j == job_id), key=lambda s: s.rank)

    def quiesce(self, job_id: str, timeout: float) -> list[int]:
        """Park every connected process of the job at an operation boundary."""
        deadline = time.monotonic() + timeout
        sessions = self.job_sessions(job_id)
        for s in sessions:
            if s.conn is not None and not s.parked:
                s.park_ev.clear()
                s.conn.send((wire.PARK,))
        parked = []
        for s in sessions:
            conn = s.conn
            if conn is None:
                s.parked = True
                parked.append(s.rank)
                continue
            if not s.park_ev.wait(max(0.0, deadline - time.monotonic())) and not s.parked:
                raise TimeoutError(f"job {job_id} rank {s.rank} did not park in {timeout}s")
            if not s.parked:
                continue  # the process ended meanwhile
            while conn.outq() > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} rank {s.rank}: channel not drained")
                time.sleep(0.001)
            parked.append(s.rank)
        return parked

    def save(self, job_id: str, directory: str) -> dict[str, int]:
        """Write the live tensors of a quiesced job, one file per rank."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        live = written = 0
        sessions = self.job_sessions(job_id)
        if not sessions:
            raise KeyError(f"proxy: no job {job_id!r} on device {self.index}")
        with self.exec_lock:
            for s in sessions:
                if not s.parked:
                    raise RuntimeError(f"proxy: job {job_id} rank {s.rank} is not quiesced")
                state = {
                    "job_id": s.job_id,
                    "rank": s.rank,
                    "uid": s.uid,
                    "tensors": s.tensors,
                    "ops": s.op_names,
                    "peak": s.peak,
                    "sticky": s.sticky,
                }
                path = d / f"rank{s.rank}.pt"
                torch.save(state, path)
                live += s.bytes
                written += path.stat().st_size
        return {"live_bytes": live, "file_bytes": written, "ranks": len(sessions)}

    def release(self, job_id: str) -> int:
        """Free everything the job holds here; the bytes freed."""
        freed = 0
        for s in self.job_sessions(job_id):
            freed += s.bytes
            conn = s.conn
            s.conn = None
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            self.drop(s)
        return freed

    def load(self, job_id: str, directory: str) -> dict[str, int]:
        """Recreate a saved job's tensors here, parked until resume."""
        files = sorted(Path(directory).glob("rank*.pt"))
        if not files:
            raise FileNotFoundError(f"proxy: no saved ranks in {directory}")
        loaded = 0
        with self.exec_lock:
            for f in files:
                state = torch.load(f, map_location=self.device, weights_only=True)
                key = (job_id, int(state["rank"]))
                with self.state_lock:
                    if key in self.sessions:
                        raise RuntimeError(f"proxy: job {job_id} rank {key[1]} already here")
                    s = Session(job_id, key[1], int(state["uid"]))
                    s.parked = True
                    s.park_ev.set()
                    for oid, name in state["ops"].items():
                        s.op_names[oid] = tuple(name)
                        s.ops[oid] = getattr(getattr(getattr(torch.ops, name[0]), name[1]), name[2])
                    new: list[int] = []
                    for h, t in state["tensors"].items():
                        self._add(s, int(h), t)
                        new.append(int(h))
                    s.peak = max(s.bytes, int(state["peak"]))
                    s.sticky = state["sticky"]
                    self.sessions[key] = s
                    try:
                        self._check(s, new, s.bytes)
                    except torch.OutOfMemoryError:
                        self.drop(s)
                        raise
                    loaded += s.bytes
        return {"live_bytes": loaded, "ranks": len(files)}

    def resume(self, job_id: str) -> list[int]:
        """Let the job's parked processes go on."""
        ranks = []
        for s in self.job_sessions(job_id):
            if s.parked and s.conn is not None:
                s.parked = False
                s.park_ev.clear()
                s.conn.send((wire.RESUME,))
                ranks.append(s.rank)
        return ranks

    def status(self) -> dict[str, Any]:
        with self.state_lock:
            return {
                "index": self.index,
                "capacity": self.capacity,
                "allocated": self.total,
                "jobs": {
                    f"{j}/{r}": {
                        "bytes": s.bytes,
                        "parked": s.parked,
                        "waiting": s.waiting,
                        "connected": s.conn is not None,
                    }
                    for (j, r), s in self.sessions.items()
                },
            }

    def control(self, sock: socket.socket) -> None:
        """Serve one control connection (the daemon)."""
        try:
            while True:
                req = recv_safe(sock)
                name, args = req[0], req[1:]
                try:
                    if name == "quiesce":
                        res: Any = self.quiesce(str(args[0]), float(args[1]))
                    elif name == "save":
                        res = self.save(str(args[0]), str(args[1]))
                    elif name == "release":
                        res = self.release(str(args[0]))
                    elif name == "load":
                        res = self.load(str(args[0]), str(args[1]))
                    elif name == "resume":
                        res = self.resume(str(args[0]))
                    elif name == "status":
                        res = self.status()
                    else:
                        raise ValueError(f"unknown control request {name!r}")
                    wire.send_msg(sock, ("ok", res))
                except Exception as e:
                    wire.send_msg(sock, ("err", type(e).__name__, str(e)))
        except (ConnectionError, OSError, EOFError):
            pass
        finally:
            sock.close()


def tpl_bytes(tpl: Any) -> list[int]:
    """New-storage byte counts of the tensors in an output template."""
    if tpl[0] == "T":
        return [tpl[2]]
    if tpl[0] in ("L", "U"):
        return [b for x in tpl[1] for b in tpl_bytes(x)]
    return []


_FACTORIES = {"zeros", "ones", "empty", "full", "eye", "arange", "linspace", "logspace", "empty_strided"}


def _exc_info(e: BaseException) -> tuple[str, str, str]:
    t = type(e)
    msg = str(e) if not isinstance(e, KeyError) else str(e.args[0]) if e.args else ""
    return (t.__module__, t.__qualname__, msg)


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(128)
    return s


def _accept_loop(lsock: socket.socket, target: Any) -> None:
    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        threading.Thread(target=target, args=(conn,), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Command line entry point of a proxy server process."""
    ap = argparse.ArgumentParser(prog="python -m singularity.proxy.server")
    ap.add_argument("--socket", required=True, help="Unix socket the job processes connect to")
    ap.add_argument("--control", help="control socket for the daemon (default: SOCKET.ctl)")
    ap.add_argument("--device-index", type=int, required=True)
    ap.add_argument("--memory-bytes", type=int, required=True)
    ap.add_argument("--cuda-device", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="intra-op CPU threads")
    ap.add_argument("--name", default=None, help="device name the jobs see")
    ap.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="an inherited, already listening socket for --socket (socket activation by the daemon)",
    )
    ap.add_argument(
        "--registry",
        type=Path,
        default=None,
        help="folder of files named by job id holding the uid allowed to open its sessions (the daemon's)",
    )
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    server = Server(a.device_index, a.memory_bytes, a.cuda_device, a.name, a.registry)
    control_path = a.control or a.socket + ".ctl"
    ctl = _listen(control_path)
    os.chmod(control_path, 0o600)
    if a.listen_fd is not None:
        data = socket.socket(fileno=a.listen_fd)
        data.setblocking(True)
    else:
        data = _listen(a.socket)
        os.chmod(a.socket, 0o666)  # every user's jobs connect; a session is bound to its uid at hello
    threading.Thread(target=_accept_loop, args=(ctl, server.control), daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=_accept_loop, args=(data, server.serve), daemon=True).start()
    print(f"proxy: device {a.device_index} ready on {a.socket}", file=sys.stderr, flush=True)
    stop.wait()
    for p in (a.socket, control_path):
        with contextlib.suppress(OSError):
            os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
