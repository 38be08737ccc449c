"""The lab's PKI: a CA, node keys and certificates, and join tokens, in files private to root.

A PKI directory (0700, every file 0600) holds:

    ca.crt        the lab CA's certificate (on every node)
    ca.key        the CA's private key (only on the node that ran `init`)
    node.key      this node's private key: generated here, it never leaves the node
    node.crt      this node's certificate: CN and DNS SAN name the node, signed by the CA
    tokens.json   join tokens the CA node accepts: id -> sha256 of the secret, expiry
    issued.json   node names the CA has certified: name -> serial, expiry, key fingerprint, number
    numbers.json  the next node number to give (numbers are never given twice)
    peers.json    peers learnt at join (the CA node's peer address): node -> host:port

The flow follows kubeadm: `init` makes the CA and prints a join token with the CA's fingerprint;
a joining node makes its key, checks the CA's fingerprint, and sends a CSR with the token (see
`join`); the CA node signs it with `sign_request`. Everything here is library code with no
network I/O, so `sing cluster init/join` can reach it through the daemon.

Every node also gets a number from the CA (1 for the CA node, then 2, 3, ... in the order nodes
first join; a name that joins again with its key keeps its number). The certificate carries it
(the subject's serialNumber), so a node learns its number from its own certificate; the daemon
allocates job ids from the node's block of numbers (see `job_id_block`), which keeps ids unique
across the lab without any coordination.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODE_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
TOKEN_RE = re.compile(r"([a-z0-9]{6})\.([a-z0-9]{16})")
TOKEN_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
CA_DAYS = 3650
NODE_DAYS = 365
TOKEN_TTL_S = 24 * 3600.0
CLOCK_SKEW_S = 300.0
JOB_ID_BLOCK = 1_000_000
"""Job ids of node number n are n * JOB_ID_BLOCK + 1 .. (n + 1) * JOB_ID_BLOCK - 1."""

PrivateKey = ec.EllipticCurvePrivateKey


class PkiError(ValueError):
    """A PKI operation that cannot be done; the message is one line meant for the user."""


@dataclass(frozen=True)
class JoinToken:
    """A bearer secret that lets one machine ask the CA for a certificate (`id.secret`)."""

    token_id: str
    secret: str

    def __str__(self) -> str:
        return f"{self.token_id}.{self.secret}"

    @staticmethod
    def parse(text: str) -> JoinToken:
        """Parse `abcdef.0123456789abcdef`; raise PkiError when it has another shape."""
        match = TOKEN_RE.fullmatch(text.strip())
        if match is None:
            raise PkiError("a join token looks like abcdef.0123456789abcdef")
        return JoinToken(match.group(1), match.group(2))

    @staticmethod
    def generate() -> JoinToken:
        """A fresh random token."""
        pick = secrets.choice
        return JoinToken(
            "".join(pick(TOKEN_ALPHABET) for _ in range(6)), "".join(pick(TOKEN_ALPHABET) for _ in range(16))
        )


@dataclass(frozen=True)
class InitResult:
    """What `sing cluster init` prints: the token and CA fingerprint a joining node needs."""

    node_name: str
    token: JoinToken
    ca_fingerprint: str
    token_expires_at: float


@dataclass(frozen=True)
class NodeIdentity:
    """This node's key, certificate and CA, checked to belong together and to be valid now."""

    node_name: str
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes
    not_after: float
    number: int = 0


def job_id_block(number: int) -> tuple[int, int]:
    """The job ids a node with this number allocates: [first, last] (number 0: a lone daemon's)."""
    if number <= 0:
        return 1, JOB_ID_BLOCK - 1
    return number * JOB_ID_BLOCK + 1, (number + 1) * JOB_ID_BLOCK - 1


def node_of_job(job_id: int) -> int:
    """The number of the node whose block a job id comes from (0: a lone daemon's, not unique)."""
    return job_id // JOB_ID_BLOCK


def check_node_name(name: str) -> str:
    """Return `name` if it can name a node (a lower-case DNS name), else raise PkiError."""
    if len(name) > 253 or NODE_NAME_RE.fullmatch(name) is None:
        raise PkiError(f"{name!r} cannot name a node: use lower-case letters, digits, '-' and '.'")
    return name


def fingerprint(cert_pem: bytes) -> str:
    """The certificate's SHA-256 fingerprint as `sha256:<hex>` (what `openssl x509 -fingerprint` hashes)."""
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _fingerprint_digits(text: str) -> str:
    return text.strip().lower().removeprefix("sha256:").replace(":", "")


