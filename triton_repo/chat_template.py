"""The model's chat template, stored in the engine's tokenizer folder at build time, rendered the
way Hugging Face transformers' `apply_chat_template` renders it.

Templates come with checkpoints, so they are untrusted code: they run in Jinja's immutable
sandbox, with the same environment transformers gives them (trim_blocks, lstrip_blocks, loop
controls, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and the
tokenizer's special tokens as variables)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from kiln import constants as names
from kiln.errors import KilnError
from kiln.triton_repo.model_utils import special_token_text

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(KilnError):
    """A chat template that cannot be compiled, or that refused the messages it was given."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _template_source(config: dict, folder: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of
    named templates of which "default" is the one transformers applies)."""
    jinja = folder / names.CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text()
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value.strip() else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the engine's chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_tokenizer_dir(cls, folder: str | Path) -> "ChatTemplate | None":
        """The template an engine's tokenizer folder holds, or None when the model has none."""
        folder = Path(folder)
        config_path = folder / names.TOKENIZER_CONFIG_JSON
        config = _read_json(config_path) if config_path.is_file() else {}
        source = _template_source(config, folder)
        if source is None:
            return None
        special_map = folder / names.SPECIAL_TOKENS_MAP_JSON
        merged = {**(_read_json(special_map) if special_map.is_file() else {}), **config}
        tokens = {key: special_token_text(merged.get(key)) for key in SPECIAL_TOKEN_KEYS}
        return cls(source, {key: value for key, value in tokens.items() if value is not None})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for a conversation (the template adds the BOS token if the model wants
        one, so it is tokenized without special tokens)."""
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **variables})
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused these messages: {exc}") from None
