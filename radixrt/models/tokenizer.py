"""Load a model directory's tokenizer the one way radixrt does it everywhere.

`AutoTokenizer` may pick a model-specific Python class (e.g. `Qwen2Tokenizer`) whose pre/post-processing
differs from the directory's `tokenizer.json`; the runtime, the tests and the benchmarks must agree on
token ids, so all of them call `load_tokenizer`, which always builds a `PreTrainedTokenizerFast` straight
from `tokenizer.json` and takes only special tokens, the chat template and a few decode options from
`tokenizer_config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Options copied verbatim from tokenizer_config.json when present.
_PASSTHROUGH_OPTIONS = ("model_max_length", "padding_side", "truncation_side", "split_special_tokens")


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_str(value: object) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special token entry in tokenizer_config.json: {value!r}")


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template, preferring a standalone file over the tokenizer_config.json field (as HF does)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = model_dir / "chat_template.json"
    template: object = _read_json(as_json).get("chat_template") if as_json.is_file() else None
    if template is None:
        template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        return {str(t["name"]): str(t["template"]) for t in template}
    if isinstance(template, dict):
        return {str(k): str(v) for k, v in template.items()}
    raise ValueError(f"{model_dir}: unrecognized chat_template of type {type(template).__name__}")


def _tokenizer_json(path: Path) -> Path:
    """Resolve `path` (a model directory or its tokenizer.json) to the tokenizer.json file."""
    if path.is_file() and path.name == "tokenizer.json":
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} is not a directory")
    file = path / "tokenizer.json"
    if file.is_file():
        return file
    slow_only = [n for n in ("tokenizer.model", "vocab.json", "tiktoken.model") if (path / n).exists()]
    if slow_only:
        raise ValueError(
            f"{path} has no tokenizer.json (only {', '.join(slow_only)}); radixrt loads fast tokenizers "
            "only: convert it once with transformers (AutoTokenizer.from_pretrained(...).save_pretrained(...))"
        )
    raise FileNotFoundError(f"{path} has no tokenizer.json")


def _has_post_processor(tokenizer_file: Path) -> bool:
    return Tokenizer.from_file(str(tokenizer_file)).post_processor is not None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Build the tokenizer of a model directory from its `tokenizer.json`.

    Encoding is exactly that of `tokenizers.Tokenizer.from_file(<dir>/tokenizer.json)` (its pre-tokenizer
    and post-processor are kept, so `add_special_tokens=True` adds whatever BOS the file itself adds).
    Special tokens (bos/eos/pad/unk and additional ones), `chat_template` and decode options come from
    `tokenizer_config.json`; a `chat_template.jinja` or `chat_template.json` next to it takes precedence.

    Raises:
        FileNotFoundError: `path` is not a directory, or it has no tokenizer.json.
        ValueError: only a slow tokenizer (e.g. tokenizer.model) is present, or a config file is malformed.
    """
    tokenizer_file = _tokenizer_json(Path(path))
    model_dir = tokenizer_file.parent
    config_file = model_dir / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}

    kwargs: dict[str, Any] = {
        "tokenizer_file": str(tokenizer_file),
        "clean_up_tokenization_spaces": bool(config.get("clean_up_tokenization_spaces", False)),
    }
    for name in _NAMED_SPECIAL_TOKENS:
        token = _token_str(config.get(name))
        if token is not None:
            kwargs[name] = token
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, dict):  # v5 "named" extra tokens: {"image_token": "<image>", ...}
        extra = list(extra.values())
    tokens = [t for t in (_token_str(v) for v in extra) if t is not None]
    if tokens:
        kwargs["additional_special_tokens"] = tokens
    for name in _PASSTHROUGH_OPTIONS:
        if name in config:
            kwargs[name] = config[name]
    chat_template = _read_chat_template(model_dir, config)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    tokenizer = PreTrainedTokenizerFast(**kwargs)
    # NOTE: tokenizer.json's own post-processor decides BOS/EOS insertion. Passing add_bos_token to the
    # constructor would make transformers replace it, so the config's flags apply only when the file has
    # no post-processor (then the default, False, is already in effect).
    wanted = [name for name in ("add_bos_token", "add_eos_token") if config.get(name)]
    if wanted and not _has_post_processor(tokenizer_file):
        for name in wanted:
            setattr(tokenizer, name, True)
    return tokenizer


def _config_eos(path: Path) -> list[int]:
    """eos_token_id of a config.json / generation_config.json (int, list, or under `text_config`)."""
    if not path.is_file():
        return []
    data = _read_json(path)
    value = data.get("eos_token_id")
    if value is None and isinstance(data.get("text_config"), dict):
        value = data["text_config"].get("eos_token_id")
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"{path}: unrecognized eos_token_id {value!r}")


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path) -> list[int]:
    """All token ids that end generation: the tokenizer's eos, then those of generation_config.json and
    config.json (each an int or a list), without duplicates, in that order."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.append(eos)
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        ids.extend(_config_eos(model_dir / name))
    return list(dict.fromkeys(ids))
