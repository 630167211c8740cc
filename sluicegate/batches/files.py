"""Stored files: contents through ``fsspec`` (a folder by default, any fsspec URL such as ``s3://bucket/prefix``
works), metadata in Redis, each file owned by one tenant. Blocking storage I/O runs in worker threads
(``anyio.to_thread``) so the event loop never waits on a disk or an object store.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import anyio.to_thread
import fsspec
from pydantic import BaseModel, ConfigDict
from redis.asyncio import Redis

from schemas import FileObject, Names
from sluicegate.settings import BatchApiSettings

_COPY_BUFFER = 1024 * 1024


class StoredFile(BaseModel):
    """A file's metadata as kept in Redis: the API object, its owner, where its bytes are, what it holds."""

    model_config = ConfigDict(extra="forbid")

    file: FileObject
    tenant: str
    path: str
    lines: int = 0
    endpoint: str | None = None


def new_file_id() -> str:
    """``file-`` and 24 random hex characters, as OpenAI's ids look."""
    return f"file-{secrets.token_hex(12)}"


def files_url(settings: BatchApiSettings) -> str:
    """The configured storage URL, or the ``files`` folder under the state folder."""
    return settings.files_url or str((settings.state_dir / "files").resolve())


class FileStore:
    """Files of every tenant: bytes in storage, metadata in Redis under :meth:`Names.file_key`."""

    def __init__(self, settings: BatchApiSettings, redis: Redis, names: Names) -> None:
        self.redis = redis
        self.names = names
        self.fs, self.root = fsspec.core.url_to_fs(files_url(settings))
        self._root_ready = False

    def path_for(self, file_id: str) -> str:
        """Where a file's bytes live in storage."""
        return f"{self.root.rstrip('/')}/{file_id}.jsonl"

    # --- blocking storage calls (run them through to_thread) --------------------------------------
    def _ensure_root(self) -> None:
        if not self._root_ready:
            self.fs.makedirs(self.root, exist_ok=True)
            self._root_ready = True

    def copy_in(self, source: IO[bytes], path: str) -> int:
        """Copy ``source`` (from its start) to ``path``; returns the bytes written. Blocking."""
        self._ensure_root()
        source.seek(0)
        with self.fs.open(path, "wb") as out:
            shutil.copyfileobj(source, out, _COPY_BUFFER)
        return int(self.fs.size(path))

    @contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """A binary writer for ``path`` (the object appears when the block ends). Blocking."""
        self._ensure_root()
        with self.fs.open(path, "wb") as out:
            yield out

    def open_read(self, path: str) -> IO[bytes]:
        """A binary reader for ``path``. Blocking."""
        handle: IO[bytes] = self.fs.open(path, "rb")
        return handle

    def size(self, path: str) -> int:
        """Bytes stored at ``path``. Blocking."""
        return int(self.fs.size(path))

    def remove(self, path: str) -> None:
        """Delete ``path`` if it exists. Blocking."""
        if self.fs.exists(path):
            self.fs.rm(path)

    # --- metadata ----------------------------------------------------------------------------------
    async def register(self, stored: StoredFile) -> None:
        """Record a file's metadata and list it under its tenant (idempotent: same id, same entry)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.names.file_key(stored.file.id), stored.model_dump_json())
            pipe.zadd(self.names.files_index_key(stored.tenant), {stored.file.id: stored.file.created_at})
            await pipe.execute()

    async def get(self, file_id: str, tenant: str) -> StoredFile | None:
        """The file if it exists and belongs to ``tenant`` (another tenant's file is as absent as a missing one)."""
        raw = await self.redis.get(self.names.file_key(file_id))
        if raw is None:
            return None
        stored = StoredFile.model_validate_json(raw)
        return stored if stored.tenant == tenant else None

    async def list(
        self, tenant: str, *, after: str | None, limit: int, purpose: str | None
    ) -> tuple[list[FileObject], bool]:
        """The tenant's files, newest first, after the id ``after``; and whether more follow."""
        ids = [i.decode() for i in await self.redis.zrevrange(self.names.files_index_key(tenant), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        found: list[FileObject] = []
        for start in range(0, len(ids), 100):
            raws = await self.redis.mget([self.names.file_key(i) for i in ids[start : start + 100]])
            for raw in raws:
                if raw is None:
                    continue
                stored = StoredFile.model_validate_json(raw)
                if purpose is None or stored.file.purpose == purpose:
                    found.append(stored.file)
            if len(found) > limit:
                break
        return found[:limit], len(found) > limit

    async def delete(self, stored: StoredFile) -> None:
        """Forget a file and delete its bytes."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.names.file_key(stored.file.id))
            pipe.zrem(self.names.files_index_key(stored.tenant), stored.file.id)
            await pipe.execute()
        await anyio.to_thread.run_sync(self.remove, stored.path)

    async def read_all(self, stored: StoredFile) -> bytes:
        """A file's whole content (output files and inputs are read back whole by ``/content``)."""

        def read() -> bytes:
            with self.open_read(stored.path) as handle:
                return handle.read()

        return await anyio.to_thread.run_sync(read)


def file_object(file_id: str, *, size: int, filename: str, purpose: Any) -> FileObject:
    """A processed file's API object, created now."""
    return FileObject(id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose=purpose)