def same_fingerprint(a: str, b: str) -> bool:
    """Whether two fingerprints are equal, ignoring case, colons and the `sha256:` prefix."""
    return hmac.compare_digest(_fingerprint_digits(a), _fingerprint_digits(b))


def is_fingerprint(text: str) -> bool:
    """Whether `text` can be a SHA-256 fingerprint as `fingerprint` writes it (case, colons and the
    prefix aside)."""
    digits = _fingerprint_digits(text)
    return len(digits) == 64 and all(c in "0123456789abcdef" for c in digits)


def generate_key() -> PrivateKey:
    """A new P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def key_to_pem(key: PrivateKey) -> bytes:
    """The key in unencrypted PKCS#8 PEM (kept in a 0600 file)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_to_pem(cert: x509.Certificate) -> bytes:
    """The certificate in PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def make_csr(key: PrivateKey, node_name: str) -> bytes:
    """A certificate signing request for `node_name`, signed with the node's own key."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, check_node_name(node_name))])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM)


def node_name_of(item: x509.Certificate | x509.CertificateSigningRequest) -> str:
    """The node a certificate (or a request for one) names: its subject's common name."""
    names = item.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise PkiError("the certificate names no node")
    value = names[0].value
    return value if isinstance(value, str) else value.decode()


def node_number_of(cert: x509.Certificate) -> int:
    """The node number the CA gave (the subject's serialNumber), or 0 when it carries none."""
    values = cert.subject.get_attributes_for_oid(NameOID.SERIAL_NUMBER)
    value = values[0].value if values else ""
    text = value if isinstance(value, str) else value.decode()
    return int(text) if text.isdigit() else 0


def public_key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """SHA-256 of the key's SubjectPublicKeyInfo, to recognise the same key across certificates."""
    spki = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


def _utc(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, datetime.UTC)


def _when(t: float) -> str:
    return _utc(t).strftime("%Y-%m-%d %H:%M:%S UTC")


def build_ca(cluster_name: str, now: float, days: int = CA_DAYS) -> tuple[PrivateKey, x509.Certificate]:
    """A self-signed CA key and certificate for the lab, valid `days` from `now`."""
    key = generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"singularity lab CA {cluster_name}")])
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(now - CLOCK_SKEW_S))
        .not_valid_after(_utc(now + days * 86400.0))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue_certificate(
    ca_key: PrivateKey,
    ca_cert: x509.Certificate,
    public_key: ec.EllipticCurvePublicKey,
    node_name: str,
    not_before: float,
    not_after: float,
    number: int = 0,
) -> x509.Certificate:
    """A node certificate: CN and DNS SAN `node_name` (serialNumber its number), for TLS server and client."""
    check_node_name(node_name)
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, node_name)]
    if number > 0:
        subject.append(x509.NameAttribute(NameOID.SERIAL_NUMBER, str(number)))
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=True,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(not_before))
        .not_valid_after(_utc(not_after))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_name)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )


