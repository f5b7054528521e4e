"""Builds, for every request of the Gateway service, one request per bounded field with that
field one past its bound (or at it): the spec the bounds are tested against.

`EXPECTED` names the GatewayConfig attribute of each field that has its own bound; every
other field gets the default of its kind (names: `max_name_chars`; lists of names or
messages: `max_list_items`; lists of numbers: `max_prompt_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from gateway.config import GatewayConfig
from protos import gateway_pb2 as gpb

EXPECTED = {
    "AckRequest.error": "max_text_chars",
    "ShutdownRequest.reason": "max_text_chars",
    "RunSettings.rendezvous_address": "max_text_chars",
    "SubmitRequest.prompts": "max_prompts_per_call",
    "ReturnRequest.groups": "max_prompts_per_call",
    "ReturnRequest.released_sample_ids": "max_prompts_per_call",
    "RolloutGroup.completions": "max_group_size",
    "Prompt.token_ids": "max_prompt_tokens",
    "Episode.task_json": "max_task_chars",
    "SamplingParams.stop_token_ids": "max_list_items",
    "Completion.token_ids": "max_new_tokens",
    "Completion.logprobs": "max_new_tokens",
    "Completion.forced_positions": "max_new_tokens",
    "Completion.version_spans": "max_new_tokens",
    "Completion.routed_experts": "max_route_bytes",
    "MetricsRequest.values": "max_metric_keys",
    "PublishRequest.params": "max_param_entries",
    "PublishRequest.params value": "param_bytes_limit",
}

_STRING, _BYTES, _MESSAGE = (
    FieldDescriptor.TYPE_STRING,
    FieldDescriptor.TYPE_BYTES,
    FieldDescriptor.TYPE_MESSAGE,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bounded field: its path as refusals name it (without list indices), its bound,
    the unit, and `build(n)`, a fresh request whose field has size n."""

    method: str
    path: str
    limit: int
    unit: str
    build: Callable[[int], Message]


def _attr(path: str, field: FieldDescriptor) -> str:
    if path in EXPECTED:
        return EXPECTED[path]
    if field.is_repeated and field.type not in (_STRING, _BYTES, _MESSAGE):
        return "max_prompt_tokens"
    return "max_list_items" if field.is_repeated else "max_name_chars"


def _leaves(desc: Descriptor, cfg: GatewayConfig, seen: tuple[str, ...] = ()) -> Iterator:
    """(path, limit, unit, set(msg, n)) for each bounded field under `desc`."""
    for f in desc.fields:
        path = f"{desc.name}.{f.name}"
        limit = getattr(cfg, _attr(path, f))
        name = f.name
        if f.type == _MESSAGE and f.message_type.GetOptions().map_entry:
            value = f.message_type.fields_by_name["value"]
            filler = "v" if value.type == _STRING else 1.0

            def entries(msg, n, name=name, filler=filler):
                getattr(msg, name).update({f"k{i}": filler for i in range(n)})

            def long_key(msg, n, name=name, filler=filler):
                getattr(msg, name)["k" * n] = filler

            yield path, limit, "entries", entries
            yield f"{path} key", cfg.max_name_chars, "characters", long_key
            if value.type == _STRING:
                vlimit = getattr(cfg, EXPECTED.get(f"{path} value", "max_name_chars"))

                def long_value(msg, n, name=name):
                    getattr(msg, name)[""] = "v" * n  # an empty key: n characters in all

                yield f"{path} value", vlimit, "characters", long_value
        elif f.type == _MESSAGE:
            if f.message_type.full_name in seen:
                continue
            if f.is_repeated:

                def many(msg, n, name=name):
                    for _ in range(n):
                        getattr(msg, name).add()

                yield path, limit, "entries", many
            for sub_path, sub_limit, unit, setter in _leaves(
                f.message_type, cfg, seen + (desc.full_name,)
            ):

                def nested(msg, n, name=name, setter=setter, rep=f.is_repeated):
                    child = getattr(msg, name).add() if rep else getattr(msg, name)
                    setter(child, n)

                yield sub_path, sub_limit, unit, nested
        elif f.is_repeated:
            text = f.type in (_STRING, _BYTES)
            item = "x" if f.type == _STRING else (b"x" if f.type == _BYTES else 1)

            def items(msg, n, name=name, item=item):
                getattr(msg, name).extend([item] * n)

            yield path, limit, "entries", items
            if text:

                def long_item(msg, n, name=name):
                    getattr(msg, name).append("x" * n)

                yield f"{path} item", cfg.max_name_chars, "characters", long_item
        elif f.type in (_STRING, _BYTES):

            def text_of(msg, n, name=name, kind=f.type):
                setattr(msg, name, "x" * n if kind == _STRING else b"x" * n)

            yield path, limit, "characters" if f.type == _STRING else "bytes", text_of


def cases(cfg: GatewayConfig) -> list[Case]:
    """One `Case` per bounded field of every request of the Gateway service."""
    out = []
    for method in gpb.DESCRIPTOR.services_by_name["Gateway"].methods:
        cls = getattr(gpb, method.input_type.name)
        for path, limit, unit, setter in _leaves(method.input_type, cfg):

            def build(n, cls=cls, setter=setter):
                msg = cls()
                setter(msg, n)
                return msg

            out.append(Case(method.name, path, limit, unit, build))
    return out
