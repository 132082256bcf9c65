"""The Hugging Face Hub, asked within a time limit: whether a model or dataset id is there, before a download's minutes
of retries (`marlhf.modeling.check_model_path`, `marlhf.data.loading`)."""

from __future__ import annotations

import os
import socket
import time

from marlhf.errors import MarlhfError

__all__ = ["HUB_TIMEOUT_VARIABLE", "HUB_TIMEOUT_DEFAULT", "hub_timeout", "hub_lookup"]

HUB_TIMEOUT_VARIABLE = "MARLHF_HUB_TIMEOUT"
HUB_TIMEOUT_DEFAULT = 10.0


def hub_timeout() -> float:
    """Seconds a Hub lookup may take in all, retries included: MARLHF_HUB_TIMEOUT, default 10."""
    text = os.environ.get(HUB_TIMEOUT_VARIABLE, "").strip()
    try:
        seconds = float(text) if text else HUB_TIMEOUT_DEFAULT
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise MarlhfError(f"{HUB_TIMEOUT_VARIABLE}={text!r} must be a number of seconds > 0")
    return seconds


_LOOKED_UP = {"model": ("config.json", "a local directory"), "dataset": ("README.md", "a local .jsonl/.parquet file")}


def hub_lookup(repo_id: str, timeout_s: float, missing_is_error: bool, repo_type: str = "model",
               revision: str | None = None) -> str | None:
    """HEAD of a model repo's config.json (a dataset repo's README.md) at `revision`, retried on 408/429/5xx,
    timeouts and dropped connections within timeout_s seconds in all: None when the Hub answered, else what it did
    last ("answered HTTP 503 ... after 3 tries in 7.1 s"). Another 4xx (not there, gated, private) is a MarlhfError
    when missing_is_error, else None."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError

    started = time.monotonic()
    deadline = started + timeout_s
    tries = 0
    while True:
        tries += 1
        try:
            # a file URL of the repo (from HF_ENDPOINT), with what is left of the time
            url = hf_hub_url(repo_id, _LOOKED_UP[repo_type][0], repo_type=repo_type, revision=revision)
            get_hf_file_metadata(url, timeout=max(deadline - time.monotonic(), 1e-3))
            return None
        except RemoteEntryNotFoundError:
            return None  # the repo is there without that file: from_pretrained or load_dataset says what it lacks
        except HfHubHTTPError as error:
            code = error.response.status_code
            status = f"answered HTTP {code} {error.response.reason_phrase}"
            if code not in (408, 429) and code < 500:  # not there, gated or private: asking again cannot help
                if not missing_is_error:
                    return None
                raise MarlhfError(f"{repo_type} {repo_id!r} is not {_LOOKED_UP[repo_type][1]}, and the Hub "
                                  f"({constants.ENDPOINT}) {status} for it: check the id (and HF_ENDPOINT), or for a "
                                  f"gated or private {repo_type} log in (hf auth login) or set HF_TOKEN") from None
        except Exception as error:  # noqa: BLE001 - the HTTP client's network errors: classified by their cause
            cause = _root_cause(error)
            status = f"failed ({cause or error})"
            if isinstance(cause, (ConnectionRefusedError, socket.gaierror)):
                return f"{status} at once"  # nothing listens there, or no such host: waiting cannot help
        delay = 2.0 ** (tries - 1)
        elapsed = time.monotonic() - started
        if time.monotonic() + delay >= deadline:
            return f"{status} after {tries} {'try' if tries == 1 else 'tries'} in {elapsed:.1f} s"
        time.sleep(delay)


def _root_cause(error: BaseException) -> BaseException | None:
    """The innermost exception of error's chain (an HTTP client wraps the socket's error)."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen[-1] if len(seen) > 1 else None
