"""The web origins whose pages may call Sluicegate's HTTP APIs from a browser: ingress's API (POST a request, the
OpenAI endpoints) and the result service's Server-Sent Events relay allow the same ones, so a page that may submit a
request may also follow its stream."""

from __future__ import annotations

from urllib.parse import urlsplit

from sluicegate.settings import PublicApiSettings, comma_separated


def browser_origins(settings: PublicApiSettings) -> list[str]:
    """The result service (which serves the chat page) on the local hosts and at its public address, plus
    ``cors_origins``."""
    origins = [f"http://{host}:{settings.result_port}" for host in ("127.0.0.1", "localhost")]
    public = urlsplit(settings.public_stream_url)
    if public.scheme in ("ws", "wss", "http", "https") and public.netloc:
        origins.append(f"{'https' if public.scheme in ('wss', 'https') else 'http'}://{public.netloc}")
    origins += [origin.rstrip("/") for origin in comma_separated(settings.cors_origins)]
    return list(dict.fromkeys(origins))
