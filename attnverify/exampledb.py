"""One example database for every shard, runner and developer: `--attn-db URL`.

Hypothesis's own backends, layered with the local folder (.hypothesis/attnverify) by
`MultiplexedDatabase`, so a failure saved by any shard is replayed first by every later run that
reaches the same (property, adapter) search, here or anywhere else pointed at the same store:

    redis://HOST:PORT/N          RedisExampleDatabase (pip install 'attnverify[redis]'), read and written
    github:OWNER/REPO[/ARTIFACT] GitHubArtifactDatabase (read only: the artifact a CI workflow uploads;
                                 ARTIFACT defaults to Hypothesis's "hypothesis-example-db")

Without --attn-db the profiles' local folder is the only database. Nothing connects at import; the
Redis client connects on first use.
"""
from __future__ import annotations

from typing import Optional

LOCAL = "local"


class DatabaseError(ValueError):
    """An --attn-db value that names no backend we know, or a backend whose library is missing."""


def _local():
    from .properties.profiles import example_database

    return example_database()


def shared_database(url: str, source: str = "--attn-db"):
    """The shared backend alone (no local layer) for `url`."""
    url = str(url).strip()
    if url.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError:
            raise DatabaseError(f"{source}={url!r}: the redis client is not installed; "
                                "pip install 'attnverify[redis]' (or: pip install redis)") from None
        try:
            client = redis.Redis.from_url(url)
        except ValueError as e:
            raise DatabaseError(f"{source}={url!r}: {e}; give redis://HOST:PORT/DB (e.g. redis://127.0.0.1:6379/0)") \
                from None
        return RedisExampleDatabase(client, key_prefix=b"attnverify")
    if url.startswith("github:"):
        parts = [p for p in url[len("github:"):].split("/") if p]
        if len(parts) not in (2, 3):
            raise DatabaseError(f"{source}={url!r}: give github:OWNER/REPO or github:OWNER/REPO/ARTIFACT")
        from hypothesis.database import GitHubArtifactDatabase, ReadOnlyDatabase

        kw = {"artifact_name": parts[2]} if len(parts) == 3 else {}
        return ReadOnlyDatabase(GitHubArtifactDatabase(parts[0], parts[1], **kw))
    raise DatabaseError(f"{source}={url!r}: give redis://HOST:PORT/DB or github:OWNER/REPO[/ARTIFACT]")


def open_database(url: Optional[str], source: str = "--attn-db"):
    """The database a run passes to Hypothesis: `...` (the profile's local folder) without a URL, else the
    local folder and the shared backend multiplexed (reads from both, writes to both)."""
    if url is None or str(url).strip() == "":
        return ...
    from hypothesis.database import MultiplexedDatabase

    return MultiplexedDatabase(_local(), shared_database(url, source))
