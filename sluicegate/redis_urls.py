"""What a Redis URL says: the Sentinel form's parts (its users and TLS included), the TLS options every client of
the pipeline (redis-py and Celery's kombu alike) connects with, and the URL with its secrets masked for logs.

URL forms:

* ``redis://[user:password@]host:port/db`` and ``rediss://...`` (TLS): redis-py's own; the TLS query parameters
  below apply.
* ``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]`` asks those Sentinels for the
  primary of ``service_name``; ``rediss+sentinel://`` speaks TLS to the Sentinels and to the primary. The user and
  password before ``@`` are the data nodes' (the primary's) ACL user. The Sentinels are asked as
  ``sentinel_username`` / ``sentinel_password`` (query parameters) when given, else without credentials (a Sentinel
  with ``requirepass`` or ACL users needs them).

TLS query parameters (both TLS forms): ``ssl_ca_certs`` (the CA bundle that signed the servers' certificates),
``ssl_certfile`` / ``ssl_keyfile`` (a client certificate, for servers with ``tls-auth-clients yes``),
``ssl_cert_reqs`` (``required``, the default; ``optional``; ``none`` turns the server's certificate check off) and
``ssl_check_hostname`` (``true`` by default when certificates are checked). Files not named in the URL come from
:class:`~sluicegate.settings.RedisSettings` (``redis_tls_ca_file``, ``redis_tls_cert_file``, ``redis_tls_key_file``).
"""

from __future__ import annotations

import ssl
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

from sluicegate.settings import RedisSettings

SENTINEL_SCHEME = "redis+sentinel"
TLS_SENTINEL_SCHEME = "rediss+sentinel"
TLS_SCHEMES = frozenset({"rediss", TLS_SENTINEL_SCHEME})
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
_SENTINEL_PARAMS = frozenset({"sentinel_username", "sentinel_password"})
_TLS_PARAMS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"})


class TlsOptions(BaseModel):
    """How a client checks the server's certificate and which certificate it shows (the CA and key are paths)."""

    model_config = ConfigDict(frozen=True)

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    cert_reqs: Literal["required", "optional", "none"] = "required"
    check_hostname: bool = True

    def redis_py(self) -> dict[str, object]:
        """The keyword arguments of a redis-py TLS connection (``Redis(ssl=True, ...)`` adds ``ssl``; a ``rediss://``
        URL implies it)."""
        return {
            "ssl_ca_certs": self.ca_file,
            "ssl_certfile": self.cert_file,
            "ssl_keyfile": self.key_file,
            "ssl_cert_reqs": self.cert_reqs,
            # redis-py refuses a hostname check without certificate checks.
            "ssl_check_hostname": self.check_hostname and self.cert_reqs != "none",
        }

    def kombu(self) -> dict[str, object]:
        """kombu's ``broker_use_ssl`` for its Redis transport (the same check the pipeline's own clients make)."""
        options: dict[str, object] = {"ssl_cert_reqs": _CERT_REQS[self.cert_reqs]}
        for name, value in (("ssl_ca_certs", self.ca_file), ("ssl_certfile", self.cert_file)):
            if value:
                options[name] = value
        if self.key_file:
            options["ssl_keyfile"] = self.key_file
        return options


class SentinelTarget(BaseModel):
    """A ``redis+sentinel://`` / ``rediss+sentinel://`` URL's parts."""

    model_config = ConfigDict(frozen=True)

    sentinels: list[tuple[str, int]] = Field(min_length=1)
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: TlsOptions | None = None


def is_sentinel_url(url: str) -> bool:
    return url.startswith((SENTINEL_SCHEME + "://", TLS_SENTINEL_SCHEME + "://"))


def is_tls_url(url: str) -> bool:
    return urlsplit(url).scheme in TLS_SCHEMES


def tls_options(url: str, settings: RedisSettings | None = None) -> TlsOptions | None:
    """The TLS a client of ``url`` uses (``None`` for a plaintext URL): the URL's query parameters, else the files
    of ``settings``; certificate checks are on unless the URL says ``ssl_cert_reqs=none``."""
    if not is_tls_url(url):
        return None
    query = dict(parse_qsl(urlsplit(url).query))
    settings = settings or RedisSettings()
    reqs = query.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise ValueError(f"{mask_url(url)}: ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}, not {reqs!r}")
    hostname = query.get("ssl_check_hostname", "true").lower()
    if hostname not in _TRUE | _FALSE:
        raise ValueError(f"{mask_url(url)}: ssl_check_hostname must be true or false, not {hostname!r}")
    return TlsOptions(
        ca_file=query.get("ssl_ca_certs") or _path(settings.redis_tls_ca_file),
        cert_file=query.get("ssl_certfile") or _path(settings.redis_tls_cert_file),
        key_file=query.get("ssl_keyfile") or _path(settings.redis_tls_key_file),
        cert_reqs=reqs,  # type: ignore[arg-type]
        check_hostname=hostname in _TRUE,
    )


def _path(value: object | None) -> str | None:
    return str(value) if value else None


def parse_sentinel_url(url: str, settings: RedisSettings | None = None) -> SentinelTarget:
    """``redis+sentinel://[user:pass@]h:p,h:p/service[/db][?sentinel_username=..&sentinel_password=..]`` (or
    ``rediss+sentinel://`` with TLS query parameters) -> its parts; ``ValueError`` naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in (SENTINEL_SCHEME, TLS_SENTINEL_SCHEME):
        raise ValueError(f"not a {SENTINEL_SCHEME}:// or {TLS_SENTINEL_SCHEME}:// URL: {mask_url(url)!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for entry in hosts.split(","):
        host, sep, port = entry.strip().rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{mask_url(url)!r}: each Sentinel must be host:port, got {entry!r}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{mask_url(url)!r}: expected /service_name or /service_name/db after the Sentinels")
    query = dict(parse_qsl(parts.query))
    unknown = sorted(set(query) - _SENTINEL_PARAMS - _TLS_PARAMS)
    if unknown:
        known = ", ".join(sorted(_SENTINEL_PARAMS | _TLS_PARAMS))
        raise ValueError(f"{mask_url(url)!r}: unknown query parameter(s) {', '.join(unknown)}; known: {known}")
    if query.keys() & _TLS_PARAMS and parts.scheme == SENTINEL_SCHEME:
        raise ValueError(f"{mask_url(url)!r}: TLS parameters need the {TLS_SENTINEL_SCHEME}:// scheme")
    return SentinelTarget(
        sentinels=sentinels,
        service=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
        tls=tls_options(url, settings),
    )


def mask_url(url: str) -> str:
    """``url`` with its passwords (before ``@`` and ``sentinel_password=``) shown as ``***``: the form every log line
    and error message prints."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}{':***' if sep else ''}@{hosts}"
    query = "&".join(
        f"{name}={'***' if name.endswith('password') else quote(value, safe='/:.,-_')}"
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def username_of(url: str) -> str:
    """The ACL user a client of ``url`` connects as (``default`` when the URL names none)."""
    userinfo = urlsplit(url).netloc.rpartition("@")[0]
    return unquote(userinfo.partition(":")[0]) or "default"
