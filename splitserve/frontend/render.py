"""Render: an OpenAI chat or completions request → the engine's generate request (the
typed `GenerateRequest`, written to the wire at the render tier's edge).

The chat template runs in a sandbox, the tokenizer caches segment IDs by content so a
resent conversation costs O(new text), and block hashes are computed here so a router can
match prefixes on real token IDs. No torch: this runs on CPU-only hosts.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.frontend.chat_template import (
    ChatTemplate,
    ChatTemplateCache,
    TemplateError,
    find_template_source,
    load_chat_template,
)
from splitserve.frontend.choice_decoder import model_has_reasoning, prompt_opens_reasoning, vocab_id
from splitserve.frontend.gguf_tokenizer import load_gguf_render_files
from splitserve.frontend.image_metrics import ImageStats
from splitserve.frontend.images import MediaConfig, VisionModel, render_images
from splitserve.frontend.tokenizer import Tokenizer
from splitserve.gguf_file import is_gguf_file
from splitserve.protocol.block_hash import MultiModalSpan, compute_block_hashes
from splitserve.protocol.errors import InvalidRequestError, check_model
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.multimodal import PIXEL_DTYPES, ImageInput, features_to_wire
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class RenderConfig:
    model: str  # a Hugging Face model directory or a GGUF file
    served_model_name: str | None = None  # None: the directory's name
    max_model_len: int | None = None  # None: config.json's max_position_embeddings
    block_size: int = 16
    chat_template: str | None = None  # a template file or string overriding the model's
    reasoning: bool | None = None  # None: on when the vocabulary has <think> and </think>
    tools: bool | None = None  # None: on when the vocabulary has <tool_call>
    # A template sent in a request runs sandboxed but can still burn CPU and memory: off
    # unless the operator trusts the clients (as vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    media: MediaConfig = field(default_factory=MediaConfig)  # images: sources and limits


def _read_max_position(model_dir: str) -> int:
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return int(config.get("max_position_embeddings") or 4096)


class Renderer:
    """Holds one model's tokenizer and chat template; thread-safe for reads."""

    def __init__(self, config: RenderConfig) -> None:
        self.config = config
        if is_gguf_file(config.model):
            gguf = load_gguf_render_files(config.model)
            self.tokenizer = gguf.tokenizer
            source = gguf.chat_template
            if config.chat_template:
                source = find_template_source(config.model, config.chat_template)
            if not source:
                raise TemplateError(f"{config.model}: the model has no chat template; pass one explicitly")
            self.chat_template = ChatTemplate(source, special_tokens=gguf.special_tokens)
            max_position = gguf.max_position_embeddings
        else:
            self.tokenizer = Tokenizer.from_dir(config.model)
            self.chat_template = load_chat_template(config.model, config.chat_template)
            max_position = _read_max_position(config.model)
        self._template_cache = ChatTemplateCache()
        self.model_name = config.served_model_name or Path(config.model).resolve().name
        self.max_model_len = config.max_model_len or max_position
        # No token spans more characters than the longest token's text, so a longer prompt
        # is certainly too long: refused before the tokenizer spends seconds on it.
        longest_token = max(map(len, self.tokenizer.backend.get_vocab(with_added_tokens=True)))
        self.max_prompt_chars = self.max_model_len * max(1, longest_token)
        self.reasoning = model_has_reasoning(self.tokenizer) if config.reasoning is None else config.reasoning
        has_tool_tag = vocab_id(self.tokenizer, "<tool_call>") is not None
        self.tools = has_tool_tag if config.tools is None else config.tools
        self.vision = VisionModel.from_model_dir(config.model)  # None: the model takes no images
        self.image_stats = ImageStats()

    # --- chat ---

    def chat_prompt(self, request: ChatCompletionRequest) -> str:
        messages = [_template_message(m) for m in request.messages]
        try:
            template = self.chat_template
            if request.chat_template is not None:
                if not self.config.trust_request_chat_template:
                    raise InvalidRequestError(
                        "chat_template in requests is disabled (start with --trust-request-chat-template)",
                        param="chat_template",
                    )
                template = self._template_cache.get(request.chat_template, self.chat_template.special_tokens)
            return template.render(
                messages,
                tools=request.template_tools(),
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **(request.chat_template_kwargs or {}),
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc

    def check_prompt_chars(self, prompt: str, param: str) -> None:
        if len(prompt) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt)} characters, more than {self.max_model_len} tokens can hold",
                param=param,
            )

    def chat_token_ids(self, request: ChatCompletionRequest) -> list[int]:
        prompt = self.chat_prompt(request)
        self.check_prompt_chars(prompt, "messages")
        token_ids = self.tokenizer.encode(prompt)
        if not token_ids:
            raise InvalidRequestError("the rendered prompt is empty", param="messages")
        return token_ids

    def render_chat(
        self, request: ChatCompletionRequest, *, request_id: str | None = None
    ) -> GenerateRequest:
        """The generate request for one chat choice (n > 1 is fanned out by the caller)."""
        self.check_model(request.model)
        token_ids, images = self.chat_token_ids_and_images(request)
        max_tokens = self.max_tokens_for(len(token_ids), request.max_output_tokens())
        rid = request_id or request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return self._generate_request(
            rid, token_ids, request, max_tokens, logprobs=_chat_logprobs(request), images=images
        )

    def chat_token_ids_and_images(self, request: ChatCompletionRequest) -> tuple[list[int], list[ImageInput]]:
        """The prompt's token IDs, each image's placeholder expanded to its visual tokens,
        and the images (hash, placement, processed pixels)."""
        token_ids = self.chat_token_ids(request)
        urls = [url for message in request.messages for url in message.image_urls()]
        if not urls:
            return token_ids, []
        if self.vision is None:
            raise InvalidRequestError(f"the model {self.model_name!r} takes no images", param="messages")
        start = time.perf_counter()
        try:
            token_ids, images = render_images(token_ids, urls, self.vision, self.config.media)
        except InvalidRequestError:
            self.image_stats.on_refused()
            raise
        itemsize = PIXEL_DTYPES[self.config.media.pixel_dtype]().itemsize
        pixel_bytes = sum(image.pixel_values.size * itemsize for image in images)
        self.image_stats.on_images(len(images), pixel_bytes, time.perf_counter() - start)
        return token_ids, images

    def starts_in_reasoning(self, prompt_token_ids: list[int]) -> bool:
        return self.reasoning and prompt_opens_reasoning(self.tokenizer, prompt_token_ids)

    # --- completions ---

    def completion_token_ids(self, request: CompletionRequest) -> list[list[int]]:
        prompts: list[list[int]] = []
        for index, prompt in enumerate(request.prompts()):
            if isinstance(prompt, str):
                self.check_prompt_chars(prompt, "prompt")
                token_ids = self.tokenizer.encode(prompt)
                if not token_ids:
                    raise InvalidRequestError("the prompt is empty", param="prompt")
            else:
                vocab = self.tokenizer.vocab_size
                bad = next((t for t in prompt if t >= vocab), None)
                if bad is not None:
                    raise InvalidRequestError(
                        f"prompt[{index}] has token ID {bad} >= vocab size {vocab}", param="prompt"
                    )
                token_ids = list(prompt)
            prompts.append(token_ids)
        return prompts

    def render_completion(
        self, request: CompletionRequest, *, request_id: str | None = None
    ) -> list[GenerateRequest]:
        """One generate request per prompt, as vLLM's /v1/completions/render."""
        self.check_model(request.model)
        base = request_id or request.request_id or f"cmpl-{uuid.uuid4().hex}"
        all_ids = self.completion_token_ids(request)
        result = []
        for index, token_ids in enumerate(all_ids):
            max_tokens = self.max_tokens_for(len(token_ids), request.max_tokens)
            rid = base if len(all_ids) == 1 else f"{base}-{index}"
            result.append(
                self._generate_request(rid, token_ids, request, max_tokens, logprobs=request.logprobs)
            )
        return result

    # --- shared ---

    def check_model(self, model: str | None) -> None:
        check_model(model, self.model_name)

    def max_tokens_for(self, prompt_len: int, requested: int | None) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has {prompt_len}",
                param="messages",
            )
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} for the output)",
                param="max_tokens",
            )
        return requested

    def block_hashes(
        self, token_ids: list[int], cache_salt: str | None, images: list[ImageInput] | None = None
    ) -> list[str]:
        """Block hashes as the engine computes them: images' hashes in the blocks they cover."""
        spans = []
        if images and self.vision is not None:
            merge = self.vision.processor.merge_size
            spans = [MultiModalSpan(i.offset, i.num_tokens(merge), i.image_hash) for i in images]
        hashes = compute_block_hashes(
            token_ids, self.config.block_size, cache_salt=cache_salt, mm_spans=spans
        )
        return [h.hex() for h in hashes]

    def _generate_request(
        self,
        request_id: str,
        token_ids: list[int],
        request: ChatCompletionRequest | CompletionRequest,
        max_tokens: int,
        *,
        logprobs: int | None,
        images: list[ImageInput] | None = None,
    ) -> GenerateRequest:
        sampling_params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k in (None, 0) else request.top_k,
            seed=request.seed,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
        )
        return GenerateRequest(
            request_id=request_id,
            token_ids=tuple(token_ids),
            sampling_params=sampling_params,
            stream=request.stream,
            include_usage=request.stream and request.include_usage(),
            return_token_ids=request.return_token_ids,
            cache_salt=request.cache_salt,
            features=self._features(images),
            model=self.model_name,
            block_hashes=tuple(self.block_hashes(token_ids, request.cache_salt, images)),
            conversation_id=request.conversation_id,  # the proxy's hint: never sent to an engine
        )

    def _features(self, images: list[ImageInput] | None) -> dict[str, Any] | None:
        if not images or self.vision is None:
            return None
        return features_to_wire(images, self.vision.processor.merge_size, self.config.media.pixel_dtype)


def _chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


def _template_message(message: Any) -> dict[str, Any]:
    """A message as chat templates expect it: no null fields, and the OpenAI `developer`
    role shown as `system` (templates predating it know only system)."""
    data = message.model_dump(exclude_none=True)
    if data["role"] == "developer":
        data["role"] = "system"
    return data
