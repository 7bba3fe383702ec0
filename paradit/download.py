"""``paradit download`` (only the files the loader reads, if the disk has room) and ``paradit models --local``."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from paradit.checkpoint import MODEL_INDEX, pipeline_patterns, read_json
from paradit.errors import ParaditError
from paradit.families import PRESETS
from paradit.hub import hub_offline, quiet_retries


class DownloadError(ParaditError):
    """A download that cannot start or did not finish: gated or missing repository, no space, hub unreachable."""


def hub_id(model: str) -> str:
    if model in PRESETS:
        if PRESETS[model].hub_id is None:
            raise DownloadError(f"{model} has random weights only: there is no checkpoint to download")
        return PRESETS[model].hub_id
    if Path(model).expanduser().exists():
        raise DownloadError(f"{model} is on disk already: give a preset or a hub id (org/name) to download")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return model
    published = ", ".join(name for name, spec in PRESETS.items() if spec.hub_id is not None)
    raise DownloadError(f"{model!r} is neither a preset with a checkpoint ({published}) nor a hub id (org/name)")


def count_files(files: dict) -> str:
    return f"{len(files)} file{'' if len(files) == 1 else 's'} ({human_size(sum(files.values()))})"


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"


@contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """huggingface_hub's errors as one line that says what to do."""
    import httpx2
    from huggingface_hub import constants, get_token
    from huggingface_hub import errors as hub

    page = f"{constants.ENDPOINT}/{repo_id}"
    try:
        with quiet_retries():
            yield
    except hub.GatedRepoError:
        if get_token() is None:
            raise DownloadError(
                f"{repo_id} is gated: accept its licence at {page}, then log in (`hf auth login`) or set HF_TOKEN"
            ) from None
        raise DownloadError(f"{repo_id} is gated and this token has no access yet: request it at {page}") from None
    except hub.HFValidationError as exc:  # a name the hub cannot have, said in the hub's words
        raise DownloadError(f"{repo_id!r} is not a hub id (org/name): {exc}") from None
    except hub.RepositoryNotFoundError:
        raise DownloadError(
            f"no model {repo_id} on the hub ({page}); if it is private, log in (`hf auth login`) or set HF_TOKEN"
        ) from None
    except hub.RemoteEntryNotFoundError:
        raise DownloadError(f"{repo_id} has no {MODEL_INDEX}: it is not a diffusers pipeline paradit loads") from None
    except hub.HfHubHTTPError as exc:
        reason = str(exc).strip().splitlines()[0]
        raise DownloadError(f"the hub answered {exc.response.status_code} for {repo_id}: {reason}") from None
    except (hub.LocalEntryNotFoundError, httpx2.TransportError) as exc:
        raise DownloadError(f"could not reach the hub at {constants.ENDPOINT} ({type(exc).__name__})") from None
    except OSError as exc:  # the target folder: not writable, or the disk filled up during the download
        raise DownloadError(f"cannot write {exc.filename or 'the download'}: {exc.strerror or exc}") from None


def download(model: str, local_dir: str | Path | None = None) -> Path:
    """A preset's or hub id's checkpoint, into ``local_dir`` or the hub cache (where ``--model`` then finds it)."""
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects, validate_repo_id

    repo_id = hub_id(model)
    if constants.is_offline_mode():
        raise DownloadError("HF_HUB_OFFLINE is set: unset it to download from the hub")
    folder = None if local_dir is None else Path(local_dir).expanduser().resolve()
    target = folder if folder is not None else Path(constants.HF_HUB_CACHE)
    with hub_errors(repo_id):
        validate_repo_id(repo_id)  # a name the hub cannot have is said as such, not as an unreachable hub
        if hub_offline():
            raise DownloadError(f"could not reach the hub at {constants.ENDPOINT}")
        patterns = pipeline_patterns(read_json(Path(hf_hub_download(repo_id, MODEL_INDEX, local_dir=folder))))
        tree = HfApi().list_repo_tree(repo_id, recursive=True)
        sizes = {entry.path: entry.size for entry in tree if isinstance(entry, RepoFile)}
        selected = set(filter_repo_objects(sizes, **patterns))
        quiet = functools.partial(tqdm, disable=True)  # a dry run's bars would show a download that does not happen
        preview = snapshot_download(repo_id, **patterns, local_dir=folder, dry_run=True, tqdm_class=quiet)
    reads = {path: size for path, size in sizes.items() if path in selected}
    skips = {path: size for path, size in sizes.items() if path not in selected}
    to_fetch = {file.filename: sizes[file.filename] for file in preview if file.will_download}
    free = shutil.disk_usage(next(path for path in [target, *target.parents] if path.exists())).free
    print(f"{repo_id}: {count_files(reads)} the pipeline reads; skipping {count_files(skips)}")
    fetching = f"fetching {count_files(to_fetch)} into {target} ({human_size(free)} free)"
    print(fetching if to_fetch else f"all of them are already in {target}", flush=True)
    if (needed := sum(to_fetch.values())) > free:
        raise DownloadError(
            f"not enough disk space for {repo_id}: {human_size(needed)} to fetch into {target}, "
            f"{human_size(free)} free there; make room or choose another disk with --dir"
        )
    with hub_errors(repo_id):
        written = Path(snapshot_download(repo_id, **patterns, local_dir=folder))
    print(f"{written}: run it with --model {local_dir if local_dir is not None else model}")
    return written


@dataclass(frozen=True)
class LocalModel:
    """A checkpoint on disk: ``name`` is what ``--model`` takes for it (a preset, a hub id or the folder)."""

    name: str
    size: int
    path: Path


def local_models(folders: Sequence[str | Path] = ()) -> list[LocalModel]:
    """The pipelines in the hub cache, then the checkpoint folders among ``folders`` and their sub-folders."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    presets = {spec.hub_id: name for name, spec in PRESETS.items() if spec.hub_id is not None}
    try:
        repos = sorted(scan_cache_dir().repos, key=lambda repo: repo.repo_id)
    except CacheNotFound:
        repos = []
    found = [
        LocalModel(presets.get(repo.repo_id, repo.repo_id), repo.size_on_disk, repo.repo_path)
        for repo in repos
        if repo.repo_type == "model"
        and any((revision.snapshot_path / MODEL_INDEX).is_file() for revision in repo.revisions)
    ]
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise DownloadError(f"--dir {folder} is not a folder")
        candidates = [folder] if (folder / MODEL_INDEX).is_file() else sorted(folder.iterdir())
        checkpoints = [path for path in candidates if (path / MODEL_INDEX).is_file()]
        found += [LocalModel(str(path), checkpoint_bytes(path), path) for path in checkpoints]
    return found


def checkpoint_bytes(folder: Path) -> int:
    """The size of a checkpoint folder's files, without hidden ones (huggingface_hub's ``.cache/``, ``.git/``)."""
    files = (path.relative_to(folder) for path in folder.rglob("*") if path.is_file())
    return sum((folder / file).stat().st_size for file in files if not any(part.startswith(".") for part in file.parts))


def format_local_models(models: list[LocalModel]) -> str:
    from huggingface_hub import constants

    if not models:
        return f"no checkpoints on disk (hub cache: {constants.HF_HUB_CACHE})"
    width = max(len(model.name) for model in models)
    return "\n".join(f"{model.name:<{width}}  {human_size(model.size):>10}  {model.path}" for model in models)
