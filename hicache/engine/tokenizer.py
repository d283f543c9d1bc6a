"""Tokenizer wrapper: a `tokenizers` tokenizer, its chat template, and streaming detokenization.

Three sources build the same `Tokenizer`: a Hugging Face directory (tokenizer.json + tokenizer_config.json),
GGUF metadata (GPT-2 byte-level BPE vocab and merges), and a byte-level fallback for random-weight models.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# ChatML, used for models that ship no template of their own
_MARK = re.compile("\ue000([0-9]+)\ue001")  # encode_chat's placeholder of message N
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BYTE_FALLBACK_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")

GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    """Text <-> token ids, plus the chat template and the ids that end generation."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: list[int],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = sorted(set(eos_token_ids))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, indent=indent, ensure_ascii=False
        )
        self._template = env.from_string(self.chat_template)
        # a copy that reads special-token strings as plain text: for what users write (see encode_chat)
        self._plain = HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # `tokenizers`' encode holds the GIL for the whole text; encode_batch lets go of it. The server tokenizes in a
    # worker thread, and a 3.9 MB prompt encoded with the GIL held stopped its event loop (and /health) for 1.9 s

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. <|im_start|>) map to their ids."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings in it read as plain text (`<|im_start|>` becomes the
        characters, not the marker)."""
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of UTF-8 text one token stands for (at least): a text of N bytes needs at least
        N / max_token_bytes tokens, so one too long for the context is refused without tokenizing it."""
        return max(len(self.backend.decode([i], skip_special_tokens=False).encode("utf-8"))
                   for i in range(self.vocab_size)) or 1

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat: the template's own text with its special tokens, each message's content as plain
        text (encode_text). So a user who writes `<|im_start|>system ...` in a message gets those characters, not
        a forged turn: vLLM and SGLang parse special tokens in chat content by default; that lets any user speak
        as the system, so hicache does not. (/v1/completions takes the prompt as the caller wrote it.)

        The content is cut out of the rendered template by placeholders (private-use characters) and encoded on
        its own; where a template alters or drops a message's content the placeholder is not found and that
        content is encoded as the template rendered it."""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        text = self.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                        add_generation_prompt)
        ids: list[int] = []
        pos = 0
        for mark, message in zip(marks, messages):
            at = text.find(mark, pos)
            if at < 0:
                continue
            ids += self.encode(self._unmark(text[pos:at], messages))
            ids += self.encode_text(message.get("content") or "")
            pos = at + len(mark)
        return ids + self.encode(self._unmark(text[pos:], messages))

    @staticmethod
    def _unmark(text: str, messages: list[dict[str, Any]]) -> str:
        """Template text with any placeholder left in it (content rendered twice) put back as the content: one pass
        over the text, whatever the number of messages (a scan per message made a chat's cost grow with the square
        of its messages)."""
        if "\ue000" not in text:
            return text
        return _MARK.sub(lambda m: messages[int(m.group(1))].get("content") or "", text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a chat ([{"role": ..., "content": ...}]) to the prompt text the model was trained on."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one response."""
        return IncrementalDetokenizer(self)

    def save(self, directory: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (HF layout) into `directory`."""
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "eos_token_ids": self.eos_token_ids,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def from_dir(cls, directory: Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        """Load an HF-style directory: tokenizer.json, tokenizer_config.json, optional chat_template.jinja."""
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        ids = list(config.get("eos_token_ids", [])) + list(eos_token_ids or [])
        if eos is not None and backend.token_to_id(eos) is not None:
            ids.append(backend.token_to_id(eos))
        return cls(backend, template, bos, eos, ids)

    @classmethod
    def from_gguf_vocab(
        cls,
        tokens: list[str],
        merges: list[str],
        token_types: list[int],
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None,
    ) -> Tokenizer:
        """Build a GPT-2 byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata."""
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),  # digits one by one (SmolLM)
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        specials = [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind in (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_USER_DEFINED)
        ]
        backend.add_special_tokens(specials)
        bos = tokens[bos_id] if bos_id is not None else None
        eos = tokens[eos_id] if eos_id is not None else None
        return cls(backend, chat_template, bos, eos, [] if eos_id is None else [eos_id])

    @classmethod
    def byte_fallback(cls) -> Tokenizer:
        """One token per UTF-8 byte (ids 0-255) plus four specials (256-259), for random-weight models."""
        byte_chars = _bytes_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in BYTE_FALLBACK_SPECIALS]
        )
        bos, eos, _, im_end = BYTE_FALLBACK_SPECIALS
        eos_ids = [backend.token_to_id(eos), backend.token_to_id(im_end)]
        return cls(backend, None, bos, eos, eos_ids)


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    if isinstance(token, dict):  # serialized AddedToken
        return token.get("content")
    return token


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters.

    Text is decoded from a short window before the last emitted position, so byte-level BPE merges and
    leading-space handling match a full decode; a delta ending in U+FFFD waits for the next id.
    """

    tokenizer: Tokenizer
    ids: list[int] | None = None
    prefix_offset: int = 0  # window start: ids before it are already fully emitted
    read_offset: int = 0  # ids [prefix_offset, read_offset) produced text already emitted

    def push(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        if self.ids is None:
            self.ids = []
        self.ids.extend(new_ids)
        emitted = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(emitted):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(emitted) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        if not self.ids:
            return ""
        emitted = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(emitted) :]
