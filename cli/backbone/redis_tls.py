"""Certificates for a local TLS Redis, made at run time with the ``openssl`` command: a private CA, a server
certificate for 127.0.0.1 and localhost, and a client certificate (for ``tls-auth-clients yes``), all signed by
that CA. Made once per folder; a later start finds and reuses them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict

CERT_DAYS = 825  # under the 825-day ceiling some TLS clients put on a leaf certificate


class TlsFiles(BaseModel):
    """The PEM files of a local TLS Redis and its clients."""

    model_config = ConfigDict(frozen=True)

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def url_query(self) -> str:
        """The ``rediss://`` query parameters a client of this server checks it with (and shows its certificate)."""
        return f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl not found: install it (apt-get install openssl) to make the TLS certificates")
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"openssl {args[0]} failed: {reason}")


def _signed(folder: Path, name: str, subject: str, extensions: str) -> None:
    """``name``.key and ``name``.crt under ``folder``, signed by the CA there."""
    ext = folder / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", subject,
             "-out", f"{name}.csr", cwd=folder)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", str(CERT_DAYS), "-sha256", "-extfile", ext.name, "-out", f"{name}.crt", cwd=folder)  # fmt: skip
    (folder / f"{name}.csr").unlink()
    ext.unlink()


def make_tls_files(folder: Path) -> TlsFiles:
    """The CA, server and client certificates under ``folder`` (made when missing; keys readable by the owner
    only)."""
    files = TlsFiles(
        ca=folder / "ca.crt",
        server_cert=folder / "server.crt",
        server_key=folder / "server.key",
        client_cert=folder / "client.crt",
        client_key=folder / "client.key",
    )
    if all(path.exists() for path in files.model_dump().values()):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-subj",
             "/CN=sluicegate local Redis CA", "-days", str(CERT_DAYS), "-out", "ca.crt", cwd=folder)  # fmt: skip
    _signed(
        folder,
        "server",
        "/CN=localhost",
        "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    _signed(folder, "client", "/CN=sluicegate", "extendedKeyUsage=clientAuth\n")
    return files
