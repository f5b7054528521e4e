"""Size bounds on every string, bytes, list and map field of every request.

`RequestBounds(config).check(request)` walks a request (nested messages included) and raises
INVALID_ARGUMENT for the first field over its bound, naming the field's path and the bound,
e.g. `SubmitRequest.prompts[3].sample_id: expected at most 256 characters, got 10000000`.
The caller's value itself is never repeated. Every field gets a bound: those named in
`_OVERRIDES` get theirs, the others the default of their kind (`_defaults`), so a field added
to a .proto later is bounded too. Plans are built once per message type.
"""

from __future__ import annotations

import dataclasses

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from gateway.config import GatewayConfig
from gateway.errors import GatewayError, invalid

_STRING = FieldDescriptor.TYPE_STRING
_BYTES = FieldDescriptor.TYPE_BYTES
_MESSAGE = FieldDescriptor.TYPE_MESSAGE

# "Message.field" -> the config attribute bounding it (characters for strings, entries for
# lists and maps). For a map, "Message.field.value" bounds each value's characters.
_OVERRIDES = {
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
}
# Maps whose keys and values together are bounded (characters), not each value on its own.
_TOTALS = {"PublishRequest.params": "param_bytes_limit"}


def _default(field: FieldDescriptor) -> str:
    """The config attribute bounding a field no override names."""
    if field.is_repeated and field.type not in (_STRING, _BYTES, _MESSAGE):
        return "max_prompt_tokens"  # numbers: token ids and the like
    if field.is_repeated:
        return "max_list_items"
    return "max_name_chars"


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one field is checked: `limit` characters (string), bytes (bytes) or entries (list,
    map); each string item or string map value at most `item_limit` characters (0: not
    strings), each map key at most `key_limit`; a map's keys and values together at most
    `total_limit` characters (0: no total)."""

    name: str
    kind: str  # "string", "bytes", "list", "strings", "messages", "message", "map"
    limit: int
    item_limit: int = 0
    key_limit: int = 0
    total_limit: int = 0
    sub: tuple[_Rule, ...] = ()


class RequestBounds:
    """Checks requests against the bounds of one `GatewayConfig` (see the module docstring)."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._plans: dict[str, tuple[_Rule, ...]] = {}

    def check(self, request: Message) -> None:
        """Raise INVALID_ARGUMENT (naming the field's path and its bound) if a field of
        `request` or of a nested message is over its bound; return None otherwise."""
        desc = request.DESCRIPTOR
        _walk(request, self._plan(desc), desc.name)

    def _plan(self, desc: Descriptor) -> tuple[_Rule, ...]:
        plan = self._plans.get(desc.full_name)
        if plan is not None:
            return plan
        self._plans[desc.full_name] = ()  # a recursive type would see no rules while building
        cfg = self._config
        names = cfg.max_name_chars
        rules: list[_Rule] = []
        for f in desc.fields:
            path = f"{desc.name}.{f.name}"
            limit = int(getattr(cfg, _OVERRIDES.get(path) or _default(f)))
            if f.type == _MESSAGE and f.message_type.GetOptions().map_entry:
                value = f.message_type.fields_by_name["value"]
                total = int(getattr(cfg, _TOTALS[path])) if path in _TOTALS else 0
                item = 0 if value.type != _STRING else (total or names)
                rules.append(_Rule(f.name, "map", limit, item, names, total))
            elif f.type == _MESSAGE:
                sub = self._plan(f.message_type)
                kind = "messages" if f.is_repeated else "message"
                if f.is_repeated or sub:
                    rules.append(_Rule(f.name, kind, limit, sub=sub))
            elif f.is_repeated:
                kind = "strings" if f.type in (_STRING, _BYTES) else "list"
                rules.append(_Rule(f.name, kind, limit, names))
            elif f.type in (_STRING, _BYTES):
                rules.append(_Rule(f.name, "string" if f.type == _STRING else "bytes", limit))
        plan = tuple(rules)
        self._plans[desc.full_name] = plan
        return plan


def _over(path: str, limit: int, unit: str, got: int) -> GatewayError:
    return invalid(f"{path}: expected at most {limit} {unit}, got {got}")


def _walk(msg: Message, plan: tuple[_Rule, ...], where: str) -> None:
    for rule in plan:
        value = getattr(msg, rule.name)
        path = f"{where}.{rule.name}"
        if rule.kind == "message":
            if msg.HasField(rule.name):
                _walk(value, rule.sub, path)
            continue
        n = len(value)
        if n > rule.limit:
            unit = {"string": "characters", "bytes": "bytes"}.get(rule.kind, "entries")
            raise _over(path, rule.limit, unit, n)
        if rule.kind == "strings":
            for i, item in enumerate(value):
                if len(item) > rule.item_limit:
                    raise _over(f"{path}[{i}]", rule.item_limit, "characters", len(item))
        elif rule.kind == "map":
            _check_map(value, path, rule)
        elif rule.kind == "messages" and rule.sub:
            for i, item in enumerate(value):
                _walk(item, rule.sub, f"{path}[{i}]")


def _check_map(value, path: str, rule: _Rule) -> None:
    total = 0
    for key, item in value.items():
        if isinstance(key, str) and len(key) > rule.key_limit:
            raise _over(f"{path} key", rule.key_limit, "characters", len(key))
        total += len(key) if isinstance(key, str) else 0
        if rule.item_limit:  # string values: each bounded, or all together with the keys
            if not rule.total_limit and len(item) > rule.item_limit:
                raise _over(f"{path} value", rule.item_limit, "characters", len(item))
            total += len(item)
    if rule.total_limit and total > rule.total_limit:
        where = f"{path} (keys and values, the gateway's max_param_bytes)"
        raise _over(where, rule.total_limit, "characters", total)
