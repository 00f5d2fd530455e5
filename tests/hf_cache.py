"""Place a model folder in a Hugging Face cache as huggingface_hub lays it out (for tests that run offline).

`models--org--name/blobs/<hash>` holds each file once; `snapshots/<commit>/<path>` are relative symlinks to the
blobs; `refs/<revision>` holds the commit hash. Regular files are named by their git blob SHA-1 and large (LFS)
files by their SHA-256, as on the hub.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def blob_name(data: bytes, name: str) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def put_in_hf_cache(folder: Path, cache: Path, repo_id: str, revision: str = "main", commit: str | None = None,
                    only: tuple[str, ...] | None = None) -> Path:
    """Cache `folder`'s files (or `only` those) as `repo_id` at `revision`; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in folder.rglob("*") if p.is_file() and (only is None or p.name in only))
    if commit is None:
        commit = hashlib.sha1(b"".join(p.name.encode() for p in files) + revision.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for p in files:
        rel = p.relative_to(folder)
        data = p.read_bytes()
        blob = repo / "blobs" / blob_name(data, p.name)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot
