"""What a real download leaves in a Hugging Face cache, built without the network, for the offline tests.

    put_in_hub_cache        a model or dataset repo snapshot in the hub cache (HF_HUB_CACHE = HF_HOME/hub)
    put_in_datasets_cache   the Arrow cache `datasets.load_dataset(repo_id)` writes (HF_DATASETS_CACHE), written
                            by `datasets`' own Parquet builder into the directory `datasets` itself names
    offline_env             the environment of a process with both libraries offline and no reachable Hub
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"
UNREACHABLE_HUB = "http://127.0.0.1:9"  # the discard port: any request that slips through fails at once


def put_in_hub_cache(hub_cache: Path, repo_id: str, files_from: Path, repo_type: str = "model",
                     revision: str = "main") -> Path:
    """The hub cache layout of one repo (refs/<revision> -> snapshots/<commit>/files, as huggingface_hub writes
    it); from_pretrained and snapshot_download(local_files_only=True) read it offline. Returns the snapshot."""
    from huggingface_hub.file_download import repo_folder_name

    repo = hub_cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files_from, snapshot)
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(COMMIT)
    return snapshot


def put_in_datasets_cache(datasets_cache: Path, repo_id: str, splits: dict[str, list[dict[str, Any]]],
                          scratch: Path, data_dir: str | None = None) -> Path:
    """The Arrow cache a first online ``load_dataset(repo_id[, data_dir=...])`` of a Parquet repo writes
    (``namespace___name/<config id>/0.0.0/<commit>/``: ``dataset_info.json`` and ``name-<split>.arrow``; the
    config id is ``default``, or with ``data_dir`` a hash of it and of the repo's resolved data files), prepared by
    `datasets`' own Parquet builder from the rows of each split."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict, DataFilesList
    from datasets.packaged_modules.parquet.parquet import Parquet

    name = repo_id.split("/")[-1]
    # The directory the online load would prepare into, computed by datasets from what the online load passes
    # its builder: repo id, commit and, with a data_dir, the data files it resolved in the repo.
    online = {}
    if data_dir is not None:
        online = {"data_dir": data_dir, "data_files": DataFilesDict({
            split: DataFilesList([f"hf://datasets/{repo_id}@{COMMIT}/{data_dir}/{split}/0000.parquet"],
                                 origin_metadata=[None]) for split in splits})}
    target = Parquet(cache_dir=str(datasets_cache), dataset_name=name, repo_id=repo_id, hash=COMMIT,
                     **online).cache_dir
    data_files = {}
    for split, rows in splits.items():
        data_files[split] = str(scratch / f"{split}-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows), data_files[split])
    builder = Parquet(cache_dir=str(scratch / "build"), dataset_name=name, data_files=data_files,
                      config_id="default", hash=COMMIT)
    builder.download_and_prepare(output_dir=target)
    return Path(target)


def offline_env(hf_home: Path) -> dict[str, str]:
    """os.environ with HF_HOME (hub and datasets caches under it), both offline switches and an unroutable Hub."""
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_CACHE", "HF_DATASETS_CACHE")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_ENDPOINT": UNREACHABLE_HUB, "OMP_NUM_THREADS": "1"}
