"""A model's ``config.json`` from the Hugging Face Hub, for a repo id that is not a preset.

Read with ``huggingface_hub`` (the optional ``hub`` extra), which caches what it downloads and honours
``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and a token for gated repos (``HF_TOKEN`` or ``hf auth login``).
Nothing is downloaded at import: only `model_from_hub`, when asked for a repo id no preset names.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import SpecError

if TYPE_CHECKING:
    from .spec import ModelSpec

__all__ = ["is_repo_id", "model_from_hub"]

#: A Hub repo id: ``owner/name`` (letters, digits, ``-_.``), as huggingface_hub validates it.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")

_LOCAL = "download its config.json and pass it with --hf-config PATH (hf_config= in Python)"


def is_repo_id(name: str) -> bool:
    """Does `name` look like a Hub repo id (``owner/name``)?"""
    return bool(_REPO_ID.match(name.strip()))


#: How long `model_from_hub` waits to open a connection to the Hub before it reads huggingface_hub's cache
#: alone (this project's choice: a reachable Hub answers in well under a second)
HUB_CONNECT_TIMEOUT_S = 3.0


def _reachable(url: str) -> bool:
    """Does a TCP connection to `url`'s host open within `HUB_CONNECT_TIMEOUT_S` (for each address its name
    resolves to)? Behind a proxy (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``: the client would use it) the
    answer is left to the client: yes."""
    import socket
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    if not parts.hostname or proxies.get(parts.scheme) or proxies.get("all"):  # HTTPS_PROXY, ALL_PROXY
        return True
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname, port), timeout=HUB_CONNECT_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def model_from_hub(repo_id: str, revision: str | None = None) -> ModelSpec:
    """The `ModelSpec` of `repo_id`'s ``config.json`` on the Hub (or in huggingface_hub's cache); every
    failure is one line saying what happened and how to estimate anyway."""
    from .spec import ModelSpec

    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise SpecError(f"model={repo_id!r} is not a preset; reading its config.json from the Hugging Face Hub needs "
                        f"the hub extra (pip install \"trainmem_nb[hub]\"), or {_LOCAL}") from None
    where = constants.ENDPOINT
    # huggingface_hub retries a Hub it cannot reach for about 24 s (five backoffs) before it reads its cache:
    # one quick connection first, and the cache alone when it fails
    cache_only = not constants.HF_HUB_OFFLINE and not _reachable(where)
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=cache_only)
    except (hub_errors.OfflineModeIsEnabled, hub_errors.LocalEntryNotFoundError):
        offline = constants.HF_HUB_OFFLINE
        reason = "HF_HUB_OFFLINE is set and it is not in the cache" if offline else f"{where} cannot be reached"
        raise SpecError(f"model={repo_id!r} is not a preset and its config.json cannot be read: {reason}; {_LOCAL}") from None
    except hub_errors.GatedRepoError:
        raise SpecError(f"model={repo_id!r} is a gated repository on {where}: accept its terms on its page, then log in "
                        f"(hf auth login) or set HF_TOKEN; or {_LOCAL}") from None
    except hub_errors.RepositoryNotFoundError:
        raise SpecError(f"model={repo_id!r} is neither a preset nor a repository on {where} (a private one needs "
                        f"HF_TOKEN); see `trainmem presets`, or {_LOCAL}") from None
    except hub_errors.RevisionNotFoundError:
        raise SpecError(f"model={repo_id!r} has no revision {revision!r} on {where}") from None
    except hub_errors.EntryNotFoundError:
        raise SpecError(f"model={repo_id!r} on {where} has no config.json; {_LOCAL}") from None
    except hub_errors.HfHubHTTPError as exc:
        raise SpecError(f"model={repo_id!r}: {where} answered {str(exc).splitlines()[0]}; {_LOCAL}") from None
    except OSError as exc:  # connection refused, DNS: huggingface_hub lets some network errors through
        raise SpecError(f"model={repo_id!r} is not a preset and {where} cannot be reached ({exc}); {_LOCAL}") from None
    return ModelSpec.from_hf_config(path, name=repo_id)
