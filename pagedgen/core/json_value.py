"""The type of a value read from JSON (a checkpoint's ``config.json``, a tokenizer file, a chat message).

Configs, tokenizer files and chat messages arrive as parsed JSON whose shape is checked where it is read;
naming the type keeps those readers honest: a value is one of these, checked before use.
"""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = "bool | int | float | str | None | list[JsonValue] | dict[str, JsonValue]"
JsonObject: TypeAlias = "dict[str, JsonValue]"
