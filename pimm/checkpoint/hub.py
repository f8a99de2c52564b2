"""Weights on the Hugging Face Hub: `hf://owner/name[@revision][/path/in/repo.pth]` -> a local path.

Downloads go through huggingface_hub into its cache (HF_HOME, HF_HUB_CACHE) and follow its offline
mode (HF_HUB_OFFLINE=1: the cache only). Without a file, the whole snapshot's weights and JSON files
are fetched and the directory is returned (pimm.checkpoint.weights.resolve_weight_path picks the
weights in it); with a file, that file alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pimm.checkpoint.layout import CheckpointError

HF_SCHEME = "hf://"
SNAPSHOT_PATTERNS = ["*.safetensors", "*.pth", "*.json"]  # what a snapshot without a named file fetches
_FORM = "hf://owner/name, hf://owner/name@revision or hf://owner/name[@revision]/file.pth"


def is_hub_path(path: object) -> bool:
    return isinstance(path, str) and path.startswith(HF_SCHEME)


@dataclass(frozen=True)
class HubWeights:
    """Where `hf://` weights are: a model repository, a revision (None: main), a file (None: the snapshot)."""

    repo_id: str
    revision: str | None
    filename: str | None

    @classmethod
    def parse(cls, uri: str) -> HubWeights:
        parts = uri[len(HF_SCHEME):].split("/")
        owner, name_rev, filename = parts[0], parts[1] if len(parts) > 1 else "", "/".join(parts[2:])
        name, _, revision = name_rev.partition("@")
        if not owner or not name or ("@" in name_rev and not revision) or (len(parts) > 2 and not filename.strip()):
            raise CheckpointError(f"weights path {uri!r} is not a Hugging Face address; write it as {_FORM}")
        return cls(f"{owner}/{name}", revision or None, filename or None)

    def __str__(self) -> str:
        revision = f"@{self.revision}" if self.revision else ""
        return f"{HF_SCHEME}{self.repo_id}{revision}" + (f"/{self.filename}" if self.filename else "")


def fetch_hub_weights(uri: str, download: bool = True) -> Path:
    """The local path of `uri` (a file, or a snapshot directory), downloaded into the Hugging Face cache
    when `download` and the Hub is reachable and not disabled (HF_HUB_OFFLINE); the cache only
    otherwise. CheckpointError, saying what to do, when it cannot be had."""
    # deferred: huggingface_hub (and its HTTP stack) only for hf:// weights
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = HubWeights.parse(uri)
    revision = where.revision or constants.DEFAULT_REVISION
    offline = constants.is_offline_mode()
    try:
        if where.filename:
            local = hf_hub_download(where.repo_id, where.filename, revision=revision,
                                    local_files_only=not download)
        else:
            local = snapshot_download(where.repo_id, revision=revision, allow_patterns=SNAPSHOT_PATTERNS,
                                      local_files_only=not download)
    except LocalEntryNotFoundError as exc:
        if download and not offline:  # the Hub did not answer and nothing is cached
            raise CheckpointError(f"cannot fetch {where}: the Hugging Face Hub could not be reached and the cache "
                                  f"({constants.HF_HUB_CACHE}) does not hold it ({_first_line(exc)}); check the "
                                  "network, or download it where the Hub is reachable into the same HF_HOME") from None
        why = ("HF_HUB_OFFLINE=1 keeps pimm from downloading it" if offline else
               "the ranks read hf:// weights from the cache that `pimm launch` filled before they started")
        or_online = ", or unset HF_HUB_OFFLINE" if offline else " (on every node, if their caches differ)"
        raise CheckpointError(
            f"{where} is not in the Hugging Face cache {constants.HF_HUB_CACHE}, and {why}: download it once "
            f"where the Hub is reachable (`hf download {where.repo_id}"
            f"{f' {where.filename}' if where.filename else ''} --revision {revision}` with the same HF_HOME or "
            f"HF_HUB_CACHE){or_online} ({_first_line(exc)})"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}: the repository {where.repo_id} has no revision {revision!r}; give a branch, "
                              "tag or commit it has") from None
    except GatedRepoError:
        raise CheckpointError(f"{where}: the repository {where.repo_id} is gated; accept its terms on "
                              "huggingface.co and log in with `hf auth login` (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{where}: no model repository {where.repo_id} on the Hugging Face Hub (or it is "
                              "private: log in with `hf auth login` or set HF_TOKEN)") from None
    except EntryNotFoundError:
        raise CheckpointError(f"{where}: the repository {where.repo_id} at {revision} has no file "
                              f"{where.filename!r}; give a file it has, or leave the file out for its snapshot"
                              ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointError(f"cannot fetch {where}: {type(exc).__name__}: {_first_line(exc)}") from None
    return Path(local)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{text.splitlines()[0]:.200}" if text else type(exc).__name__
