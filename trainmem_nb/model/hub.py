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
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision)
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
