"""The local broker's SASL_SSL listener (``sluicegate dev up --kafka-security sasl_ssl``): a CA and a broker
certificate made at run time with the ``openssl`` command, SCRAM-SHA-512 users written into the KRaft storage
when it is formatted, and the client settings that reach it.

Files live in ``<state>/kafka-<port>/security/`` of the stack's first node and are made once (a restart keeps
them, so clients already given the CA and passwords keep working):

    ca.pem, ca.key        the local CA (clients trust ca.pem: SLUICEGATE_KAFKA_SSL_CAFILE)
    broker.pem            the broker's key, certificate (127.0.0.1 and localhost) and CA, Kafka's PEM keystore
    admin.password        SCRAM password of ``admin``: the brokers' own user and the only super user
    sluicegate.password   SCRAM password of ``sluicegate``, the user the services connect as
    kafka.env             the SLUICEGATE_KAFKA_* variables that point a service at this broker

The StandardAuthorizer is on with ``super.users=User:admin``; ``allow.everyone.if.no.acl.found=true`` keeps
every other authenticated user allowed until ACLs are added (a user with no ACL at all may do anything), unless
``kafka_local_deny_without_acl`` asks the broker to deny what no ACL allows, as a shared cluster does. The
controller listener stays PLAINTEXT on loopback; its principal (ANONYMOUS) is a super user so that brokers may
reach their controller once ACLs exist.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cli.stack.layout import DevStackError, StackLayout
from sluicegate.settings import KafkaSecuritySettings

LocalSecurity = Literal["plaintext", "sasl_ssl"]
MECHANISM = "SCRAM-SHA-512"
ADMIN_USER = "admin"
SERVICE_USER = "sluicegate"
#: Local certificates live as long as browsers still accept (825 days); the dev stack remakes none by itself.
CERT_DAYS = 825


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise DevStackError("the openssl command is missing: it makes the SASL_SSL broker's certificates")
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        reason = (result.stderr.strip() or "no output").splitlines()[-1]
        raise DevStackError(f"openssl {args[0]} failed in {cwd}: {reason}")


def _write_secret(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


@dataclass(frozen=True)
class BrokerSecurity:
    """The security files of one local stack (kept in its first node's folder, shared by every node)."""

    folder: Path

    @classmethod
    def of(cls, layout: StackLayout) -> BrokerSecurity:
        return cls(layout.kafka_dir / "security")

    @property
    def cafile(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def keystore(self) -> Path:
        return self.folder / "broker.pem"

    def password_file(self, user: str) -> Path:
        return self.folder / f"{user}.password"

    @property
    def env_file(self) -> Path:
        return self.folder / "kafka.env"

    def ensure(self, bootstrap: str) -> BrokerSecurity:
        """Make whatever of the CA, the broker certificate and the passwords is missing; write ``kafka.env``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        for user in (ADMIN_USER, SERVICE_USER):
            if not self.password_file(user).exists():
                _write_secret(self.password_file(user), secrets.token_hex(16) + "\n")
        if not self.keystore.exists():
            self._make_certificates()
        lines = [f"export {key}={value}" for key, value in self.env(bootstrap).items()]
        self.env_file.write_text("\n".join(lines) + "\n")
        return self

    def _make_certificates(self) -> None:
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl(
            "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(CERT_DAYS),
            "-subj", "/CN=Sluicegate local Kafka CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=self.folder,
        )  # fmt: skip
        (self.folder / "ca.key").chmod(0o600)
        (self.folder / "broker.ext").write_text(
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
        _openssl("req", *ec, "-keyout", "broker.key", "-out", "broker.csr", "-subj", "/CN=localhost", cwd=self.folder)
        _openssl(
            "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "broker.crt", "-days", str(CERT_DAYS), "-extfile", "broker.ext",
            cwd=self.folder,
        )  # fmt: skip
        parts = [(self.folder / name).read_text() for name in ("broker.key", "broker.crt", "ca.pem")]
        _write_secret(self.keystore, "".join(parts))
        for name in ("broker.key", "broker.csr", "broker.crt", "broker.ext", "ca.srl"):
            (self.folder / name).unlink(missing_ok=True)

    def password(self, user: str) -> str:
        return self.password_file(user).read_text().strip()

    def scram_format_args(self) -> list[str]:
        """``kafka-storage format`` options that create the SCRAM users with the KRaft metadata."""
        args: list[str] = []
        for user in (ADMIN_USER, SERVICE_USER):
            args += ["--add-scram", f"{MECHANISM}=[name={user},password={self.password(user)}]"]
        return args

    def server_properties(self, *, deny_without_acl: bool = False) -> str:
        """The lines a SASL_SSL broker adds to its ``server.properties``; ``deny_without_acl`` refuses a principal
        what no ACL allows (read at each start, so a restart switches it without reformatting)."""
        jaas = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{ADMIN_USER}" password="{self.password(ADMIN_USER)}";'
        )
        return "\n".join(
            (
                f"sasl.enabled.mechanisms={MECHANISM}",
                f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
                f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config={jaas}",
                "ssl.keystore.type=PEM",
                f"ssl.keystore.location={self.keystore}",
                "ssl.truststore.type=PEM",
                f"ssl.truststore.location={self.cafile}",
                "ssl.client.auth=none",
                "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                f"super.users=User:{ADMIN_USER};User:ANONYMOUS",
                f"allow.everyone.if.no.acl.found={'false' if deny_without_acl else 'true'}",
            )
        )

    def env(self, bootstrap: str, user: str = SERVICE_USER) -> dict[str, str]:
        """The variables that point a service at this broker as ``user``."""
        return {
            "SLUICEGATE_KAFKA_BOOTSTRAP": bootstrap,
            "SLUICEGATE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "SLUICEGATE_KAFKA_SASL_MECHANISM": MECHANISM,
            "SLUICEGATE_KAFKA_SASL_USERNAME": user,
            "SLUICEGATE_KAFKA_SASL_PASSWORD_FILE": str(self.password_file(user)),
            "SLUICEGATE_KAFKA_SSL_CAFILE": str(self.cafile),
        }

    def client_settings(self, user: str = ADMIN_USER) -> KafkaSecuritySettings:
        """Client security that reaches this broker as ``user`` (the dev stack's own probes use ``admin``)."""
        return KafkaSecuritySettings(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism=MECHANISM,
            kafka_sasl_username=user,
            kafka_sasl_password_file=self.password_file(user),
            kafka_ssl_cafile=self.cafile,
        )


def _mode_file(layout: StackLayout) -> Path:
    return layout.kafka_dir / "listener.security"


def mark_formatted(layout: StackLayout, security: BrokerSecurity | None) -> None:
    """Record which listener a node's storage was just formatted for."""
    _mode_file(layout).write_text("sasl_ssl\n" if security is not None else "plaintext\n")


def formatted_security(layout: StackLayout) -> LocalSecurity:
    """The client listener a node's storage was formatted for (plaintext when nothing says otherwise)."""
    try:
        return "sasl_ssl" if _mode_file(layout).read_text().strip() == "sasl_ssl" else "plaintext"
    except OSError:
        return "plaintext"


def check_security(layout: StackLayout, wanted: LocalSecurity) -> None:
    """SCRAM users are written when the storage is formatted: data formatted for another listener cannot serve
    this one, so say so instead of a broker that refuses every login."""
    formatted = (layout.kafka_dir / "data" / "meta.properties").exists()
    if formatted and formatted_security(layout) != wanted:
        raise DevStackError(
            f"the Kafka data in {layout.kafka_dir} was formatted for a {formatted_security(layout)} listener, not "
            f"{wanted}: run `sluicegate dev down` and remove that folder, or use another SLUICEGATE_KAFKA_PORT"
        )


def local_client_security(layout: StackLayout) -> KafkaSecuritySettings:
    """How the stack's own probes reach the broker of ``layout``: as ``admin`` over SASL_SSL when its storage was
    formatted for that, else plaintext. Built without reading the environment (``model_construct``): variables
    meant for the services (a managed cluster's CA, say) must not change how the local broker is probed."""
    if formatted_security(layout) == "sasl_ssl":
        return BrokerSecurity.of(layout).client_settings()
    return KafkaSecuritySettings.model_construct()


def security_env(layout: StackLayout, bootstrap: str) -> dict[str, str]:
    """The SASL_SSL variables of a stack whose broker serves that listener (none for plaintext)."""
    if formatted_security(layout) != "sasl_ssl":
        return {}
    return BrokerSecurity.of(layout).env(bootstrap)
