"""Client APIs beyond chat completions, each a dialect over the one pipeline: it opens its request into an
exchange holding a chat-completions body (what every stage after parsing sees) and tells the engine's
answer back in its own shape, whole or as its own stream events.

    openai_responses     /v1/responses (+ retrieve, delete, cancel, input_items): conversation state in
                         the store; responses_stream: its answer's items and stream events
    anthropic_messages   /v1/messages, /v1/messages/count_tokens
    chat, chunks         what they share: the engine's answer read, whole or as its stream's events

Adding a dialect is one module: a request model, the translation to chat, an Encoder for its stream.
"""

from corral.dialects.anthropic_messages import Messages, MessagesExchange, anthropic_error
from corral.dialects.chat import Answer, DialectStream, Encoder, ToolCall
from corral.dialects.openai_responses import Responses, ResponsesExchange

__all__ = [
    "Answer",
    "DialectStream",
    "Encoder",
    "Messages",
    "MessagesExchange",
    "Responses",
    "ResponsesExchange",
    "ToolCall",
    "anthropic_error",
]
