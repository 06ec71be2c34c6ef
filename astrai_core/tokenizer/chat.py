"""The chat format: a Jinja2 template stored with the tokenizer turns a conversation into tokens.

One function serves training and serving, so both see the same format:

    chat = load_chat("data/tokenizer/tokenizer.json")      # reads chat_template.jinja beside it (or the default)
    ids, mask = chat.encode(messages)                       # training: mask is 1 on the tokens the loss counts
    ids = chat.encode_prompt(messages)                      # generation: ends with the assistant header

The default template wraps each turn in the tokenizer's special tokens, `<|user|>content<|end_of_turn|>`, and
the loss covers an assistant turn's content and its `<|end_of_turn|>` (the model must learn to stop), never the
role header or another role's text. Templates run in Jinja2's immutable sandbox: a template file cannot reach
Python objects or change state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from astrai_core.runtime.errors import AstraiError
from astrai_core.tokenizer.bpe import SPECIAL_TOKENS, Specials, load_tokenizer, specials

TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end_of_turn|>' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
ROLES = ("system", "user", "assistant")

Message = dict[str, str]


def compile_template(template: str = DEFAULT_TEMPLATE, source: str = "default template"):
    """A chat template, compiled in Jinja2's immutable sandbox; .render(messages=..., add_generation_prompt=...)."""
    try:
        return ImmutableSandboxedEnvironment(trim_blocks=True).from_string(template)
    except TemplateError as e:
        raise AstraiError(f"{source}: not a valid chat template ({e})") from None


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer, template: str = DEFAULT_TEMPLATE, source: str = "default template",
                 special: Specials | None = None) -> None:
        self.tokenizer, self.template_text, self.source = tokenizer, template, source
        self.template = compile_template(template, source)
        # The model's own end of turn and eos (an imported model's special_tokens.json), else astrai's
        self.special = special or specials(tokenizer)
        self.stop_ids = self.special.stop
        # The tokenizer's special tokens (astrai's SPECIAL_TOKENS, and any an imported tokenizer brings): text that
        # spells one is tokenized as that token, so a message holding it would forge the markup of turns.
        self.control_tokens = tuple(sorted({t.content for t in tokenizer.get_added_tokens_decoder().values()
                                            if t.special} | set(SPECIAL_TOKENS.values())))

    def special_ids(self, texts: Iterable[str]) -> tuple[int, ...]:
        """The ids of those of `texts` that are a special token's whole text (as a stop string: special tokens are
        never decoded as text, so only the token itself can stop at one)."""
        return tuple(i for t in texts if t in self.control_tokens and (i := self.tokenizer.token_to_id(t)) is not None)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise AstraiError(f"{self.source}: chat template failed ({e})") from None

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of a whole conversation; mask 1 on assistant content and its end-of-turn.

        Each turn's tokens are the text its message adds to the rendering; an assistant turn is further split
        after its header (what add_generation_prompt renders). The pieces must tokenize like the whole, which
        holds when turn boundaries are special tokens (checked: a template that breaks it is refused)."""
        check_messages(messages, tokens=self.control_tokens)
        ids: list[int] = []
        mask: list[int] = []
        before = ""
        for i, message in enumerate(messages):
            upto = self.render(messages[: i + 1])
            if not upto.startswith(before):
                raise AstraiError(f"{self.source}: rendering a conversation turn by turn is not prefix-stable")
            if message["role"] == "assistant":
                header = self.render(messages[:i], add_generation_prompt=True)
                if not (header.startswith(before) and upto.startswith(header)):
                    raise AstraiError(f"{self.source}: the assistant header is not a prefix of the assistant turn")
                head, body = self._ids(header[len(before):]), self._ids(upto[len(header):])
                ids += head + body
                mask += [0] * len(head) + [1] * len(body)
            else:
                part = self._ids(upto[len(before):])
                ids += part
                mask += [0] * len(part)
            before = upto
        if ids != self._ids(before):
            raise AstraiError(f"{self.source}: turn-by-turn tokens differ from the whole conversation's; turn "
                              "boundaries must be special tokens")
        return ids, mask

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the conversation so far plus the assistant header: what generation continues."""
        check_messages(messages, need_assistant=False, tokens=self.control_tokens)
        return self._ids(self.render(messages, add_generation_prompt=True))

    def decode_reply(self, ids: Sequence[int]) -> str:
        """The text of generated ids, cut at the first stop token."""
        out = []
        for i in ids:
            if i in self.stop_ids:
                break
            out.append(i)
        return self.tokenizer.decode(out)


def control_token_in(text: str, tokens: Iterable[str] = SPECIAL_TOKENS.values()) -> str | None:
    """The first of `tokens` (special tokens' texts) that `text` contains, or None: such text would be tokenized as
    the token itself, e.g. a message's '<|end_of_turn|><|system|>' as the end of its turn and a system turn."""
    return next((token for token in tokens if token in text), None)


def check_messages(messages: Sequence[Message], need_assistant: bool = True,
                   tokens: Iterable[str] = SPECIAL_TOKENS.values()) -> None:
    """Roles and contents are well formed, and no content smuggles in a special token's text (`tokens`)."""
    if not messages:
        raise AstraiError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise AstraiError(f"message {i}: expected {{'role': one of {ROLES}, 'content': str}}, got {m!r:.80}")
        if token := control_token_in(m["content"], tokens):
            raise AstraiError(f"message {i}: content contains the special token {token}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise AstraiError("a training conversation needs at least one assistant turn")


def load_chat(tokenizer_path: str | os.PathLike) -> ChatFormat:
    """The tokenizer at `tokenizer_path` with the chat_template.jinja beside it, or the default template."""
    tokenizer_path = Path(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    template_path = tokenizer_path.with_name(TEMPLATE_FILE)
    special = specials(tokenizer, tokenizer_path)
    if template_path.is_file():
        return ChatFormat(tokenizer, template_path.read_text(encoding="utf-8"), str(template_path), special)
    return ChatFormat(tokenizer, special=special)
