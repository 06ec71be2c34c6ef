"""ServedModel: the one model a server serves, as the OpenAI and Anthropic routes share it (create_app keeps it on
app.state.served): its names, its prompts as token ids (chat template, plain text, length checks), and their
submission to the engine."""

from __future__ import annotations

import time
from typing import AsyncIterator, Sequence

from astrai_core.inference.engine import EngineClient, SamplingParams
from astrai_core.runtime.errors import AstraiError
from astrai_core.tokenizer.chat import ChatFormat
from serving.errors import ApiError
from serving.metrics import metrics_registry
from serving.protocol.anthropic import MessagesBody
from serving.protocol.openai import OpenAIBody
from serving.streaming import EventRelay, Finish, Submission, run_generation
from serving.text_stream import TextStream

MAX_BODY_BYTES = 1024 * 1024  # far more text than any context here holds; bigger bodies get 413
GREEDY_BELOW = 1e-5  # temperatures this small sample greedily (dividing logits by them would overflow)


class AliasWatch:
    """A registry alias the server was started by (models:/NAME@ALIAS) and the version it serves: where the alias
    pointed when last looked up (`astrai serve` looks every --alias-poll s), for /health and /v1/models to report."""

    def __init__(self, name: str, alias: str, version: str) -> None:
        self.name, self.alias, self.version = name, alias, version
        self.points_to: str | None = version
        self.checked = time.time()
        self.error: str | None = None

    @classmethod
    def started_by(cls, reference: str, model_id: str) -> AliasWatch | None:
        """The watch of `reference` when it names a registry alias (models:/NAME@ALIAS, resolved to `model_id`,
        NAME/VERSION), else None."""
        if not (reference.startswith("models:/") and "@" in reference):
            return None
        name, alias = reference.removeprefix("models:/").split("@", 1)
        return cls(name, alias, version=model_id.rsplit("/", 1)[1])

    def update(self, points_to: str | None, error: str | None = None) -> str | None:
        """Record a lookup (the alias's version, or why there is none); returns a line to log when that changed."""
        before = (self.points_to, self.error)
        self.points_to, self.error, self.checked = points_to, error, time.time()
        return self.warning() if (points_to, error) != before else None

    def warning(self) -> str | None:
        ref = f"models:/{self.name}@{self.alias}"
        if self.error:
            return f"{ref}: no answer from the registry ({self.error}); this server serves version {self.version}"
        if self.points_to != self.version:
            now = f"version {self.points_to}" if self.points_to else "no version"
            return f"{ref} now points to {now}; this server serves version {self.version} (restart it to serve that)"
        return None

    def report(self) -> dict:
        return {"registered_model": self.name, "version": self.version, "alias": self.alias,
                "alias_version": self.points_to, "alias_moved": self.points_to != self.version,
                "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.checked)),
                **({"warning": warning} if (warning := self.warning()) else {})}


