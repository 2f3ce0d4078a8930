"""The Responses API's streamed events checked against the openai package's own classes:
each event type's class, and a stream's events validated strictly, in sequence."""

from __future__ import annotations

import json
import typing

from openai.types.responses import ResponseStreamEvent

# Each event type's class in the openai package (the union's members, by their `type`).
EVENT_CLASSES = {
    cls.model_fields["type"].annotation.__args__[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def checked(event_dicts: list[dict]) -> list:
    """Each event validated strictly against its class in the openai package, its
    sequence_number the next one."""
    events = []
    for n, data in enumerate(event_dicts):
        data = json.loads(json.dumps(data))
        event = EVENT_CLASSES[data["type"]].model_validate(data)
        assert event.sequence_number == n, (n, data)
        events.append(event)
    return events
