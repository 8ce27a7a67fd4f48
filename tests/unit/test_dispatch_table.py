"""The apply core's dispatch is a literal table (issue 38): one handler per message type, named as worker.c's
``apply_handle_*`` so that grep finds each handler's caller, and none missing or left over."""

from __future__ import annotations

from applier.apply.handlers import HANDLERS, MESSAGE_NAMES


def test_every_message_type_has_its_own_handler_named_as_worker_c() -> None:
    assert set(HANDLERS) == set(MESSAGE_NAMES)
    for cls, handler in HANDLERS.items():
        assert handler.__name__ == "handle_" + MESSAGE_NAMES[cls].lower().replace(" ", "_"), (cls, handler)
    assert len({h.__name__ for h in HANDLERS.values()}) == len(HANDLERS)
