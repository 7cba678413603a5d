"""Chat templates rendered as transformers (5.x) renders them, without importing transformers: its
sandboxed jinja2 environment (trim_blocks, lstrip_blocks, loop controls, the `{% generation %}`
tag, `raise_exception`, `strftime_now`, its non-escaping `tojson`, its guarded `dict` and
`namespace`) and what it does to a conversation before the template sees it (message objects to
dicts, None-valued keys dropped, everything rebuilt from plain JSON types, reasoning fields aliased).
Read from transformers' utils/chat_template_utils.py; `services.models.io.light_tokenizer` renders
through `render` and tests/unit/test_light_tokenizer.py compares it with transformers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any


def render(template: str, conversation: Any, *, tools: Any = None, documents: Any = None,
           add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """One conversation (a list of messages, or an object with `.messages`) rendered through `template`;
    `kwargs` (the tokenizer's special tokens, the caller's extras) are visible to it."""
    chat = _plain(_normalize(conversation))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return str(_compile(template).render(messages=_alias_reasoning(chat), tools=_plain(tools),
                                         documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                         **_plain(kwargs)))


# -- what transformers does to a conversation before the template sees it ------------------------------

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _objects_to_dicts(value: Any) -> Any:
    import dataclasses

    if isinstance(value, Mapping):
        return {k: _objects_to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def _normalize(conversation: Any) -> list[dict[str, Any]]:
    """Message objects to dicts, keys whose value is None dropped."""
    out = []
    for message in _objects_to_dicts(getattr(conversation, "messages", conversation)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _plain(value: Any) -> Any:
    """Everything a template sees rebuilt from plain JSON types; anything else an inert placeholder."""
    import dataclasses

    import numpy as np

    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache
def _compile(template: str) -> Any:
    """transformers' chat-template environment: sandboxed, trim_blocks and lstrip_blocks, loop
    controls, the `{% generation %}` tag, `raise_exception`, `strftime_now`, its `tojson`, and its
    guarded `dict` and `namespace`."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ImportError("chat templates need jinja2>=3.1.6 (older ones have sandbox escapes);"
                          f" found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' token masks;
        # rendering the text is all that is needed here.
        tags = {"generation"}  # noqa: RUF012  (jinja2 declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:  # noqa: A002  (the name templates call it with)
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, dict(*rest, **kwargs))

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                    " Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
