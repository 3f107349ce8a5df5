"""Chat input, shared by the gRPC API (GenerateRequest.messages) and the HTTP
API (/v1/chat/completions): messages are checked here and rendered by the
target worker with the model's own chat template (Worker.ApplyChatTemplate,
llama.cpp's llama_chat_apply_template on the template in its GGUF, as
llama-server renders them)."""
from __future__ import annotations

from dataclasses import dataclass

from specd.errors import InvalidArgument

ROLES = ("system", "user", "assistant")


class FieldError(InvalidArgument):
    """A request field that cannot be used, named first in the message."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}", field=field)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def check_messages(messages: list[ChatMessage], name: str = "messages") -> None:
    """Raise InvalidArgument naming the first message that cannot be rendered."""
    if not messages:
        raise FieldError(name, "must hold at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise FieldError(f"{name}[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
        if "\0" in m.content:
            # llama_chat_apply_template takes C strings: the text would end there
            raise FieldError(f"{name}[{i}].content", "must not contain NUL characters")


async def chat_prompt(router, messages: list[ChatMessage]) -> list[int]:
    """The prompt token ids of a conversation, rendered with the target's chat
    template and ending with the assistant's turn opened. The one rendering
    path of both APIs."""
    check_messages(messages)
    return await (await router.live_target()).apply_chat_template(messages)
