"""Models by Hugging Face hub id: resolve `org/name` (or `org/name:QUANT` for one GGUF file) to a folder or file in
the standard HF cache, downloading what serving needs when it is missing and allowed. All of the hub protocol and
the cache layout is huggingface_hub's; this module picks the files and turns its errors into one-line ValueErrors.

Resolution order (vLLM's): an existing local path is used as it is; otherwise the id is looked up in the cache
(`HF_HOME` / `HF_HUB_CACHE`, or `--download-dir`) and fetched from the hub unless `HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from vserve.core.config import EngineConfig

# Weights vserve never loads: pickle can run code when unpickled (also from the hub).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt", "merges.txt")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")  # org/name (the hub's bare legacy names redirect)


@dataclass(frozen=True)
class HubModel:
    """A hub reference as typed: `org/name`, optionally `:QUANT` (one GGUF file of the repo)."""

    repo_id: str
    quant: str | None = None

    @classmethod
    def parse(cls, model: str) -> HubModel | None:
        """The hub id in `model`, or None when it cannot be one (a path such as ./x, /x, ~/x, x, a/b/c, x.gguf)."""
        repo, _, quant = model.partition(":")
        if model.startswith((".", "/", "~")) or repo.endswith(".gguf") or not _REPO_ID.match(repo) or "--" in repo:
            return None
        if quant and not re.fullmatch(r"[\w.\-]+", quant):
            return None
        return cls(repo, quant or None)


def is_local(model: str) -> bool:
    return Path(model).expanduser().exists()


def _hub_id(model: str | None) -> bool:
    """Whether `model` is to be looked up on the hub: not a local path, and shaped as a hub id (a missing path
    such as ./x or /x is left to the loader's 'does not exist')."""
    return bool(model) and not is_local(model) and HubModel.parse(model) is not None


def resolve_model_files(config: EngineConfig) -> EngineConfig:
    """The config with `model` and `tokenizer` as local paths (hub ids resolved, downloaded if allowed); the
    same object when both already are local (or unset)."""
    changes = {}
    if _hub_id(config.model):
        changes["model"] = str(resolve(config.model, revision=config.revision, download_dir=config.download_dir,
                                       token=config.hf_token, gguf_file=config.gguf_file,
                                       weights=config.load_format != "dummy"))
        changes["gguf_file"] = None  # now part of the path
    elif config.gguf_file:
        raise ValueError("--gguf-file picks a file of a hub repo; for a local model pass the .gguf path as the model")
    if _hub_id(config.tokenizer):
        changes["tokenizer"] = str(resolve(config.tokenizer, revision=config.tokenizer_revision,
                                           download_dir=config.download_dir, token=config.hf_token, weights=False))
    if not changes:
        return config
    resolved = replace(config, **changes)
    resolved.sources = {**config.sources, **{k: f"{config.sources.get(k, 'flag')} ({getattr(config, k)})"
                                               for k in changes if k != "gguf_file"}}
    return resolved


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir(download_dir: str | None = None) -> Path:
    from huggingface_hub import constants

    return Path(download_dir or constants.HF_HUB_CACHE).expanduser()


def resolve(model: str, *, revision: str | None = None, download_dir: str | None = None, token: str | None = None,
            gguf_file: str | None = None, weights: bool = True) -> Path:
    """A local path for `model`: the snapshot folder, or the GGUF file in it. weights=False: config, tokenizer and
    chat template only (a tokenizer repo, or `--load-format dummy`)."""
    ref = HubModel.parse(model)
    if ref is None:
        raise ValueError(f"model path {model!r} does not exist (and is not a Hugging Face hub id such as org/name)")
    if ref.quant and gguf_file:
        raise ValueError(f"give the GGUF file once: {model!r} names a quantization and --gguf-file {gguf_file!r} too")
    gguf = gguf_file or ref.quant
    revision = revision or "main"
    cache = cache_dir(download_dir)
    if _offline():
        return _from_cache(ref, revision, cache, gguf, weights)
    return _download(ref, revision, cache, token, gguf, weights)


def _hub_error(e: Exception, repo_id: str, revision: str) -> ValueError:
    """huggingface_hub's exception -> one line saying what happened and what to do."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, RevisionNotFoundError):
        return ValueError(f"revision {revision!r} not found in {repo_id!r}; pass an existing branch, tag or commit "
                          f"with --revision")
    if isinstance(e, GatedRepoError):
        return ValueError(f"{repo_id!r} is a gated model (HTTP {status}): accept the license on the model page "
                          f"(https://huggingface.co/{repo_id}) and set HF_TOKEN (or --hf-token) to a token with access")
    if status in (401, 403):  # the hub answers 401 for private and gated repos, and for missing ones without a token
        return ValueError(f"the hub refused {repo_id!r} (HTTP {status}): for a gated model accept the license on the "
                          f"model page (https://huggingface.co/{repo_id}) and set HF_TOKEN (or --hf-token) to a token "
                          f"with access; otherwise check the id")
    if isinstance(e, RepositoryNotFoundError):
        return ValueError(f"model {repo_id!r} is neither a local path nor a repo on the Hugging Face hub; check the "
                          f"id (org/name)")
    return ValueError(f"cannot reach the Hugging Face hub for {repo_id!r} ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]}), and it is not in the cache; retry, or set HF_HUB_OFFLINE=1 "
                      f"to use cached models only")


def _from_cache(ref: HubModel, revision: str, cache: Path, gguf: str | None, weights: bool) -> Path:
    """The model from the cache alone (HF_HUB_OFFLINE=1, or the hub unreachable), complete, or ValueError."""
    folder = _cached_snapshot(ref.repo_id, revision, cache)
    files = {p.relative_to(folder).as_posix(): None for p in folder.rglob("*") if p.is_file()}
    try:
        chosen = select_files(ref.repo_id, files, gguf, weights, _index_from(folder))
    except ValueError:
        if any(f.endswith((".safetensors", ".gguf", *PICKLE_SUFFIXES)) for f in files):
            raise  # e.g. only pickled weights: the reason is the repo, not the cache
        chosen = []
    missing = [f for f in chosen if not (folder / f).exists()]  # an index's shards not all there
    if missing or not chosen:
        raise ValueError(f"{ref.repo_id!r} (revision {revision}) is only partly in the Hugging Face cache {cache} "
                         f"(missing {', '.join(missing[:3]) or 'its weights'}) and HF_HUB_OFFLINE=1 forbids "
                         f"downloading; run `vserve download {ref.repo_id}{':' + ref.quant if ref.quant else ''}` "
                         f"where the hub can be reached")
    return _result(folder, chosen, gguf)


def _cached_snapshot(repo_id: str, revision: str, cache: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ValueError(f"{repo_id!r} (revision {revision}) is not in the Hugging Face cache {cache} and "
                         f"HF_HUB_OFFLINE=1 forbids downloading it; run `vserve download {repo_id}` where the hub "
                         f"can be reached, or unset HF_HUB_OFFLINE") from None


def _download(ref: HubModel, revision: str, cache: Path, token: str | None, gguf: str | None, weights: bool) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download, try_to_load_from_cache

    repo_id = ref.repo_id
    try:
        info = HfApi(token=token).model_info(repo_id, revision=revision, files_metadata=True)
        files = {s.rfilename: s.size for s in info.siblings or []}
        index = None
        if weights and not gguf and "model.safetensors.index.json" in files:
            index = Path(hf_hub_download(repo_id, "model.safetensors.index.json", revision=info.sha,
                                         cache_dir=str(cache), token=token, tqdm_class=_hf_tqdm()))
        chosen = select_files(repo_id, files, gguf, weights, _index_from(index.parent) if index else None)
        need = sum(files.get(f) or 0 for f in chosen
                   if not isinstance(try_to_load_from_cache(repo_id, f, cache_dir=str(cache), revision=info.sha), str))
        free = free_bytes(cache)
        if need > free:
            raise ValueError(f"not enough disk space for {repo_id!r}: its files need {_gb(need)}, {cache} has "
                             f"{_gb(free)} free; free some space or pass --download-dir on a larger disk")
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), token=token,
                                        allow_patterns=[_literal(f) for f in chosen], tqdm_class=_hf_tqdm()))
    except ValueError:
        raise
    except Exception as e:  # HfHubHTTPError, OSError, and the HTTP client's connection errors
        try:  # the hub is down or unreachable: a complete cached snapshot still serves, as huggingface_hub does
            return _from_cache(ref, revision, cache, gguf, weights)
        except ValueError:
            raise _hub_error(e, repo_id, revision) from None
    return _result(folder, chosen, gguf)


def _hf_tqdm():
    """huggingface_hub's progress bars: its own (None) where vserve shows bars, else a class that shows none
    (VSERVE_NO_PROGRESS=1: nothing on stderr but a failure's one error line)."""
    from vserve.ops import progress

    if progress.enabled():
        return None
    from huggingface_hub.utils.tqdm import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return Quiet


def _result(folder: Path, chosen: list[str], gguf: str | None) -> Path:
    return folder / chosen[0] if gguf else folder


def _literal(name: str) -> str:
    """An allow_patterns entry (fnmatch) that matches exactly this file name."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _index_from(folder: Path | None) -> list[str] | None:
    index = folder / "model.safetensors.index.json" if folder else None
    if index is None or not index.exists():
        return None
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds `path` (or its nearest existing parent)."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _is_meta(name: str) -> bool:
    """Config, tokenizer, chat template and generation config: what serving needs besides the weights."""
    parts = PurePosixPath(name).parts
    base = parts[-1]
    if len(parts) > 2 or (len(parts) == 2 and base != "config.json"):  # 1_Pooling/config.json (embedding models)
        return False
    return base.endswith((".json", ".jinja", ".tiktoken")) or base in TOKENIZER_FILES


def select_files(repo_id: str, files: dict[str, int | None], gguf: str | None, weights: bool,
                 index: list[str] | None) -> list[str]:
    """The repo files serving needs (GGUF: the one file, first), or ValueError saying why the repo cannot serve."""
    if gguf:
        return [_pick_gguf(repo_id, [f for f in files if f.endswith(".gguf")], gguf)]
    meta = sorted(f for f in files if _is_meta(f))
    if not weights:
        return meta
    if "config.json" not in files:
        ggufs = [f for f in files if f.endswith(".gguf")]
        if ggufs:
            raise ValueError(f"{repo_id!r} holds GGUF files only: pick one with --gguf-file NAME or "
                             f"{repo_id}:QUANT (it has {', '.join(_quants(ggufs))})")
        raise ValueError(f"{repo_id!r} has no config.json: it is not a transformers model repo")
    top = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    if index is not None:
        shards = index
    elif any(not f.startswith("consolidated") for f in top):  # Mistral repos also ship consolidated.safetensors
        shards = [f for f in top if not f.startswith("consolidated")]
    else:
        shards = top
    if not shards:
        pickled = [f for f in files if f.endswith(PICKLE_SUFFIXES) and "/" not in f]
        what = f"only pickled weights ({', '.join(sorted(pickled)[:3])})" if pickled else "no weights"
        raise ValueError(f"{repo_id!r} has {what}; vserve loads safetensors or GGUF only (pickle can run code when "
                         f"loaded): convert it with transformers (`AutoModelForCausalLM.from_pretrained(...)"
                         f".save_pretrained(DIR, safe_serialization=True)`) and serve DIR, or use a safetensors repo")
    return meta + sorted(shards)


def _quants(ggufs: list[str]) -> list[str]:
    found = {m.group(1) for f in ggufs if (m := re.search(r"[-_.]((?:I?Q\d|F16|BF16|F32)[\w]*?)(?:-\d{5}-of-\d{5})?"
                                                              r"\.gguf$", f, re.I))}
    return sorted(found) or sorted(ggufs)


def _pick_gguf(repo_id: str, ggufs: list[str], want: str) -> str:
    exact = [f for f in ggufs if f == want or PurePosixPath(f).name == want]
    if exact:
        matches = exact
    else:
        pattern = re.compile(rf"(^|[-_./]){re.escape(want)}([-_.]|$)", re.I)
        matches = [f for f in ggufs if pattern.search(PurePosixPath(f).name.removesuffix(".gguf"))]
    if not matches:
        have = ", ".join(_quants(ggufs)) if ggufs else "no .gguf files"
        raise ValueError(f"{repo_id!r} has no GGUF file matching {want!r} (it has {have})")
    if all(_SPLIT_GGUF.search(f) for f in matches):
        raise ValueError(f"{repo_id!r} splits {want} over {len(matches)} GGUF files; vserve loads one file: merge them "
                         f"with llama.cpp's `llama-gguf-split --merge` and serve the merged file")
    single = [f for f in matches if not _SPLIT_GGUF.search(f)]
    if len(single) > 1:
        raise ValueError(f"{repo_id!r} has several GGUF files matching {want!r} ({', '.join(single)}); name one "
                         f"with --gguf-file")
    return single[0]


def config_file(model: str, *, revision: str | None = None, download_dir: str | None = None,
                token: str | None = None) -> Path:
    """A hub model's config.json, from the cache or (online) that one file downloaded: enough to plan memory
    before any weights are fetched."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    ref = HubModel.parse(model)
    if ref is None:
        raise ValueError(f"model {model!r} is not a local path nor a hub id (org/name)")
    if ref.quant:
        raise ValueError(f"{model!r} is a GGUF file of a hub repo: its shape is in the file; plan it after "
                         f"`vserve download {model}`, with the path that prints")
    cache, revision = cache_dir(download_dir), revision or "main"
    cached = try_to_load_from_cache(ref.repo_id, "config.json", cache_dir=str(cache), revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if _offline():
        raise ValueError(f"{ref.repo_id!r} (revision {revision}) has no config.json in the Hugging Face cache {cache} "
                         f"and HF_HUB_OFFLINE=1 forbids downloading it")
    try:
        return Path(hf_hub_download(ref.repo_id, "config.json", revision=revision, cache_dir=str(cache), token=token,
                                    tqdm_class=_hf_tqdm()))
    except Exception as e:  # HfHubHTTPError, OSError, the HTTP client's connection errors
        raise _hub_error(e, ref.repo_id, revision) from None


@dataclass(frozen=True)
class DownloadPlan:
    files: dict[str, int]  # what serving needs: name -> bytes
    missing_bytes: int  # of those, not yet in the cache
    free_bytes: int
    cache: Path


def download_plan(model: str, *, revision: str | None = None, download_dir: str | None = None,
                  token: str | None = None) -> DownloadPlan:
    """What `vserve serve MODEL` would download (from the hub's file metadata) and the free disk it lands on."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    ref = HubModel.parse(model)
    assert ref is not None
    cache, revision = cache_dir(download_dir), revision or "main"
    try:
        info = HfApi(token=token).model_info(ref.repo_id, revision=revision, files_metadata=True)
    except Exception as e:
        raise _hub_error(e, ref.repo_id, revision) from None
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    chosen = select_files(ref.repo_id, sizes, ref.quant, True, None)  # shards as listed, without their index
    missing = sum(sizes[f] for f in chosen
                  if not isinstance(try_to_load_from_cache(ref.repo_id, f, cache_dir=str(cache), revision=info.sha),
                                    str))
    return DownloadPlan({f: sizes[f] for f in chosen}, missing, free_bytes(cache), cache)


def download(model: str, *, revision: str | None = None, download_dir: str | None = None, token: str | None = None,
             gguf_file: str | None = None, weights: bool = True) -> Path:
    """`vserve download`: fetch into the cache (not when already there) and return the local path."""
    if is_local(model):
        raise ValueError(f"{model!r} is a local path already; `vserve download` takes a hub id (org/name)")
    return resolve(model, revision=revision, download_dir=download_dir, token=token, gguf_file=gguf_file,
                   weights=weights)