def check_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> None:
    """Raise PkiError unless `cert` carries a valid signature of the CA."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise PkiError("the certificate was not issued by this lab's CA") from e


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner alone, atomically (temporary file, fsync, rename)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


class Pki:
    """One node's PKI directory; on the CA node it also signs requests and keeps join tokens."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.RLock()

    @property
    def ca_cert_path(self) -> Path:
        """The lab CA's certificate."""
        return self.root / "ca.crt"

    @property
    def ca_key_path(self) -> Path:
        """The CA's private key (CA node only)."""
        return self.root / "ca.key"

    @property
    def node_key_path(self) -> Path:
        """This node's private key."""
        return self.root / "node.key"

    @property
    def node_cert_path(self) -> Path:
        """This node's certificate."""
        return self.root / "node.crt"

    @property
    def is_ca(self) -> bool:
        """Whether this node holds the CA's key and so can admit new nodes."""
        return self.ca_key_path.exists()

    def ensure_dir(self) -> None:
        """Create the directory private to its owner (0700), tightening an existing one."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)

    # CA node

    def init(
        self,
        cluster_name: str,
        node_name: str,
        now: float,
        *,
        ca_days: int = CA_DAYS,
        node_days: int = NODE_DAYS,
        token_ttl_s: float = TOKEN_TTL_S,
    ) -> InitResult:
        """Make the lab CA here, certify this node, and create the first join token."""
        check_node_name(node_name)
        if self.ca_cert_path.exists():
            raise PkiError(f"{self.root} already holds a lab CA; it is made once per lab")
        self.ensure_dir()
        ca_key, ca_cert = build_ca(cluster_name, now, ca_days)
        write_private(self.ca_key_path, key_to_pem(ca_key))
        write_private(self.ca_cert_path, cert_to_pem(ca_cert))
        key = self.ensure_node_key()
        cert = self._issue(ca_key, ca_cert, key.public_key(), node_name, now, node_days)
        write_private(self.node_cert_path, cert)
        token, expires = self.create_token(now, token_ttl_s)
        return InitResult(node_name, token, fingerprint(cert_to_pem(ca_cert)), expires)

    def create_token(self, now: float, ttl_s: float = TOKEN_TTL_S) -> tuple[JoinToken, float]:
        """A new join token valid for `ttl_s` seconds (only its secret's hash is stored)."""
        if not self.is_ca:
            raise PkiError("only the node that made the lab CA can create join tokens")
        token = JoinToken.generate()
        with self._lock:
            tokens = {k: v for k, v in self._read_json("tokens.json").items() if float(v["expires"]) > now}
            tokens[token.token_id] = {
                "secret_sha256": hashlib.sha256(token.secret.encode()).hexdigest(),
                "expires": now + ttl_s,
            }
            self._write_json("tokens.json", tokens)
        return token, now + ttl_s

    def ca_fingerprint(self) -> str:
        """The fingerprint a joining node must be told to expect."""
        return fingerprint(self.ca_cert_path.read_bytes())

    def sign_request(
        self, token_text: str, csr_pem: bytes, now: float, *, node_days: int = NODE_DAYS
    ) -> tuple[bytes, bytes]:
        """Check the token and CSR and return (node certificate, CA certificate) in PEM.

        A node name already certified with another key is refused, so a token holder cannot take
        over an existing node's name; the same key asking again gets a fresh certificate (a join
        whose reply was lost can be retried).
        """
        if not self.is_ca:
            raise PkiError("this node does not hold the lab CA's key")
        self._check_token(token_text, now)
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as e:
            raise PkiError("the certificate request is not a PEM CSR") from e
        if not csr.is_signature_valid:
            raise PkiError("the certificate request is not signed by its own key")
        public_key = csr.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey):
            raise PkiError("the certificate request must carry an EC key")
        node_name = check_node_name(node_name_of(csr))
        ca_key, ca_cert = self._load_ca()
        with self._lock:  # held until issued, so two joins cannot both take one name
            previous = self._read_json("issued.json").get(node_name)
            if previous is not None and previous["key_sha256"] != public_key_fingerprint(public_key):
                raise PkiError(
                    f"node name {node_name!r} is already certified with another key; choose another "
                    f"name (--name), or, for the same machine with a new key, remove {node_name!r} "
                    f"from {self.root / 'issued.json'} on the CA node first"
                )
            cert = self._issue(ca_key, ca_cert, public_key, node_name, now, node_days)
        return cert, cert_to_pem(ca_cert)

    def forget_node(self, node_name: str) -> bool:
        """Drop a node name from the issued list so it can join again with a new key."""
        with self._lock:
            issued = self._read_json("issued.json")
            found = issued.pop(node_name, None) is not None
            self._write_json("issued.json", issued)
        return found

    def _issue(
        self,
        ca_key: PrivateKey,
        ca_cert: x509.Certificate,
        public_key: ec.EllipticCurvePublicKey,
        node_name: str,
        now: float,
        node_days: int,
    ) -> bytes:
        not_after = min(now + node_days * 86400.0, ca_cert.not_valid_after_utc.timestamp())
        with self._lock:
            issued = self._read_json("issued.json")
            number = self._node_number(issued, node_name)
            cert = issue_certificate(
                ca_key, ca_cert, public_key, node_name, now - CLOCK_SKEW_S, not_after, number
            )
            issued[node_name] = {
                "serial": format(cert.serial_number, "x"),
                "not_after": not_after,
                "key_sha256": public_key_fingerprint(public_key),
                "number": number,
            }
            self._write_json("issued.json", issued)
        return cert_to_pem(cert)

    def _node_number(self, issued: dict[str, Any], node_name: str) -> int:
        """The node's number: the one it was given before, else the next never given (numbers.json).

        Numbers of forgotten nodes are never given again, so job ids from an old node's block
        cannot collide with a newcomer's.
        """
        previous = issued.get(node_name)
        if previous is not None and int(previous.get("number", 0)) > 0:
            return int(previous["number"])
        given = [int(entry.get("number", 0)) for entry in issued.values()]
        number = max([int(self._read_json("numbers.json").get("next", 1)), *(n + 1 for n in given)])
        self._write_json("numbers.json", {"next": number + 1})
        return number

    def _check_token(self, token_text: str, now: float) -> None:
        token = JoinToken.parse(token_text)
        with self._lock:
            entry = self._read_json("tokens.json").get(token.token_id)
        digest = hashlib.sha256(token.secret.encode()).hexdigest()
        if entry is None or not hmac.compare_digest(str(entry["secret_sha256"]), digest):
            raise PkiError("the join token is not one this CA issued")
        if float(entry["expires"]) <= now:
            raise PkiError(f"the join token expired at {_when(float(entry['expires']))}")

    def _load_ca(self) -> tuple[PrivateKey, x509.Certificate]:
        key = serialization.load_pem_private_key(self.ca_key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{self.ca_key_path} does not hold an EC key")
        return key, x509.load_pem_x509_certificate(self.ca_cert_path.read_bytes())

    def _read_json(self, name: str) -> dict[str, Any]:
        try:
            value = json.loads((self.root / name).read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(value, dict):
            raise PkiError(f"{self.root / name} is not a JSON object")
        return value

    def _write_json(self, name: str, value: dict[str, Any]) -> None:
        write_private(self.root / name, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())

    # Every node

    def ensure_node_key(self) -> PrivateKey:
        """This node's private key, generated (0600) the first time."""
        self.ensure_dir()
        with contextlib.suppress(FileNotFoundError):
            key = serialization.load_pem_private_key(self.node_key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise PkiError(f"{self.node_key_path} does not hold an EC key")
            return key
        key = generate_key()
        write_private(self.node_key_path, key_to_pem(key))
        return key

    def join_request(self, node_name: str) -> bytes:
        """A CSR for this node made with its own key (created if needed); the key stays here."""
        return make_csr(self.ensure_node_key(), node_name)

    def install(self, cert_pem: bytes, ca_pem: bytes, expected_ca_fingerprint: str, node_name: str) -> None:
        """Keep the certificate the CA returned, after checking it is ours and the CA's."""
        if not same_fingerprint(fingerprint(ca_pem), expected_ca_fingerprint):
            raise PkiError("the CA certificate does not have the expected fingerprint")
        cert = x509.load_pem_x509_certificate(cert_pem)
        check_issued_by(cert, x509.load_pem_x509_certificate(ca_pem))
        if node_name_of(cert) != node_name:
            raise PkiError(f"the CA certified {node_name_of(cert)!r}, not {node_name!r}")
        key = self.ensure_node_key()
        if public_key_fingerprint(key.public_key()) != public_key_fingerprint(_ec_public_key(cert)):
            raise PkiError("the certificate is not for this node's key")
        write_private(self.ca_cert_path, ca_pem)
        write_private(self.node_cert_path, cert_pem)

    def remember_peer(self, node_name: str, address: str) -> None:
        """Keep a peer's address as a seed (the CA node's, learnt when joining)."""
        with self._lock:
            peers = self._read_json("peers.json")
            peers[check_node_name(node_name)] = address
            self._write_json("peers.json", peers)

    def remembered_peers(self) -> dict[str, str]:
        """Seeds learnt when joining: node -> host:port."""
        return {str(k): str(v) for k, v in self._read_json("peers.json").items()}

    def identity(self, now: float) -> NodeIdentity:
        """This node's key, certificate and CA, or PkiError saying what is missing or wrong."""
        for path in (self.ca_cert_path, self.node_key_path, self.node_cert_path):
            if not path.exists():
                raise PkiError(f"{path} is missing: this node has not joined a lab (sing cluster join)")
        ca_pem = self.ca_cert_path.read_bytes()
        cert_pem = self.node_cert_path.read_bytes()
        key_pem = self.node_key_path.read_bytes()
        cert = x509.load_pem_x509_certificate(cert_pem)
        check_issued_by(cert, x509.load_pem_x509_certificate(ca_pem))
        key = self.ensure_node_key()
        if public_key_fingerprint(key.public_key()) != public_key_fingerprint(_ec_public_key(cert)):
            raise PkiError(f"{self.node_cert_path} does not match {self.node_key_path}")
        not_after = cert.not_valid_after_utc.timestamp()
        if not_after <= now:
            raise PkiError(f"this node's certificate expired at {_when(not_after)}")
        return NodeIdentity(node_name_of(cert), key_pem, cert_pem, ca_pem, not_after, node_number_of(cert))


def _ec_public_key(cert: x509.Certificate) -> ec.EllipticCurvePublicKey:
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise PkiError("the certificate does not carry an EC key")
    return key
