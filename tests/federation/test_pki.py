"""The lab PKI: CA, node certificates naming the node, join tokens, private files."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from cryptography import x509

from singularityd.federation.pki import JoinToken, Pki, PkiError, fingerprint, node_name_of, same_fingerprint
from tests.federation.conftest import Lab


def mode(path: Path) -> int:
    """Permission bits of a path."""
    return stat.S_IMODE(path.stat().st_mode)


def test_init_makes_a_private_ca_and_prints_what_a_joining_node_needs(lab: Lab) -> None:
    root = lab.pki.root
    assert mode(root) == 0o700
    for name in ("ca.key", "ca.crt", "node.key", "node.crt", "tokens.json", "issued.json"):
        assert mode(root / name) == 0o600, name
    assert same_fingerprint(lab.fingerprint, fingerprint((root / "ca.crt").read_bytes()))
    assert lab.fingerprint.startswith("sha256:") and len(lab.fingerprint) == 7 + 64
    JoinToken.parse(lab.token)
    identity = lab.pki.identity(time.time())
    assert identity.node_name == "node-a"
    with pytest.raises(PkiError, match="already holds a lab CA"):
        lab.pki.init("again", "node-a", time.time())


def test_a_node_certificate_names_the_node_and_is_signed_by_the_ca(lab: Lab) -> None:
    identity = lab.identity("node-b")
    cert = x509.load_pem_x509_certificate(identity.cert_pem)
    assert node_name_of(cert) == "node-b"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-b"]
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(identity.ca_pem))
    assert 29 * 86400 < identity.not_after - time.time() <= 30 * 86400
    assert not lab.node_pki("node-b").is_ca and not (lab.root / "node-b" / "ca.key").exists()


def test_the_joining_nodes_key_never_leaves_it(lab: Lab) -> None:
    joiner = lab.node_pki("node-b")
    csr = joiner.join_request("node-b")
    key_pem = (joiner.root / "node.key").read_bytes()
    cert, _ = lab.pki.sign_request(lab.token, csr, time.time())
    assert b"PRIVATE KEY" not in csr and key_pem not in cert
    assert mode(joiner.root / "node.key") == 0o600 and mode(joiner.root) == 0o700


def test_bad_tokens_are_refused(lab: Lab) -> None:
    csr = lab.node_pki("node-b").join_request("node-b")
    with pytest.raises(PkiError, match="looks like"):
        lab.pki.sign_request("not-a-token", csr, time.time())
    wrong_secret = JoinToken(JoinToken.parse(lab.token).token_id, "0" * 16)
    with pytest.raises(PkiError, match="not one this CA issued"):
        lab.pki.sign_request(str(wrong_secret), csr, time.time())
    with pytest.raises(PkiError, match="expired"):
        lab.pki.sign_request(lab.token, csr, time.time() + 2 * 86400)
    assert JoinToken.parse(lab.token).secret not in (lab.pki.root / "tokens.json").read_text()


def test_a_name_already_certified_with_another_key_is_refused(lab: Lab) -> None:
    lab.identity("node-b")
    impostor = Pki(lab.root / "impostor")
    with pytest.raises(PkiError, match="already certified with another key"):
        lab.pki.sign_request(lab.token, impostor.join_request("node-b"), time.time())
    # The same key may ask again (a join whose reply was lost).
    lab.pki.sign_request(lab.token, lab.node_pki("node-b").join_request("node-b"), time.time())
    assert lab.pki.forget_node("node-b")
    lab.pki.sign_request(lab.token, impostor.join_request("node-b"), time.time())


def test_node_names_are_dns_names(lab: Lab) -> None:
    for bad in ("Node-B", "node_b", "-b", "b-", "", "a" * 64, "node b"):
        with pytest.raises(PkiError, match="cannot name a node"):
            lab.node_pki("x").join_request(bad)


def test_install_refuses_a_certificate_from_another_ca_or_for_another_node(
    lab: Lab, foreign_lab: Lab
) -> None:
    joiner = lab.node_pki("node-b")
    cert, ca = foreign_lab.pki.sign_request(foreign_lab.token, joiner.join_request("node-b"), time.time())
    with pytest.raises(PkiError, match="expected fingerprint"):
        joiner.install(cert, ca, lab.fingerprint, "node-b")
    cert, ca = lab.pki.sign_request(lab.token, joiner.join_request("node-b"), time.time())
    with pytest.raises(PkiError, match="certified 'node-b', not 'node-c'"):
        joiner.install(cert, ca, lab.fingerprint, "node-c")


def test_identity_says_what_is_wrong(lab: Lab) -> None:
    with pytest.raises(PkiError, match="has not joined"):
        lab.node_pki("nobody").identity(time.time())
    lab.identity("node-b", days=1)
    with pytest.raises(PkiError, match="expired"):
        lab.node_pki("node-b").identity(time.time() + 2 * 86400)
