"""What an engine answers correctly by itself, declared by its adapter."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineFeatures"]


@dataclass(frozen=True, slots=True)
class EngineFeatures:
    """What an engine answers correctly by itself; the gateway makes up for the rest, or refuses it.

    llama.cpp, for example, answers `n > 1` and a list of prompts with the usage of one choice only, and
    ignores `echo`: the gateway fans such requests out and adds the echo itself.
    """

    multiple_choices: bool = True  # n > 1, with usage over all choices
    prompt_lists: bool = True  # /v1/completions with a list of prompts, with usage over all of them
    echo: bool = True
    images: bool = True  # image parts in chat messages
    continuation: bool = True  # continues a trailing assistant message / prompt text (mid-stream failover)
    # streaming a chat that ends with an assistant message, not asked `continue_final_message`, it sends that
    # message back first (llama.cpp; asked, it sends only what follows)
    prefill_echo: bool = False
    token_prompts: bool = False  # takes prompts mixing text and token ids, tokenizes at /tokenize (llama.cpp)
    embeddings: bool = False  # an embedding model: serves /v1/embeddings, not generation
    matryoshka: bool = False  # its vectors may be shortened (`dimensions`; models[].matryoshka)
    cache_salt: bool = False  # takes vLLM's `cache_salt`: prompts with different salts share no cached blocks
    tools: bool = (
        True  # makes tool calls itself (else the gateway asks for them as JSON: gateway/toolcalls.py)
    )
    media_urls: bool = False  # may be asked to fetch media by http(s) URL (models[].media_urls)

    def __and__(self, other: EngineFeatures) -> EngineFeatures:
        return EngineFeatures(
            self.multiple_choices and other.multiple_choices,
            self.prompt_lists and other.prompt_lists,
            self.echo and other.echo,
            self.images and other.images,
            self.continuation and other.continuation,
            self.prefill_echo or other.prefill_echo,
            self.token_prompts and other.token_prompts,
            self.embeddings and other.embeddings,
            self.matryoshka and other.matryoshka,
            self.cache_salt and other.cache_salt,
            self.tools and other.tools,
            self.media_urls and other.media_urls,
        )
