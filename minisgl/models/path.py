"""Where a model's files are: a local Hugging Face directory, a Hugging Face hub id, or the
bundled default model.

A hub id (`ORG/NAME`) resolves through `huggingface_hub.snapshot_download` and its usual cache
(`HF_HOME`, `HF_HUB_CACHE`, or `download_dir`): with a network, only the files a model needs
are fetched (HUB_FILES); offline (`HF_HUB_OFFLINE=1`, or no network) the cached snapshot is used.
When neither works the error names the id.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple

from minisgl.models.default_model import default_model_path

# What loading a tokenizer reads (its config.json too: some tokenizers pick their class by it).
TOKENIZER_FILES: Tuple[str, ...] = ("config.json", "tokenizer*", "special_tokens_map.json",
                                    "vocab.json", "merges.txt", "*.model", "*.jinja",
                                    "chat_template.json")
# What loading a model reads: weights, configs, tokenizer files and chat templates.
HUB_FILES: Tuple[str, ...] = ("*.safetensors", "*.safetensors.index.json",
                              "generation_config.json", *TOKENIZER_FILES)
_TRUE = ("1", "on", "yes", "true")


def looks_like_hub_id(model: str) -> bool:
    """`ORG/NAME` (or `NAME`) that is no local path: not absolute, not `~`, `.` or `..`-led,
    and not an existing file or directory."""
    if model.startswith(("/", "~", ".")) or Path(model).exists():
        return False
    return 1 <= len(model.split("/")) <= 2 and all(model.split("/"))


def _offline() -> bool:
    """HF_HUB_OFFLINE as it is now (huggingface_hub reads it once, at import)."""
    import huggingface_hub.constants as hub
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or bool(
        hub.HF_HUB_OFFLINE)


def download_model(model_id: str, revision: Optional[str] = None,
                   download_dir: Optional[str] = None, files: Tuple[str, ...] = HUB_FILES,
                   token: Optional[str] = None) -> Path:
    """The local snapshot of hub model `model_id` at `revision` (None: the default branch),
    its `files` (patterns) downloaded into the hub cache (`download_dir`, else
    huggingface_hub's default) where missing, authorized by `token` (None: huggingface_hub's
    own, HF_TOKEN or the saved login; a gated or private model needs one).
    FileNotFoundError naming the id when it is neither cached nor downloadable."""
    from huggingface_hub import snapshot_download
    offline = _offline()
    try:
        folder = snapshot_download(model_id, revision=revision, cache_dir=download_dir,
                                   allow_patterns=list(files), local_files_only=offline,
                                   token=token)
    except Exception as e:  # noqa: BLE001  (hub errors, invalid ids, network failures)
        where = f"revision {revision!r} of " if revision else ""
        how = ("HF_HUB_OFFLINE is set and it is not in the local cache" if offline else
               "it is not in the local cache and could not be downloaded")
        cache = download_dir or "the default hub cache"
        detail = str(e).splitlines()[0] if str(e) else repr(e)
        raise FileNotFoundError(
            f"model {model_id!r} is not a local directory, and {where}the Hugging Face hub model "
            f"{model_id!r} is not available: {how} (cache: {cache}; {type(e).__name__}: "
            f"{detail})") from None
    return Path(str(folder))


def resolve_model_path(model: Optional[str], revision: Optional[str] = None,
                       download_dir: Optional[str] = None, token: Optional[str] = None
                       ) -> Path:
    """A local Hugging Face directory, or a hub id (`download_model`, with `token`); None
    means the bundled default model (fetched and converted on first use)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if looks_like_hub_id(model):
        path = download_model(model, revision, download_dir, token=token)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"hub model {model!r} has no config.json (snapshot {path})")
        return path
    raise FileNotFoundError(f"model path {model!r} is not a directory with a config.json "
                            f"(models are local Hugging Face directories or hub ids ORG/NAME)")


def model_name(model: Optional[str], path: Path) -> str:
    """The name a model goes by: a hub id as given, else the directory's name."""
    if model is not None and not (Path(model).expanduser() / "config.json").is_file():
        return model
    return path.name

