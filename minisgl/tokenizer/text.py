"""Loading a model directory's tokenizer, or another directory's or hub id's (`--tokenizer`;
the tokenizer processes are the only places that know text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


# vLLM's --tokenizer-mode values that name what minisgl does: transformers' tokenizer for the
# directory (its fast one where there is one). slow, mistral (mistral_common) and custom are not.
TOKENIZER_MODES = ("auto", "hf")


def check_tokenizer_mode(mode: str) -> None:
    """ValueError naming `mode` where it is not one of TOKENIZER_MODES."""
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode {mode!r} is not supported: minisgl loads the model's "
                         f"tokenizer with transformers, its fast one where it has one "
                         f"(tokenizer_mode {' or '.join(TOKENIZER_MODES)})")


def has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                             "tokenizer_config.json"))


def resolve_tokenizer_path(tokenizer: Optional[str], model_path: Path,
                           download_dir: Optional[str] = None, token: Optional[str] = None,
                           revision: Optional[str] = None) -> Path:
    """Where the tokenizer (and the chat template) comes from: `model_path` when `tokenizer`
    is None, else a local directory or a hub id (only its tokenizer files are downloaded, at
    `revision`, authorized by `token`). FileNotFoundError naming it when it holds no
    tokenizer."""
    from minisgl.models.path import TOKENIZER_FILES, download_model, looks_like_hub_id
    if tokenizer is None:
        return model_path
    path = Path(tokenizer).expanduser()
    if not path.is_dir() and looks_like_hub_id(tokenizer):
        path = download_model(tokenizer, revision, download_dir, TOKENIZER_FILES, token)
    if not has_tokenizer(path):
        raise FileNotFoundError(f"tokenizer {tokenizer!r} is not a directory with tokenizer "
                                f"files (tokenizer.json, tokenizer.model or "
                                f"tokenizer_config.json) nor a hub id that has them")
    return path


def load_tokenizer(path: Path, chat_template: Optional[str] = None) -> Optional[Any]:
    """The model's tokenizer, or None for a directory without one (benchmark shapes: token-id
    prompts only). `chat_template` (Jinja text) replaces the model's own."""
    if not has_tokenizer(path):
        return None
    tokenizer = tokenizer_class(path).from_pretrained(str(path))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tokenizer_class(path: Path) -> Any:
    """The class `AutoTokenizer` picks for the model directory, found without importing torch
    where it can be: `tokenizer_config.json`'s `tokenizer_class` as transformers exports it
    (the same class AutoTokenizer resolves the name to). Otherwise AutoTokenizer itself, whose
    module loads the model's config code and with it torch (some 2 s and 300 MB in each
    tokenizer process, on the service's start-up path)."""
    import transformers
    config = path / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if isinstance(name, str) and name.isidentifier():
        try:
            cls = getattr(transformers, name)
        except (AttributeError, ImportError):
            cls = None
        # A placeholder class stands in where an optional dependency is missing.
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls
    return transformers.AutoTokenizer


def model_chat_template(path: Path) -> Optional[str]:
    """The model directory's own chat template for a conversation with tools
    (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`: of a named list, the
    `tool_use` one, which transformers picks when tools are given, else `default`), or None;
    read without loading the tokenizer."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use", named.get("default", next(iter(named.values()), None)))
    return template if isinstance(template, str) else None


def read_chat_template(path: str) -> str:
    """The text of a chat template file; ValueError naming the file when it cannot be read."""
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"cannot read chat template {path!r}: {e.strerror}") from None