class ServedModel:
    """One model on a started engine. Requests may name it `model_id` or any of `aliases` (a registered model's
    name, NAME@ALIAS: ids a client keeps when the champion moves); responses name `model_id`. `watch`: the alias
    it was started by, when it was (its version and where the alias points now appear in /health and /v1/models)."""

    def __init__(self, engine: EngineClient, chat: ChatFormat, model_id: str, aliases: Sequence[str] = (),
                 max_body_bytes: int = MAX_BODY_BYTES, watch: AliasWatch | None = None) -> None:
        self.engine, self.chat, self.tokenizer = engine, chat, chat.tokenizer
        self.model_id, self.max_body_bytes, self.watch = model_id, max_body_bytes, watch
        self.names = (model_id, *[a for a in aliases if a != model_id])
        self.created = int(time.time())
        self.context = engine.context_length
        self.relay = EventRelay()
        engine.after_step.append(self.relay.flush)
        self.registry, self.ttft = metrics_registry(engine)
        # Tokenizing megabytes would stall every stream on the event loop for seconds, so a text that cannot fit
        # the context is refused before: no token covers more than this many bytes of text.
        self.max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())

    def model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "astrai"}
        if self.watch:  # which version answers to this name, and where the alias points now
            card |= {"version": self.watch.version}
            if name == f"{self.watch.name}@{self.watch.alias}":
                card |= {"alias_version": self.watch.points_to, "alias_moved": self.watch.points_to != self.watch.version}
        return card

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"model {name!r} not found; this server serves {', '.join(self.names)}",
                           param="model")

    def check_length(self, texts: list[str], field: str) -> None:
        size = sum(len(t.encode()) for t in texts)
        if size > self.context * self.max_token_bytes:
            raise ApiError(400, f"prompt has more than {self.context} tokens ({size} bytes of text, at most "
                                f"{self.max_token_bytes} per token); the context is {self.context}", param=field)

    def completion_stop_ids(self, stops: Sequence[str], ignore_eos: bool = False) -> tuple[int, ...]:
        """Where a plain-text completion stops: where the model stops (its end of turn and end of text, as a
        generation_config eos list does in transformers and vLLM), and at each special token a stop string spells out
        (as vLLM does). Special tokens are not emitted as text (TextStream skips them), so a stop string such as
        lm-eval's until "<|end_of_turn|>" could never match the reply's text: the engine stops at the token, as it
        stops a chat reply at the end of its turn."""
        own = () if ignore_eos else self.chat.stop_ids  # ignore_eos: vLLM's option, only `stop` and the length
        return tuple(dict.fromkeys(own + self.chat.special_ids(stops)))

    def chat_prompt(self, messages: list[dict], field: str) -> list[int]:
        """Messages ({"role", "content"}) in the chat template, ready for the assistant's turn."""
        self.check_length([m["content"] for m in messages], field)
        try:
            return self.chat.encode_prompt(messages)
        except AstraiError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    def text_ids(self, text: str) -> list[int]:
        """Plain text as token ids, no special tokens (a completion's prompt, a prefilled reply)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def submit(self, prompt_ids: list[int], body: OpenAIBody | MessagesBody, max_tokens: int | None,
               stop_ids: tuple[int, ...], field: str, logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> Submission:
        """max_tokens None: to the end of the context; 0 (with prompt_logprobs): the prompt's logprobs only."""
        if len(prompt_ids) >= self.context:
            raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; the context is {self.context} "
                                f"(prompt and reply must fit in it)", param=field)
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        # A reply runs at most to the end of the context (the engine ends it there with "length").
        budget = self.context - len(prompt_ids)
        params = SamplingParams(max_tokens=budget if max_tokens is None else min(max_tokens, budget),
                                temperature=temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                stop_token_ids=stop_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        return Submission(self.engine, prompt_ids, params, self.relay)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens spelled out (what logprobs name a token by, as vLLM does)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.tokenizer.get_vocab_size()
        if not all(0 <= i < vocab for i in ids):
            raise ApiError(400, f"{field}: token ids must be in [0, {vocab})", param=field)

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info: the fields of vLLM's answer that clients read (lm-evaluation-harness's remote
        tokenizer reads the special tokens and the chat template), as in an exported tokenizer_config.json."""
        sp = self.chat.special  # the model's own (an imported model's), else astrai's
        special = {f"{name}_token": self.tokenizer.id_to_token(i) for name, i in (("bos", sp.bos), ("eos", sp.eos),
                                                                                ("pad", sp.pad)) if i is not None}
        return {"tokenizer_class": "PreTrainedTokenizerFast", **special, "chat_template": self.chat.template_text,
                "model_max_length": self.context, "vocab_size": self.tokenizer.get_vocab_size()}

    def generate(self, sub: Submission, stops: list[str], started: float) -> AsyncIterator[str | Finish]:
        """The reply's text pieces as they become final, then one Finish (see streaming.run_generation)."""
        return run_generation(sub, TextStream(self.tokenizer, stops), self.ttft, started)
