"""The worker's reply encoder: ``producer.protocol.replies.ReplyEncoder``, where the wire format
lives, so a worker's replies and ``producer.protocol.codec.encode_reply`` are one encoder."""

from __future__ import annotations

from producer.protocol.replies import ReplyEncoder

__all__ = ["ReplyEncoder"]
